"""The local backend: workers as subprocesses on this machine's free GPUs (or CPU slots).

Owns scheduling on this machine: the gputracker rule decides when a GPU may take a worker
(controller.gpus), transient failures are retried with backoff, Ctrl+C once stops new
work and twice terminates it. A model task's worker command is built here from the run's
WorkerSpec. Does not know the store or records (controller.recorder turns Outcomes into
those) and does not touch processes itself (controller.backends.process).
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import shlex
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from controller.backends.base import Outcome, OutcomeCallback, Task, WorkerSpec
from controller.backends.process import Attempt, Ended, LogDirError
from controller.errors import SweepError
from controller.gpus import GpuTracker, open_tracker
from controller.progress import Progress
from esd_worker.errors import EXIT_OK
from esd_worker.modellist import ModelRow

if TYPE_CHECKING:
    from controller.settings import SweepSettings

log = logging.getLogger(__name__)

_REAP_WAIT_S = 0.02  # how often running processes are checked: exits are noticed within this
_PROGRESS_EVERY_S = 0.5


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


def worker_argv(
    command: Sequence[str], row: ModelRow, spec: WorkerSpec, device: str
) -> tuple[str, ...]:
    """A model's worker command: a list, never a shell string (ids are not trusted)."""
    return (*command, *spec.model_args(row), "--device", device,
            "--log-format", spec.log_format, *spec.flags())


@dataclass(eq=False)
class _Job:
    """A task across its attempts."""

    task: Task
    ready_since: float
    attempts: int = 0
    total_s: float = 0.0
    wait_s: float = 0.0
    duration_s: float = 0.0
    gpus: tuple[int, ...] = ()
    last: Ended | None = None
    log_path: str | None = None
    running: Attempt | None = None
    started: float = 0.0
    terminate_at: float | None = None  # when SIGTERM was sent (second stop request)
    killed: bool = False

    def should_retry(self, max_retries: int, stopping: bool) -> bool:
        """A retryable failure, not terminated by us, with attempts left, while running on."""
        assert self.last is not None
        return (self.last.retryable and self.terminate_at is None
                and self.attempts <= max_retries and not stopping)

    def status(self) -> str:
        assert self.last is not None
        if self.last.exit_code == EXIT_OK:
            return "done"  # finished before the termination took effect: the result is there
        return "cancelled" if self.terminate_at is not None else "failed"

    def outcome(self, status: str) -> Outcome:
        last = self.last
        assert last is not None
        return Outcome(
            task=self.task, status=status, exit_code=last.exit_code, signal=last.signal,
            attempts=self.attempts, duration_s=self.duration_s, total_s=self.total_s,
            wait_s=self.wait_s, where=f"gpus={','.join(map(str, self.gpus))}" if self.gpus
            else "cpu", stderr_tail=last.stderr_tail,
            error="" if status == "done" else last.error,
            retryable=status != "done" and last.retryable, gpus=self.gpus,
            log_path=self.log_path,
        )


class _Waiting:
    """Jobs waiting to start: fresh work in list order, and retries due after a backoff
    (a due retry goes before fresh work)."""

    def __init__(self, jobs: Sequence[_Job]) -> None:
        self.ready: deque[_Job] = deque(jobs)
        self._delayed: list[tuple[float, int, _Job]] = []  # (due, tie-breaker, job) heap
        self._seq = 0

    def __len__(self) -> int:
        return len(self.ready) + len(self._delayed)

    def retry_at(self, due: float, job: _Job) -> None:
        self._seq += 1
        heapq.heappush(self._delayed, (due, self._seq, job))

    def move_due(self, now: float) -> bool:
        """Retries whose time has come go to the front; True when there were any."""
        moved = False
        while self._delayed and self._delayed[0][0] <= now:
            job = heapq.heappop(self._delayed)[2]
            job.ready_since = now
            self.ready.appendleft(job)
            moved = True
        return moved

    def next_due(self) -> float | None:
        return self._delayed[0][0] if self._delayed else None

    def take_all(self) -> list[_Job]:
        jobs = list(self.ready) + [job for _, _, job in sorted(self._delayed)]
        self.ready.clear()
        self._delayed.clear()
        return jobs


