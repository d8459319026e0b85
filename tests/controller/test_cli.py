"""`esd-sweep` in this process: what a user is told and what is left on disk when a command
refuses to run, and how the list's problems reach the counts. (Sweeps that run workers are
tests/controller/test_sweep.py's.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from controller.cli import main
from controller.errors import EXIT_USAGE
from controller.run.runlog import HeldLog

pytestmark = pytest.mark.usefixtures("restore_logging")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("esd-sweep: error:")]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        pytest.param(["run", "--model-list", "{list}", "--strict"],
                     "--strict is set: nothing was started", id="strict-and-a-bad-row"),
        pytest.param(["run", "--single-model", "org/x y"],
                     "--single-model: malformed model id 'org/x y'", id="single-model-malformed"),
        pytest.param(["run", "--single-model", "org/a", "--relation", "lora",
                      "--source-model", "org/base@"],
                     "--single-model: source_model: empty revision", id="single-model-base"),
        pytest.param(["status", "--single-model", "org/x y"],
                     "--single-model: malformed model id", id="status-single-model"),
        pytest.param(["run", "--model-list", "{list}", "--single-model", "org/a"],
                     "give exactly one of --model-list FILE and --single-model ID",
                     id="usage-error"),
    ],
)
def test_a_refused_command_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], fragment: str
) -> None:
    """Refused before it starts: exit 2 (a usage error to fix, not 1 'some model failed'),
    one line that says why, and no output folder at all: no logs/, no runs/, no
    summary.csv (a later look at the folder would take them for a run)."""
    models = tmp_path / "models.csv"
    models.write_text("model_id\norg/a\nbad id\n")
    out = tmp_path / "out"
    args = [arg.format(list=models) for arg in argv]
    code = main([*args, "--output-dir", str(out), *(["--device", "cpu"] if "run" in args else [])])
    stderr = capsys.readouterr().err
    assert code == EXIT_USAGE, stderr
    (line,) = error_lines(stderr)
    assert fragment in line
    assert not out.exists()


def test_status_counts_the_rows_an_unclosed_quote_would_swallow(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A quote opened and never closed made the rows after it one cell ('models: 1', no bad
    row, exit 0 for a run): it is one bad row, and the rows after it are models."""
    models = tmp_path / "models.csv"
    models.write_text('model_id,notes\norg/a,"never closed\norg/b,x\norg/c,y\n')
    code = main(["status", "--model-list", str(models), "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    counts = json.loads(captured.out)
    assert (counts["models"], counts["bad_rows"], counts["todo"]) == (2, 1, 2)
    assert f"{models}:2: unbalanced quote" in captured.err


def test_the_log_file_gets_the_lines_logged_before_it_opened(tmp_path: Path) -> None:
    """Lines logged before the run starts (the plan's bad rows) are held, up to a limit,
    and written first when the file opens; the file says how many it could not hold."""
    log_file = tmp_path / "logs" / "esd-sweep.log"
    held = HeldLog(log_file, verbose=False, fmt="text", limit=2)
    log = logging.getLogger("controller.test")
    for i in range(3):
        log.warning("before %d", i)
    assert not log_file.parent.exists()
    held.open()
    log.warning("after")
    text = log_file.read_text()
    lines = [line.split(": ", 1)[1] for line in text.splitlines()]
    assert lines == ["before 0", "before 1",
                     "1 line(s) logged before this one are not in this file (they went to "
                     "stderr)", "after"]


@pytest.mark.parametrize("planted", ["report.json.tmp", "report.json"],
                         ids=["old-temporary-name", "the-report-itself"])
def test_the_report_never_writes_through_a_planted_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, planted: str
) -> None:
    """--report FILE.json is often written into a folder others may write (a CI workspace):
    a symlink planted at its temporary name (before: the fixed `<FILE>.json.tmp`, written
    through, so the file it named was overwritten with the report) or at its own name leaves
    the file the link names as it was; the report lands at its name as a regular file."""
    folder = tmp_path / "ci"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the victim's own file\n")
    (folder / planted).symlink_to(victim)
    report_file = folder / "report.json"
    code = main(["run", "--model-list", "m.csv", "--output-dir", str(tmp_path / "o"),
                 "--report", str(report_file), "--retry-backoff", "nan"])
    assert code == EXIT_USAGE, capsys.readouterr().err
    assert victim.read_bytes() == b"the victim's own file\n"
    assert not report_file.is_symlink()
    assert json.loads(report_file.read_text())["exit_code"] == EXIT_USAGE
