"""A log folder that fills up: logging degrades to one warning, the work goes on, nothing hangs
and no thread prints a traceback.

A full disk is simulated as in test_disk.py, with RLIMIT_FSIZE: a write past the limit fails
with EFBIG, an OSError from the same write call as ENOSPC. The backend tests set the limit
in this process for the length of one run (the stand-in workers inherit it; they write only
pipes and a few short state lines), so the controller's own log writes fail as they would on
a full disk; the command-line tests set it in the sweep's process.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.backends.base import Outcome, Task
from controller.backends.local.backend import LocalBackend
from controller.backends.local.settings import LocalSettings
from tests.controller.backends.test_served import backend, tasks
from tests.faults.conftest import esd_sweep, run_args
from tests.support.local import FAST, make_task

LOG_LIMIT = 64 * 1024  # bytes a file may grow to: the stand-in's chatty model writes 256 KiB
RUN_TIMEOUT_S = 60.0  # the runs below take a few seconds; past this they hang


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes in this process (and its new children) past `limit` bytes fail with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def run_bounded(run: Callable[[list[Task]], list[Outcome]], todo: list[Task]) -> list[Outcome]:
    """run(todo) in a thread, failing the test when it has not returned in RUN_TIMEOUT_S."""
    got: list[list[Outcome]] = []
    thread = threading.Thread(target=lambda: got.append(run(todo)), daemon=True)
    thread.start()
    thread.join(RUN_TIMEOUT_S)
    assert not thread.is_alive(), f"the run hung: no end after {RUN_TIMEOUT_S:.0f}s"
    assert got, "the run raised (see the thread's traceback above)"
    return got[0]


def full_log_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "cannot be written" in r.getMessage()]


def test_a_full_log_folder_never_stops_a_long_lived_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """chatty-a's log passes the limit mid-model; chatty-b then writes four pipe buffers of
    stderr. Had the log reader stopped at chatty-a's failed log (it did: `close()` raised),
    nobody would read the pipe and chatty-b's worker would block on it for ever. All three
    models are done, a model's tail is still kept, and the full folder is said once."""
    logs = tmp_path / "logs"
    b = backend(tmp_path, monkeypatch, log_dir=logs)
    todo = tasks("chatty-a", "chatty-b", "ok-c")
    with file_size_limit(LOG_LIMIT):
        outcomes = run_bounded(b.run, todo)
    assert [(o.status, o.attempts) for o in outcomes] == [("done", 1)] * 3
    assert len(full_log_warnings(caplog)) == 1
    assert all(p.stat().st_size <= LOG_LIMIT for p in (logs / "workers").iterdir())


def test_a_custom_command_starts_when_its_log_is_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attempt's log is already at the limit, so the controller's attempt header cannot
    be written: that is no reason not to run the command (it was a StartFailed failure, not
    retried), nor to crash when the log is closed. The command (which prints nothing: what
    it would print is its own to lose) runs and exits 0: done, and the full log is said once
    for the two tasks."""
    settings = LocalSettings(max_retries=FAST.max_retries, backoff_s=FAST.backoff_s,
                             log_dir=tmp_path / "logs")
    todo = [make_task(key, "import sys; sys.exit(0)") for key in ("full-a", "full-b")]
    (tmp_path / "logs" / "workers").mkdir(parents=True)
    for task in todo:
        (tmp_path / "logs" / "workers" / f"{task.key}.log").write_bytes(b"x" * LOG_LIMIT)
    with file_size_limit(LOG_LIMIT):
        outcomes = run_bounded(LocalBackend(settings, None).run, todo)
    assert [(o.status, o.attempts, o.error) for o in outcomes] == [("done", 1, "")] * 2
    assert len(full_log_warnings(caplog)) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("limit", "exit_code"),
    [(0, 3), (1000, 3)],
    ids=["nothing-fits", "logs-fill-in-the-first-model"],
)
def test_a_full_output_disk_prints_one_line_and_no_thread_traceback(
    model_list: Path, tmp_path: Path, limit: int, exit_code: int
) -> None:
    """Under these limits every worker and model log fills up, and so does the failure
    record of the first model that fails: the sweep stops with exit 3 and the store's one
    line (the right outcome: it cannot record what happened). Beside it, each worker's
    log-reader thread used to print "Exception in thread esd-logs-N" and a traceback."""
    out = tmp_path / "results"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = esd_sweep(*run_args(model_list, str(out), "--max-retries", "1"),
                     preexec_fn=limit_file_size, timeout=300)
    assert full.returncode == exit_code, full.stderr
    assert "Traceback" not in full.stderr
    assert "Exception in thread" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("esd-sweep: error: result store: cannot write ") and \
        last.endswith("File too large"), last
