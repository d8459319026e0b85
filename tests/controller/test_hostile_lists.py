"""A model list written by someone else, through every output both CLIs have: no password in
a row is shown, no row forges a log line, 10,000 garbage rows print a bounded output, and a
dry run writes nothing.

Each command runs as a user runs it (a subprocess: stderr, stdout and the files it leaves
are what is checked). The outputs: `run`'s stderr, its log (`<output>/logs/esd-sweep.log`)
and --report file; `status`; `run --dry-run`; `run --single-model`'s error; `esd-worker
--models`.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from esd_worker.core.echo import SHOWN_LINES
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

PASSWORD = "PASSW0RD-xyz"
URL_ROW = f"https://bob:{PASSWORD}@huggingface.co/org/m"
FORGED = "kind: Secret"


@dataclass(frozen=True)
class Ran:
    """What a command left: exit status, stdout, stderr, and every file it wrote."""

    code: int
    out: str
    err: str
    files: dict[Path, str]

    @property
    def everything(self) -> str:
        return "\n".join([self.out, self.err, *self.files.values()])

    def lines(self) -> list[str]:
        return self.everything.splitlines()


def _controller(*args: str) -> list[str]:
    return [sys.executable, "-m", "controller.cli", *args]


def _worker(*args: str) -> list[str]:
    return [sys.executable, "-m", "esd_worker.cli", *args]


LIST_ARGS = ("--model-list", "{list}", "--output-dir", "{out}")
# The outputs a list's rows reach, each by the command a user types.
COMMANDS = [
    pytest.param(_controller("run", *LIST_ARGS, "--device", "cpu", "--report", "{report}"),
                 id="run"),
    pytest.param(_controller("status", *LIST_ARGS), id="status"),
    pytest.param(_controller("run", "--dry-run", *LIST_ARGS, "--device", "cpu"), id="dry-run"),
    pytest.param(_controller("run", "--dry-run", "--backend", "kubernetes", "--no-telemetry",
                             "--allow-local-output", *LIST_ARGS, "--device", "cpu"),
                 id="dry-run-kubernetes"),
    pytest.param(_worker("--models", "{list}", "--output", "{out}", "--device", "cpu"),
                 id="worker-models"),
]


def make_list(path: Path, rows: Sequence[str]) -> Path:
    """A model list of these model_id cells, quoted as a spreadsheet writes them."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["model_id"])
    writer.writerows([row] for row in rows)
    path.write_text(text.getvalue(), encoding="utf-8")
    return path


