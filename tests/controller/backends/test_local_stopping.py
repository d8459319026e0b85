"""The local backend stopping: Ctrl+C once and twice, SIGTERM then SIGKILL, a stop during a retry
pause, errors in callbacks, a killed controller (real subprocesses, no GPU)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from controller.backends.base import Outcome, Task
from controller.backends.local.backend import LocalBackend
from controller.backends.local.settings import LocalSettings
from tests.support import REPO_ROOT
from tests.support.local import FAST, exit_task, make_task


def test_first_stop_lets_running_finish_and_starts_nothing_new() -> None:
    started: list[str] = []
    holder: dict[str, LocalBackend] = {}

    def on_start(task: Task, gpus: tuple[int, ...]) -> None:
        started.append(task.key)
        holder["b"].request_stop()

    backend = LocalBackend(LocalSettings(cpu_workers=1), None, on_start=on_start)
    holder["b"] = backend
    tasks = [make_task(f"t{i}", "import time; time.sleep(0.3)") for i in range(3)]
    outcomes = backend.run(tasks)
    assert started == ["t0"]
    assert [(o.task.key, o.status) for o in outcomes] == [("t0", "done")]


def test_second_stop_terminates_the_process_group_as_cancelled(tmp_path: Path) -> None:
    """SIGTERM goes to the worker's whole group: a child it started goes too."""
    child_pid = tmp_path / "child.pid"
    script = f"""
        import pathlib, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pathlib.Path({str(child_pid)!r}).write_text(str(child.pid))
        time.sleep(60)
    """
    backend = LocalBackend(FAST, None)
    stopper = _stop_when(backend, child_pid, times=2)
    t0 = time.monotonic()
    [outcome] = backend.run([make_task("long", script)])
    stopper.join()
    assert time.monotonic() - t0 < 10
    assert (outcome.status, outcome.signal, outcome.exit_code) == ("cancelled", 15, None)
    _assert_gone(int(child_pid.read_text()))


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = f"""
        import pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path({str(ready)!r}).write_text("x")
        time.sleep(60)
    """
    settings = LocalSettings(terminate_grace_s=0.3)
    backend = LocalBackend(settings, None)
    stopper = _stop_when(backend, ready, times=2)
    [outcome] = backend.run([make_task("stubborn", script)])
    stopper.join()
    assert (outcome.status, outcome.signal) == ("cancelled", 9)
    assert outcome.duration_s >= 0.3


def test_stop_during_a_retry_pause_reports_the_failure_as_retryable() -> None:
    """A long backoff is not waited out after a stop; the transient failure is recorded as
    retryable so the next run tries again."""
    settings = LocalSettings(max_retries=3, backoff_s=30.0)
    backend = LocalBackend(settings, None)

    class StopOnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retry in" in record.getMessage():
                backend.request_stop()

    logger = logging.getLogger("controller.backends.local.loop")
    handler = StopOnRetry()
    logger.addHandler(handler)
    try:
        t0 = time.monotonic()
        [outcome] = backend.run([exit_task("t", 4)])
    finally:
        logger.removeHandler(handler)
    assert time.monotonic() - t0 < 5
    assert (outcome.status, outcome.attempts, outcome.retryable) == ("failed", 1, True)


def test_error_in_a_callback_leaves_no_worker_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    slow = make_task("slow", f"""
        import os, pathlib, time
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """)
    fast = make_task("fast", f"""
        import pathlib, time
        while not pathlib.Path({str(pid_file)!r}).exists():
            time.sleep(0.01)
    """)

    def on_outcome(outcome: Outcome) -> None:
        raise RuntimeError("store is down")

    backend = LocalBackend(LocalSettings(cpu_workers=2, terminate_grace_s=2.0), None)
    with pytest.raises(RuntimeError, match="store is down"):
        backend.run([slow, fast], on_outcome)
    _assert_gone(int(pid_file.read_text()))


def test_workers_die_with_a_killed_controller(tmp_path: Path) -> None:
    """SIGKILL of the controller must not leave orphan workers holding GPUs and racing the
    next run on the same models (they run in their own session, so Ctrl+C would not reach
    them either)."""
    pid_file = tmp_path / "worker.pid"
    worker = (
        f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()));"
        " time.sleep(60)"
    )
    controller = textwrap.dedent(f"""
        import sys
        from controller.backends.base import Task
        from controller.backends.local.backend import LocalBackend
        from controller.backends.local.settings import LocalSettings
        task = Task(key="w", argv=(sys.executable, "-c", {worker!r}), label="w")
        LocalBackend(LocalSettings(), None).run([task])
    """)
    proc = subprocess.Popen([sys.executable, "-c", controller], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 10
        # Its content, not only the file: write_text creates the file before it writes.
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pid_file.exists() and pid_file.read_text(), "the worker never started"
        proc.kill()
        proc.wait()
        _assert_gone(int(pid_file.read_text()))
    finally:
        if proc.poll() is None:
            proc.kill()


def _stop_when(backend: LocalBackend, path: Path, *, times: int) -> threading.Thread:
    """Call request_stop `times` times once `path` exists (the worker is ready)."""

    def wait_then_stop() -> None:
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(times):
            backend.request_stop()

    thread = threading.Thread(target=wait_then_stop, daemon=True)
    thread.start()
    return thread


def _assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A killed child of a dead worker is reparented and reaped by init; a zombie of
        # ours would show in /proc as state Z.
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"process {pid} still runs")
