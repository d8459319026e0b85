"""The local backend: runs tasks as subprocesses on free GPUs (or CPU slots), retries, reports.

It owns processes, their logs and retries; it does not know about models, the store or
records (the caller turns each Outcome into a record from the on_outcome callback).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import logging
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from controller import records
from controller.gpus import GpuTracker
from controller.progress import Progress
from esd_worker.errors import (  # the exit-code contract; the module does not import torch
    EXIT_OK,
)

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024
_REAP_WAIT_S = 0.02  # how often running processes are checked: exits are noticed within this
_PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class Task:
    """One unit of work: a command to run as a subprocess.

    key: model_key (or "cmd-<line>" in custom-commands mode); names the worker log file.
    argv: the command as an argument list, never a shell string.
    label: for logs and progress: the model reference or the command line.
    env: extra environment for the worker. Secrets never go in argv: the worker inherits
        HF_TOKEN / AWS_* from the controller's environment.
    """

    key: str
    argv: tuple[str, ...]
    label: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """How a task ended.

    status: "done" (exit 0), "failed" (last attempt failed; no retry left, not retryable, or
        a stop was requested), "cancelled" (terminated by a second request_stop).
    exit_code: the last attempt's exit status; None when killed by a signal or never started.
    signal: the signal number that killed the last attempt, else None.
    attempts: attempts started.
    duration_s: run time of the last attempt, seconds; total_s: of all attempts (backoff
        pauses not included); wait_s: time spent waiting for a GPU or CPU slot, all attempts.
    gpus: GPUs of the last attempt (empty on CPU).
    stderr_tail: last lines of the last attempt's output (stdout and stderr together).
    log_path: the worker log file (all attempts), or None without a log directory.
    error: "" when done, else "<Class>: <what happened>" (see classify_exit).
    retryable: whether another attempt could help (transient: exit 4/5, killed by a signal).
    """

    task: Task
    status: str
    exit_code: int | None
    signal: int | None
    attempts: int
    duration_s: float
    total_s: float
    wait_s: float
    gpus: tuple[int, ...]
    stderr_tail: tuple[str, ...]
    log_path: str | None
    error: str
    retryable: bool


@dataclass(frozen=True)
class LocalSettings:
    """How the local backend runs workers.

    max_retries: extra attempts for transient failures (exit 4/5, killed by a signal);
        default 2, so at most 3 attempts.
    backoff_s: pause before the first retry, seconds (default 5.0); doubles per retry, with
        jitter (x0.5..1.0); other tasks keep running meanwhile.
    backoff_max_s: longest pause between attempts, seconds (default 300).
    cpu_workers: workers at the same time without a GPU tracker (CPU mode; default 1).
    log_dir: each attempt's stdout+stderr is appended to <log_dir>/workers/<key>.log under
        an attempt header (default None: output kept only for the stderr tail).
    terminate_grace_s: after SIGTERM, seconds before SIGKILL (default 10).
    """

    max_retries: int = 2
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    cpu_workers: int = 1
    log_dir: Path | None = None
    terminate_grace_s: float = 10.0

    def validate(self) -> None:
        """Raise one ValueError that names every bad field."""
        problems: list[str] = []
        if self.max_retries < 0:
            problems.append(f"max_retries: must be >= 0, got {self.max_retries}")
        if not self.backoff_s >= 0:
            problems.append(f"backoff_s: must be >= 0 s, got {self.backoff_s}")
        if not self.backoff_max_s >= 0:
            problems.append(f"backoff_max_s: must be >= 0 s, got {self.backoff_max_s}")
        if self.cpu_workers < 1:
            problems.append(f"cpu_workers: must be >= 1, got {self.cpu_workers}")
        if not self.terminate_grace_s >= 0:
            problems.append(f"terminate_grace_s: must be >= 0 s, got {self.terminate_grace_s}")
        if problems:
            raise ValueError("invalid local backend settings: " + "; ".join(problems))


_MEANINGS = {
    "UsageError": "the worker rejected its command line",
    "PermanentModelError": "retrying cannot help",
    "TransientError": "network, storage or preemption trouble",
    "GpuOutOfMemoryError": "the GPU ran out of memory",
    "WorkerCrashed": "the worker failed outside its own error handling",
}


class LogDirError(OSError):
    """The worker log under --log-dir cannot be written (the sweep stops: exit 2)."""


def classify_exit(returncode: int) -> tuple[str, bool]:
    """(error, retryable) for a Popen return code; ("", False) for success.

    The class and whether to retry come from records.classify_exit (the one place that
    maps the worker's exit-code contract); this adds what happened, for people.
    """
    exit_code, sig = (None, -returncode) if returncode < 0 else (returncode, None)
    cls, retryable = records.classify_exit(exit_code, sig)
    if not cls:
        return "", False
    if sig is not None:
        return f"{cls}: the worker was killed by {records.signal_name(sig)}", retryable
    meaning = _MEANINGS.get(cls)
    detail = f"{meaning} (exit {returncode})" if meaning else f"the worker exited {returncode}"
    return f"{cls}: {detail}", retryable


def read_commands(path: Path) -> list[Task]:
    """Tasks from a commands file: one command per line, # comments and blank lines skipped.

    Each line is split like a POSIX shell would (shlex), but never run by a shell. The key
    is cmd-<line number>, so it stays the same when the file is read again.
    """
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


@dataclass
class _Attempt:
    """What the last finished attempt of a job left behind."""

    exit_code: int | None
    signal: int | None
    duration_s: float
    gpus: tuple[int, ...]
    stderr_tail: tuple[str, ...]
    error: str
    retryable: bool


@dataclass
class _Job:
    task: Task
    ready_since: float
    attempts: int = 0
    total_s: float = 0.0
    wait_s: float = 0.0
    last: _Attempt | None = None
    log_path: Path | None = None


@dataclass
class _Running:
    job: _Job
    proc: subprocess.Popen[bytes]
    gpus: tuple[int, ...]
    started: float
    output: IO[bytes]
    offset: int
    terminate_at: float | None = None  # when SIGTERM was sent (second stop request)
    killed: bool = False


class LocalBackend:
    """Runs tasks as subprocesses, each on its own GPUs (tracker) or a CPU slot (no tracker).

    With a tracker every task needs `gpus_per_job` GPUs from `tracker.acquire`, runs with
    CUDA_VISIBLE_DEVICES set to them (and CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers
    GPUs like NVML does), and gives them back when it exits. Without one, up to
    `settings.cpu_workers` run at once with CUDA_VISIBLE_DEVICES="" so that no worker grabs
    a GPU by accident. Workers get their own session (process group): Ctrl+C at the
    terminal reaches the controller only, which decides via request_stop.
    Callbacks and progress updates run in the thread that called run().
    """

    def __init__(
        self,
        settings: LocalSettings,
        tracker: GpuTracker | None,
        *,
        gpus_per_job: int = 1,
        on_outcome: Callable[[Outcome], None] | None = None,
        on_start: Callable[[Task, tuple[int, ...]], None] | None = None,
        progress: Progress | None = None,
    ) -> None:
        settings.validate()
        if gpus_per_job < 1:
            raise ValueError(f"gpus_per_job: must be >= 1, got {gpus_per_job}")
        if tracker is not None and gpus_per_job > tracker.capacity:
            raise ValueError(
                f"gpus_per_job: {gpus_per_job} GPU(s) per job, but only {tracker.capacity} "
                f"usable (GPUs {','.join(map(str, tracker.gpus)) or 'none'}, "
                f"max_gpus={tracker.settings.max_gpus})"
            )
        self.settings = settings
        self.tracker = tracker
        self.gpus_per_job = gpus_per_job
        self.on_outcome = on_outcome
        self.on_start = on_start
        self.progress = progress
        # Plain int, not an Event: request_stop runs in signal handlers, where taking the
        # lock inside Event.set could deadlock against the interrupted main thread.
        self._stop_requests = 0
        self._random = random.Random()
        self._counts = {"done": 0, "failed": 0}

    def request_stop(self) -> None:
        """1st call: start nothing new, let running workers finish. 2nd: terminate them.

        Safe to call from a signal handler or another thread; run() acts on it within
        a few tens of milliseconds.
        """
        self._stop_requests += 1

    # The run loop -------------------------------------------------------------------------

    def run(self, tasks: Iterable[Task]) -> list[Outcome]:
        """Run every task; return when all have ended, or a stop was requested and the
        running ones have ended.

        Returns one Outcome per task that started at least once (tasks never started
        because of a stop have none; the next run picks them up).
        """
        now = time.monotonic()
        queue: deque[_Job] = deque(_Job(task, ready_since=now) for task in tasks)
        delayed: list[tuple[float, int, _Job]] = []  # (due, tie-breaker, job) heap
        running: list[_Running] = []
        outcomes: list[Outcome] = []
        seq = 0
        next_poll = now
        next_progress = now
        stop_seen = 0
        try:
            while True:
                now = time.monotonic()
                changed = False
                for worker in [r for r in running if r.proc.poll() is not None]:
                    running.remove(worker)
                    changed = True
                    released = self._finish(worker, now)
                    if released and queue:
                        next_poll = now  # a released GPU needs one fresh poll: take it now
                    job = worker.job
                    assert job.last is not None
                    if (
                        job.last.retryable
                        and worker.terminate_at is None
                        and job.attempts <= self.settings.max_retries
                        and self._stop_requests == 0
                    ):
                        delay = self._backoff(job.attempts)
                        log.warning(
                            "model=%s key=%s attempt %d failed (%s); retry in %.3gs",
                            job.task.label, job.task.key, job.attempts, job.last.error, delay,
                        )
                        seq += 1
                        heapq.heappush(delayed, (now + delay, seq, job))
                    else:
                        status = self._status(job.last, cancelled=worker.terminate_at is not None)
                        self._emit(job, status, outcomes)

                stop = self._stop_requests
                if stop > stop_seen:
                    changed = True
                    if stop_seen == 0:
                        self._stop_dispatching(queue, delayed, running, outcomes)
                    if stop >= 2:
                        self._terminate(running, now)
                    stop_seen = stop
                self._kill_overdue(running, now)

                while delayed and delayed[0][0] <= now:
                    _, _, job = heapq.heappop(delayed)
                    job.ready_since = now
                    queue.appendleft(job)  # a retry goes before fresh work
                    changed = True

                if queue or delayed:
                    if self.tracker is not None and now >= next_poll:
                        self.tracker.poll()
                        next_poll = now + self.tracker.settings.poll_interval_s
                    changed |= self._dispatch(queue, running, outcomes, now)

                if changed or now >= next_progress:
                    self._update_progress(running, queue, delayed)
                    next_progress = now + _PROGRESS_EVERY_S
                if not (queue or delayed or running):
                    return outcomes
                wait = _REAP_WAIT_S
                if not running:
                    # Nothing to reap: sleep until the next poll or retry, but stay responsive
                    # to request_stop.
                    due = min([next_poll] + ([delayed[0][0]] if delayed else []))
                    wait = min(max(due - now, 0.001), 0.1)
                time.sleep(wait)
        finally:
            if running:
                # An exception (a callback's, or KeyboardInterrupt without a handler) ends
                # run(): never leave workers behind holding GPUs.
                log.warning("stopping %d running worker(s) after an error", len(running))
                self._terminate(running, time.monotonic())
                self._reap_all(running)

    # Steps of the loop ----------------------------------------------------------------------

    def _dispatch(
        self, queue: deque[_Job], running: list[_Running], outcomes: list[Outcome], now: float
    ) -> bool:
        started = False
        while queue:
            if self.tracker is None:
                if len(running) >= self.settings.cpu_workers:
                    break
                gpus: tuple[int, ...] = ()
            else:
                got = self.tracker.acquire(self.gpus_per_job)
                if got is None:
                    break
                gpus = got
            job = queue.popleft()
            started = True
            run = self._start(job, gpus, outcomes, now)
            if run is not None:
                running.append(run)
            # A start failure was already reported; its GPUs are back with the tracker.
        return started

    def _start(
        self, job: _Job, gpus: tuple[int, ...], outcomes: list[Outcome], now: float
    ) -> _Running | None:
        task = job.task
        job.attempts += 1
        job.wait_s += max(now - job.ready_since, 0.0)
        try:
            output, job.log_path = self._open_output(task)
        except BaseException:
            if gpus and self.tracker is not None:
                self.tracker.release(gpus)
            raise  # the log directory is unusable: a setup problem, not this task's
        header = (
            f"\n=== {datetime.now(timezone.utc).isoformat(timespec='seconds')} "
            f"attempt {job.attempts} key={task.key} "
            f"gpus={','.join(map(str, gpus)) or 'cpu'} ===\n$ {shlex.join(task.argv)}\n"
        )
        output.write(header.encode("utf-8", "replace"))
        output.flush()
        offset = output.tell()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # keep the tail complete if it is killed
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML's numbering, which the tracker uses
        if self.tracker is None:
            # CPU workers share the cores: N workers each using every core run several
            # times slower than N workers with cores/N threads (measured on 2 cores).
            threads = max(1, (os.cpu_count() or 1) // self.settings.cpu_workers)
            env.setdefault("OMP_NUM_THREADS", str(threads))
        env.update(task.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        try:
            proc = subprocess.Popen(
                list(task.argv),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        except (OSError, ValueError) as e:
            output.write(f"could not start: {e}\n".encode("utf-8", "replace"))
            output.close()
            if gpus and self.tracker is not None:
                self.tracker.release(gpus)
            job.last = _Attempt(
                exit_code=None, signal=None, duration_s=0.0, gpus=gpus,
                stderr_tail=(f"could not start: {e}",),
                error=f"StartFailed: cannot run {task.argv[0] if task.argv else '(empty)'}: {e}",
                retryable=False,
            )
            log.error("model=%s key=%s could not start: %s", task.label, task.key, e)
            self._emit(job, "failed", outcomes)
            return None
        log.info(
            "model=%s key=%s started attempt %d on %s pid=%d",
            task.label, task.key, job.attempts,
            f"gpus={','.join(map(str, gpus))}" if gpus else "cpu", proc.pid,
        )
        if self.on_start is not None:
            self.on_start(task, gpus)
        return _Running(job=job, proc=proc, gpus=gpus, started=now, output=output, offset=offset)

    def _finish(self, run: _Running, now: float) -> bool:
        """Record a reaped attempt on its job; True when GPUs went back to the tracker."""
        job = run.job
        duration = max(now - run.started, 0.0)
        job.total_s += duration
        tail = _read_tail(run.output, run.offset)
        run.output.close()
        rc = run.proc.returncode
        error, retryable = classify_exit(rc)
        job.last = _Attempt(
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            duration_s=duration,
            gpus=run.gpus,
            stderr_tail=tail,
            error=error,
            retryable=retryable,
        )
        if run.gpus and self.tracker is not None:
            self.tracker.release(run.gpus)
            return True
        return False

    @staticmethod
    def _status(last: _Attempt, *, cancelled: bool) -> str:
        if last.exit_code == EXIT_OK:
            return "done"  # finished before the termination took effect: the result is there
        return "cancelled" if cancelled else "failed"

    def _emit(self, job: _Job, status: str, outcomes: list[Outcome]) -> None:
        last = job.last
        assert last is not None
        outcome = Outcome(
            task=job.task,
            status=status,
            exit_code=last.exit_code,
            signal=last.signal,
            attempts=job.attempts,
            duration_s=last.duration_s,
            total_s=job.total_s,
            wait_s=job.wait_s,
            gpus=last.gpus,
            stderr_tail=last.stderr_tail,
            log_path=str(job.log_path) if job.log_path is not None else None,
            error="" if status == "done" else last.error,
            retryable=status != "done" and last.retryable,
        )
        outcomes.append(outcome)
        if status in self._counts:
            self._counts[status] += 1
            if self.progress is not None:
                self.progress.record_duration(job.total_s)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _stop_dispatching(
        self,
        queue: deque[_Job],
        delayed: list[tuple[float, int, _Job]],
        running: list[_Running],
        outcomes: list[Outcome],
    ) -> None:
        waiting = list(queue) + [job for _, _, job in sorted(delayed)]
        queue.clear()
        delayed.clear()
        retried = [job for job in waiting if job.last is not None]
        log.warning(
            "stop requested: %d running worker(s) finish, %d task(s) not started%s",
            len(running), len(waiting) - len(retried),
            f", {len(retried)} retry(ies) dropped" if retried else "",
        )
        for job in retried:
            # Its last attempt failed transiently and the retry will not happen now:
            # report that failure (retryable, so the next run tries again).
            self._emit(job, "failed", outcomes)

    def _terminate(self, running: list[_Running], now: float) -> None:
        for run in running:
            if run.terminate_at is None and run.proc.poll() is None:
                log.warning("model=%s key=%s terminating pid=%d", run.job.task.label,
                            run.job.task.key, run.proc.pid)
                _signal_group(run.proc, signal.SIGTERM)
                run.terminate_at = now

    def _kill_overdue(self, running: list[_Running], now: float) -> None:
        grace = self.settings.terminate_grace_s
        for run in running:
            if (
                run.terminate_at is not None
                and not run.killed
                and now - run.terminate_at >= grace
                and run.proc.poll() is None
            ):
                log.warning("model=%s key=%s did not exit %.0fs after SIGTERM: SIGKILL",
                            run.job.task.label, run.job.task.key, grace)
                _signal_group(run.proc, signal.SIGKILL)
                run.killed = True

    def _reap_all(self, running: list[_Running]) -> None:
        """Wait for terminated workers (SIGKILL after the grace period) and free their GPUs."""
        deadline = time.monotonic() + self.settings.terminate_grace_s
        for run in running:
            try:
                run.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _signal_group(run.proc, signal.SIGKILL)
                run.proc.wait()
            run.output.close()
            if run.gpus and self.tracker is not None:
                self.tracker.release(run.gpus)
        running.clear()

    def _update_progress(
        self,
        running: list[_Running],
        queue: deque[_Job],
        delayed: list[tuple[float, int, _Job]],
    ) -> None:
        if self.progress is not None:
            self.progress.update(
                done=self._counts["done"],
                failed=self._counts["failed"],
                running=len(running),
                waiting=len(queue) + len(delayed),
            )

    def _backoff(self, attempts: int) -> float:
        base = min(self.settings.backoff_max_s, self.settings.backoff_s * 2 ** (attempts - 1))
        return base * self._random.uniform(0.5, 1.0)

    def _open_output(self, task: Task) -> tuple[IO[bytes], Path | None]:
        if self.settings.log_dir is None:
            return tempfile.TemporaryFile(), None
        directory = self.settings.log_dir / "workers"
        path = directory / f"{_safe_name(task.key)}.log"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return open(path, "a+b"), path  # closed when the attempt is reaped
        except OSError as e:
            raise LogDirError(f"cannot write the worker log {path}: {e.strerror or e}") from e


_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Any | None:
    """libc's prctl, looked up once in the controller (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that SIGTERMs the worker if the controller dies (Linux), else None.

    Workers run in their own session, so nothing else would stop them when the controller
    is SIGKILLed; orphans would keep their GPUs and race the next run on the same models.
    prctl is looked up in the parent, so the child only makes one foreign call before exec.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the controller died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@+=" else "_" for c in key) or "task"


def _read_tail(output: IO[bytes], offset: int) -> tuple[str, ...]:
    """The last STDERR_TAIL_LINES lines written after `offset` (this attempt's output)."""
    try:
        output.flush()
        end = output.seek(0, os.SEEK_END)
        start = max(offset, end - _TAIL_BYTES)
        output.seek(start)
        data = output.read()
    except (OSError, ValueError):
        return ()
    lines = data.decode("utf-8", "replace").splitlines()
    if start > offset and lines:
        lines = lines[1:]  # the first line is cut
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return tuple(lines[-STDERR_TAIL_LINES:])


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the worker's whole process group (its own session), the worker included.

    Only while the worker itself is unreaped: its pid, which is the group id, cannot have
    been reused then.
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
