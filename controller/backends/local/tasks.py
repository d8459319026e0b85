"""The local backend's bookkeeping: a task across its attempts, the jobs waiting (fresh and
retries due after a backoff), one-command attempts running, and the outcomes so far.

Owns no process and no policy: controller.backends.local.backend decides, .process and .slots run.
"""

from __future__ import annotations

import heapq
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller.backends.base import Outcome, OutcomeCallback, Task
from controller.backends.local.process import Attempt, Ended
from controller.progress import Progress
from esd_worker.core.errors import EXIT_OK

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
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
    crashes: int = 0  # attempts that ended with the long-lived worker dying under it
    hangs: int = 0  # attempts whose worker was killed as hung (no heartbeat for its limit)

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


class Waiting:
    """Jobs waiting to start: fresh work in list order, and retries due after a backoff
    (a due retry goes before fresh work)."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.ready: deque[Job] = deque(jobs)
        self._delayed: list[tuple[float, int, Job]] = []  # (due, tie-breaker, job) heap
        self._seq = 0

    def __len__(self) -> int:
        return len(self.ready) + len(self._delayed)

    def retry_at(self, due: float, job: Job) -> None:
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

    def take_all(self) -> list[Job]:
        jobs = list(self.ready) + [job for _, _, job in sorted(self._delayed)]
        self.ready.clear()
        self._delayed.clear()
        return jobs


class Running(list[Job]):
    """The jobs whose attempt is running, and stopping them: SIGTERM, then SIGKILL after the
    grace period."""

    def ended(self) -> list[Job]:
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


class Outcomes(list[Outcome]):
    """The outcomes so far, each also handed to the callback and counted for progress."""

    def __init__(self, on_outcome: OutcomeCallback | None, progress: Progress | None) -> None:
        super().__init__()
        self.on_outcome = on_outcome
        self.progress = progress
        self.counts = {"done": 0, "failed": 0}

    def add(self, job: Job, status: str) -> None:
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