class _Running(list[_Job]):
    """The jobs whose attempt is running, and stopping them: SIGTERM, then SIGKILL after the
    grace period."""

    def ended(self) -> list[_Job]:
        """The jobs whose process has exited (taken out of the set)."""
        done = [job for job in self if job.running is not None and not job.running.running()]
        for job in done:
            self.remove(job)
        return done

    def terminate(self, now: float) -> None:
        for job in self:
            if job.running is not None and job.terminate_at is None and job.running.running():
                log.warning("model=%s key=%s terminating pid=%d", job.task.label,
                            job.task.key, job.running.pid)
                job.running.signal(signal.SIGTERM)
                job.terminate_at = now

    def kill_overdue(self, now: float, grace: float) -> None:
        for job in self:
            if (job.running is not None and job.terminate_at is not None and not job.killed
                    and now - job.terminate_at >= grace and job.running.running()):
                log.warning("model=%s key=%s did not exit %.0fs after SIGTERM: SIGKILL",
                            job.task.label, job.task.key, grace)
                job.running.signal(signal.SIGKILL)
                job.killed = True

    def reap_all(self, grace: float, release: Callable[[tuple[int, ...]], bool]) -> None:
        """Wait for terminated workers (SIGKILL after the grace period) and free their GPUs."""
        deadline = time.monotonic() + grace
        for job in self:
            if job.running is not None:
                job.running.wait(deadline - time.monotonic())
            release(job.gpus)
        self.clear()


class _Ended(list[Outcome]):
    """The outcomes so far, each also handed to the callback and counted for progress."""

    def __init__(self, on_outcome: OutcomeCallback | None, progress: Progress | None) -> None:
        super().__init__()
        self.on_outcome = on_outcome
        self.progress = progress
        self.counts = {"done": 0, "failed": 0}

    def add(self, job: _Job, status: str) -> None:
        outcome = job.outcome(status)
        self.append(outcome)
        if status in self.counts:
            self.counts[status] += 1
            if self.progress is not None:
                self.progress.record_duration(job.total_s)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def show(self, running: int, waiting: int) -> None:
        if self.progress is not None:
            self.progress.update(done=self.counts["done"], failed=self.counts["failed"],
                                 running=running, waiting=waiting)


