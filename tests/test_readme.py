"""The README's command lines are ones the commands take: every `esd-sweep` and `esd-worker`
line of its shell blocks parses with the real parsers (users copy them as they are)."""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath

import pytest

from tests.support import REPO_ROOT

README = REPO_ROOT / "README.md"
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PROGRAMS = ("esd-sweep", "esd-worker")


def shell_commands(text: str) -> list[list[str]]:
    """argv of each esd-sweep / esd-worker command in the shell blocks of `text` (lines
    joined where they end in a backslash, comments dropped, any path before the name)."""
    commands = []
    for block in _SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and PurePosixPath(argv[0]).name in PROGRAMS:
                commands.append([PurePosixPath(argv[0]).name, *argv[1:]])
    return commands


COMMANDS = shell_commands(README.read_text(encoding="utf-8"))


@pytest.mark.parametrize("argv", COMMANDS, ids=[shlex.join(argv) for argv in COMMANDS])
def test_a_readme_command_parses(argv: list[str]) -> None:
    """argparse exits (2, one line on stderr) on a flag the command does not take; results
    commands (`report`, `refit`, `compare`) read only the store and take no model list."""
    assert {a[0] for a in COMMANDS} == set(PROGRAMS) and len(COMMANDS) >= 10  # all were found
    if argv[0] == "esd-sweep":
        from controller.cli import build_parser
    else:
        from esd_worker.cli import build_parser
    build_parser().parse_args(argv[1:])