def run_cli(argv: Sequence[str], tmp_path: Path, model_list: Path | None = None) -> Ran:
    """Run `argv` ({list}, {out}, {report} filled in) offline in tmp_path; every file under
    tmp_path but the list is read back."""
    values = {"list": str(model_list), "out": str(tmp_path / "out"),
              "report": str(tmp_path / "report.json")}
    done = subprocess.run(
        [arg.format(**values) for arg in argv], capture_output=True, text=True,
        cwd=tmp_path, timeout=300,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    files = {path: path.read_text(errors="replace") for path in tmp_path.rglob("*")
             if path.is_file() and path != model_list}
    return Ran(done.returncode, done.stdout, done.stderr, files)


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_password_in_a_row_is_never_shown(argv: Sequence[str], tmp_path: Path) -> None:
    """The row is cut at its last '@' to find a revision; the problem used to name the part
    before it ('https://bob:PASS'), which redaction no longer recognised. Now the row's
    problem is printed with its userinfo masked, and the password is in no output and no
    file the command wrote."""
    ran = run_cli(argv, tmp_path, make_list(tmp_path / "models.csv", [URL_ROW]))
    assert PASSWORD not in ran.everything
    assert "'https://[REDACTED]@huggingface.co/org/m' is not a model id" in ran.err


def test_a_password_in_single_model_is_a_usage_error_never_shown(tmp_path: Path) -> None:
    """--single-model is a flag: its problem is exit 2 and one error line, masked."""
    ran = run_cli(_controller("run", "--single-model", URL_ROW, "--output-dir", "{out}"),
                  tmp_path)
    assert PASSWORD not in ran.everything
    assert ran.code == 2
    (error,) = [line for line in ran.err.splitlines() if ": error:" in line]
    assert "is not a model id" in error


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_newline_in_a_model_path_cannot_forge_a_line(argv: Sequence[str],
                                                       tmp_path: Path) -> None:
    """A quoted cell '/models/x<newline>kind: Secret' used to be a valid local path, printed
    raw in log lines and command lines: 'kind: Secret' stood on a line of its own. Now the
    row is refused and shown with '\\n', so no output line starts with the forged text."""
    model_list = make_list(tmp_path / "models.csv", [f"/models/x\n{FORGED}", "org/ok"])
    ran = run_cli(argv, tmp_path, model_list)
    assert not [line for line in ran.lines() if line.lstrip(" '\"").startswith(FORGED)]
    assert "/models/x\\nkind: Secret" in ran.err


def garbage_rows(count: int) -> list[str]:
    """Bad rows of every kind a hostile list has, 1 to 10 kB each: long junk, control
    characters and ESC sequences, forged lines, URLs with passwords, bad revisions."""
    kinds = [
        lambda i: "!" * 1000 + str(i),
        lambda i: f"/m/{i}\n{FORGED}\n" + "x" * 1000,
        lambda i: f"org/m{i}@" + "\x1b[2J" * 300,
        lambda i: f"https://bob:{PASSWORD}@host/{i}/" + "y" * 1000,
        lambda i: f"org/{i}/" + "z" * 10_000,
    ]
    return [kinds[i % len(kinds)](i) for i in range(count)]


@pytest.mark.parametrize("argv", COMMANDS)
def test_ten_thousand_garbage_rows_print_a_bounded_output(argv: Sequence[str],
                                                          tmp_path: Path) -> None:
    """10,000 bad rows of 1 to 10 kB used to print one line each, every cell whole (17 MiB).
    Now the first SHOWN_LINES are shown, each cut at 200 characters, then one line counts
    the other 9,980: stderr and the log stay under SHOWN_LINES + 10 lines (the others are
    the command's own: the plan's counts, the error), and every output under 64 kB."""
    model_list = make_list(tmp_path / "models.csv", garbage_rows(10_000))
    ran = run_cli(argv, tmp_path, model_list)
    assert f"… and {10_000 - SHOWN_LINES:,} more bad row(s) not shown" in ran.err
    logs = [text for path, text in ran.files.items() if path.suffix == ".log"]
    for text in [ran.err, *logs]:
        assert len(text.splitlines()) < SHOWN_LINES + 10
    for text in [ran.err, ran.out, *ran.files.values()]:  # reports, dry-run output too
        assert len(text.encode()) < 64 * 1024
    assert PASSWORD not in ran.everything
    assert not [line for line in ran.lines() if line.lstrip(" '\"").startswith(FORGED)]


def test_status_bad_rows_lists_every_bad_row_one_line_each(tmp_path: Path) -> None:
    """Where the rows not shown are: `status --bad-rows` prints all 10,000 on stdout, one
    line each (file:line: problem), each bounded and redacted as the shown ones are."""
    model_list = make_list(tmp_path / "models.csv", garbage_rows(10_000))
    ran = run_cli(_controller("status", "--bad-rows", *LIST_ARGS), tmp_path, model_list)
    assert ran.code == 0
    lines = ran.out.splitlines()
    assert len(lines) == 10_000
    assert lines[0].startswith(f"{model_list}:2: ") and lines[-1].startswith(f"{model_list}:")
    assert max(len(line) for line in lines) < 1000
    assert PASSWORD not in ran.everything
    assert not [line for line in ran.lines() if line.lstrip(" '\"").startswith(FORGED)]


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param((), id="local"),
        pytest.param(("--backend", "kubernetes", "--no-telemetry", "--allow-local-output"),
                     id="kubernetes-sharded"),
        pytest.param(("--backend", "kubernetes", "--no-telemetry", "--allow-local-output",
                      "--shard-size", "1"), id="kubernetes-per-model"),
    ],
)
def test_a_dry_run_writes_nothing(extra: Sequence[str], tmp_path: Path) -> None:
    """--dry-run prints what would start and starts nothing; it used to create the output
    folder to write its log in <output>/logs. Now the output does not exist afterwards and
    no file but the list is under tmp_path: the plan's lines went to stderr."""
    model_list = make_list(tmp_path / "models.csv", ["org/ok", "!bad"])
    ran = run_cli(_controller("run", "--dry-run", *LIST_ARGS, "--device", "cpu", *extra),
                  tmp_path, model_list)
    assert ran.code == 0, ran.err
    assert "1 bad row(s)" in ran.err and "nothing started" in ran.err
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == [model_list]
