"""Tests of controller.run.commands: the custom-commands file, split like a shell without one."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from controller.run.commands import read_commands


def test_read_commands_splits_lines_like_a_shell_without_one(tmp_path: Path) -> None:
    path = tmp_path / "commands.txt"
    path.write_text(textwrap.dedent("""\
        # commands.txt
        python esd_analysis/run_analysis.py --single-model model1 --output-dir ./out1

        python custom_script.py --arg1 "two words" # trailing comment
          # indented comment
        echo 'a;b' $HOME
    """))
    tasks = read_commands(path)
    assert [(t.key, t.argv) for t in tasks] == [
        ("cmd-2", ("python", "esd_analysis/run_analysis.py", "--single-model", "model1",
                   "--output-dir", "./out1")),
        ("cmd-4", ("python", "custom_script.py", "--arg1", "two words")),
        ("cmd-6", ("echo", "a;b", "$HOME")),
    ]
    assert tasks[1].label == 'python custom_script.py --arg1 "two words" # trailing comment'


def test_read_commands_reports_unsplittable_lines(tmp_path: Path) -> None:
    path = tmp_path / "commands.txt"
    path.write_text('echo ok\necho "unclosed\n')
    with pytest.raises(ValueError, match=r"commands.txt:2: cannot split the command"):
        read_commands(path)