class LocalBackend:
    """Runs tasks as subprocesses, each on its own GPUs (tracker) or a CPU slot (no tracker).

    With a tracker each task takes `gpus_per_job` GPUs (its CUDA_VISIBLE_DEVICES) until it
    exits; without one, up to `settings.cpu_workers` run at once, no GPU visible. Workers get
    their own session: Ctrl+C reaches the controller only (request_stop). A model task runs
    `worker_cmd` with `spec`'s flags. open_tracker: called when the first tasks arrive
    (nothing to do opens no NVML). on_start: called as each attempt starts.
    """

    name = "local"

    def __init__(
        self,
        settings: LocalSettings,
        tracker: GpuTracker | None = None,
        *,
        gpus_per_job: int = 1,
        spec: WorkerSpec | None = None,
        worker_cmd: Sequence[str] = (sys.executable, "-m", "esd_worker.cli"),
        open_tracker: Callable[[], GpuTracker | None] | None = None,
        on_start: Callable[[Task, tuple[int, ...]], None] | None = None,
    ) -> None:
        settings.validate()
        if gpus_per_job < 1:
            raise ValueError(f"gpus_per_job: must be >= 1, got {gpus_per_job}")
        self.settings = settings
        self.tracker = tracker
        self.gpus_per_job = gpus_per_job
        self.spec = spec
        self.worker_cmd = tuple(worker_cmd)
        self.on_start = on_start
        self._open_tracker = open_tracker
        self._check_capacity()
        # Plain int, not an Event: request_stop runs in signal handlers, where taking the
        # lock inside Event.set could deadlock against the interrupted main thread.
        self._stop_requests = 0
        self._random = random.Random()

    @classmethod
    def from_settings(cls, settings: SweepSettings, spec: WorkerSpec) -> LocalBackend:
        return cls(
            settings.local, None, gpus_per_job=settings.gpu.gpus_per_job, spec=spec,
            worker_cmd=settings.worker_cmd,
            open_tracker=lambda: open_tracker(settings.device, settings.gpu,
                                              settings.local.cpu_workers),
        )

    def _check_capacity(self) -> None:
        tracker = self.tracker
        if tracker is not None and self.gpus_per_job > tracker.capacity:
            raise SweepError(
                f"gpus_per_job: {self.gpus_per_job} GPU(s) per job, but only "
                f"{tracker.capacity} usable (GPUs {','.join(map(str, tracker.gpus)) or 'none'},"
                f" max_gpus={tracker.settings.max_gpus})"
            )

    @property
    def device(self) -> str:
        return "cpu" if self.tracker is None else "cuda"

    def request_stop(self) -> None:
        """1st call: start nothing new, let running workers finish. 2nd: terminate them.

        Safe to call from a signal handler or another thread; run() acts on it within
        a few tens of milliseconds.
        """
        self._stop_requests += 1

    def stop_notice(self, count: int) -> str:
        if count == 1:
            return ("stopping: no new models start; running workers finish "
                    "(press Ctrl+C again to terminate them)")
        return "terminating running workers"

    def report(self) -> dict[str, Any]:
        return {"device": self.device, "gpus": list(self.tracker.gpus if self.tracker else ())}

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.nvml.close()

    def argv(self, task: Task, device: str) -> tuple[str, ...]:
        spec, row = self.spec, task.row
        return task.argv if task.argv or row is None or spec is None else worker_argv(
            self.worker_cmd, row, spec, device)

    def dry_run(self, tasks: Sequence[Task], out: TextIO) -> int:
        """The command lines run() would start (device as asked), one per line."""
        device = self.spec.device if self.spec is not None else "auto"
        for task in tasks:
            out.write(shlex.join(self.argv(task, device)) + "\n")
        out.flush()
        return len(tasks)

    # The run loop -------------------------------------------------------------------------

    def run(
        self, tasks: Sequence[Task], on_outcome: OutcomeCallback | None = None,
        progress: Progress | None = None,
    ) -> list[Outcome]:
        """Run every task; return when all have ended, or a stop was requested and the
        running ones have ended.

        Returns one Outcome per task that started at least once (tasks never started
        because of a stop have none; the next run picks them up).
        """
        if tasks and self._open_tracker is not None:
            self.tracker, self._open_tracker = self._open_tracker(), None
            self._check_capacity()
        now = time.monotonic()
        waiting = _Waiting([_Job(task, ready_since=now) for task in tasks])
        running = _Running()
        outcomes = _Ended(on_outcome, progress)
        next_poll = next_progress = now
        stop_seen = 0
        try:
            while True:
                now = time.monotonic()
                changed = False
                for job in running.ended():
                    changed = True
                    if self._finish(job, now) and waiting.ready:
                        next_poll = now  # a released GPU needs one fresh poll: take it now
                    if job.should_retry(self.settings.max_retries, self._stop_requests > 0):
                        delay = self._backoff(job)
                        log.warning("model=%s key=%s attempt %d failed (%s); retry in %.3gs",
                                    job.task.label, job.task.key, job.attempts,
                                    job.last.error if job.last else "", delay)
                        waiting.retry_at(now + delay, job)
                    else:
                        outcomes.add(job, job.status())
                stop = self._stop_requests
                if stop > stop_seen:
                    changed = True
                    if stop_seen == 0:
                        self._stop_dispatching(waiting, len(running), outcomes)
                    if stop >= 2:
                        running.terminate(now)
                    stop_seen = stop
                running.kill_overdue(now, self.settings.terminate_grace_s)
                changed |= waiting.move_due(now)
                if waiting:
                    if self.tracker is not None and now >= next_poll:
                        self.tracker.poll()
                        next_poll = now + self.tracker.settings.poll_interval_s
                    changed |= self._dispatch(waiting.ready, running, outcomes, now)
                if changed or now >= next_progress:
                    outcomes.show(len(running), len(waiting))
                    next_progress = now + _PROGRESS_EVERY_S
                if not (waiting or running):
                    return list(outcomes)
                # Nothing to reap: sleep until the next poll or retry, staying responsive to
                # request_stop.
                due = min(next_poll, waiting.next_due() or next_poll)
                time.sleep(_REAP_WAIT_S if running else min(max(due - now, 0.001), 0.1))
        finally:
            if running:
                # An exception (a callback's, or KeyboardInterrupt without a handler) ends
                # run(): never leave workers behind holding GPUs.
                log.warning("stopping %d running worker(s) after an error", len(running))
                running.terminate(time.monotonic())
                running.reap_all(self.settings.terminate_grace_s, self._release)

    # Steps of the loop ----------------------------------------------------------------------

    def _dispatch(
        self, queue: deque[_Job], running: list[_Job], outcomes: _Ended, now: float
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
            if self._start(job, gpus, outcomes, now):
                running.append(job)
        return started

    def _start(self, job: _Job, gpus: tuple[int, ...], outcomes: _Ended,
               now: float) -> bool:
        task = job.task
        job.attempts += 1
        job.wait_s += max(now - job.ready_since, 0.0)
        job.gpus, job.started, job.terminate_at, job.killed = gpus, now, None, False
        argv = self.argv(task, self.device)
        # CPU workers share the cores: N workers each using every core run several times
        # slower than N workers with cores/N threads (measured on 2 cores).
        threads = None if self.tracker is not None else max(
            1, (os.cpu_count() or 1) // self.settings.cpu_workers)
        try:
            job.running = Attempt(task.key, argv, number=job.attempts, gpus=gpus, env=task.env,
                                  log_dir=self.settings.log_dir, threads=threads)
        except LogDirError as e:
            self._release(gpus)
            raise SweepError(f"{e} (--log-dir)") from e  # a setup problem, not this task's
        except (OSError, ValueError) as e:
            self._release(gpus)
            job.last = Ended(None, None, (f"could not start: {e}",),
                             f"StartFailed: cannot run {argv[0] if argv else '(empty)'}: {e}",
                             False)
            log.error("model=%s key=%s could not start: %s", task.label, task.key, e)
            outcomes.add(job, "failed")
            return False
        job.log_path = str(job.running.log_path) if job.running.log_path else None
        log.info("model=%s key=%s started attempt %d on %s pid=%d", task.label, task.key,
                 job.attempts, f"gpus={','.join(map(str, gpus))}" if gpus else "cpu",
                 job.running.pid)
        if self.on_start is not None:
            self.on_start(task, gpus)
        return True

    def _finish(self, job: _Job, now: float) -> bool:
        """Record a reaped attempt on its job; True when GPUs went back to the tracker."""
        assert job.running is not None
        job.duration_s = max(now - job.started, 0.0)
        job.total_s += job.duration_s
        job.last = job.running.ended()
        return self._release(job.gpus)

    def _release(self, gpus: tuple[int, ...]) -> bool:
        if gpus and self.tracker is not None:
            self.tracker.release(gpus)
            return True
        return False

    def _stop_dispatching(self, waiting: _Waiting, running: int,
                          outcomes: _Ended) -> None:
        jobs = waiting.take_all()
        retried = [job for job in jobs if job.last is not None]
        log.warning("stop requested: %d running worker(s) finish, %d task(s) not started%s",
                    running, len(jobs) - len(retried),
                    f", {len(retried)} retry(ies) dropped" if retried else "")
        for job in retried:
            # Its last attempt failed transiently and the retry will not happen now:
            # report that failure (retryable, so the next run tries again).
            outcomes.add(job, "failed")

    def _backoff(self, job: _Job) -> float:
        """Seconds before the next attempt: doubling from backoff_s, capped, with jitter."""
        base = min(self.settings.backoff_max_s,
                   self.settings.backoff_s * 2 ** (job.attempts - 1))
        return base * self._random.uniform(0.5, 1.0)
