"""Custom-commands mode's input: a file of command lines to run under the GPU management.

Owns the file format (one command per line, # comments, blank lines skipped). Lines are
split like a POSIX shell would, but never run by a shell.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from controller.backends.base import Task


def read_commands(path: Path) -> list[Task]:
    """Tasks from a commands file; the key is cmd-<line number>, so it stays the same when
    the file is read again. ValueError naming every line that cannot be split."""
    tasks: list[Task] = []
    problems: list[str] = []
    text = path.read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as e:
            problems.append(f"{path}:{number}: cannot split the command: {e}")
            continue
        if argv:
            tasks.append(Task(key=f"cmd-{number}", argv=tuple(argv), label=line.strip()))
    if problems:
        raise ValueError("; ".join(problems))
    return tasks
