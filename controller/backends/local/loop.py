"""The local backend's run loop: reap what ended, retry or report it, act on stop requests,
start what may start.

Owns the order of one pass (every ~20 ms) and the retry decision: a retryable failure with
attempts left goes back after a backoff; a model whose every attempt crashed its worker is a
poison model, reported as not retryable. Models go to long-lived workers
(controller.backends.local.slots), custom commands to one process per attempt
(controller.backends.local.process). What may start where is the backend's (GPU tracker, CPU
slots); how many GPUs a model wants is controller.backends.local.needs'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from controller.backends.base import Outcome, Task
from controller.backends.local.needs import GpuNeeds
from controller.backends.local.process import Attempt, Ended, LogDirError, WorkerLogs
from controller.backends.local.slots import Slot, Slots
from controller.backends.local.tasks import Job, Outcomes, Running, Waiting
from controller.errors import SweepError

if TYPE_CHECKING:
    from controller.backends.local.backend import LocalBackend

log = logging.getLogger("controller.backends.local.backend")

_REAP_WAIT_S = 0.02  # how often workers are checked: exits are noticed within this
_PROGRESS_EVERY_S = 0.5


class Loop:
    """One run() of the local backend over `tasks`."""

    def __init__(self, backend: LocalBackend, tasks: Sequence[Task], outcomes: Outcomes,
                 needs: GpuNeeds | None = None) -> None:
        now = time.monotonic()
        self.b = backend
        self.needs = needs or GpuNeeds(None, backend.gpus_per_job if backend.tracker else 0)
        self.settings = backend.settings
        self.waiting = Waiting([Job(task, ready_since=now) for task in tasks])
        self.running = Running()
        spec = backend.spec
        # One for the run: a full disk is said once, whichever worker's log found it.
        self.logs = WorkerLogs(self.settings.log_dir)
        self.slots = Slots(
            lambda gpus: backend.serve_command(), depth=1 + (spec.prefetch if spec else 0),
            reuse=self.settings.worker_reuse,
            logs=self.logs, threads=backend.threads(), release=backend.release,
            on_start=self._started,
        )
        self.outcomes = outcomes
        self.next_poll = self.next_progress = now
        self.stop_seen = 0

    @property
    def stopping(self) -> bool:
        return self.b._stop_requests > 0

    def run(self) -> list[Outcome]:
        while True:
            now = time.monotonic()
            changed = self._reap(now)
            changed |= self._stops(now)
            grace = self.settings.terminate_grace_s
            self.running.kill_overdue(now, grace)
            self.slots.kill_overdue(now, grace)
            changed |= self.waiting.move_due(now)
            if self.waiting.ready:
                tracker = self.b.tracker
                if tracker is not None and now >= self.next_poll:
                    tracker.poll()
                    self.next_poll = now + tracker.settings.poll_interval_s
                changed |= self._dispatch(now)
            if not self.waiting:
                self.slots.close_idle()  # nothing left to give them: their GPUs go back
            if changed or now >= self.next_progress:
                self.outcomes.show(len(self.running) + self.slots.busy, len(self.waiting))
                self.next_progress = now + _PROGRESS_EVERY_S
            if not (self.waiting or self.running or self.slots):
                return list(self.outcomes)
            # Sleep until the next poll or retry, staying responsive to request_stop.
            due = min(self.next_poll, self.waiting.next_due() or self.next_poll)
            busy = self.running or self.slots
            time.sleep(_REAP_WAIT_S if busy else min(max(due - now, 0.001), 0.1))

    def cleanup(self) -> None:
        """After an exception (a callback's, or KeyboardInterrupt without a handler): never
        leave workers behind holding GPUs."""
        if self.running or self.slots:
            log.warning("stopping %d running worker(s) after an error",
                        len(self.running) + len(self.slots))
            now = time.monotonic()
            self.running.terminate(now)
            self.slots.terminate(now)
            self.running.reap_all(self.settings.terminate_grace_s, self.b.release)
            self.slots.reap_all(self.settings.terminate_grace_s, self.b.release)

    # -- steps ----------------------------------------------------------------------------------

    def _reap(self, now: float) -> bool:
        changed = False
        for job in self.running.ended():
            changed = True
            assert job.running is not None
            job.duration_s = max(now - job.started, 0.0)
            job.total_s += job.duration_s
            job.last = job.running.ended()
            self._released(self.b.release(job.gpus), now)
            self._ended(job, now)
        got = self.slots.collect(now)
        for gpus in got.released:
            self._released(self.b.release(gpus), now)
        for job in got.ended:
            self._ended(job, now)
        for job in got.unstarted:
            if not self.stopping:
                job.ready_since = now
                self.waiting.ready.appendleft(job)
            elif job.last is not None:  # a retry that will not happen now (see _stops)
                self.outcomes.add(job, "failed")
        return changed or bool(got.ended or got.unstarted or got.released)

    def _released(self, released: bool, now: float) -> None:
        if released and self.waiting.ready:
            self.next_poll = now  # a released GPU needs one fresh poll: take it now

    def _ended(self, job: Job, now: float) -> None:
        last = job.last
        assert last is not None
        if job.should_retry(self.settings.max_retries, self.stopping):
            delay = self.b.backoff(job)
            log.warning("model=%s key=%s attempt %d failed (%s); retry in %.3gs",
                        job.task.label, job.task.key, job.attempts, last.error, delay)
            self.waiting.retry_at(now + delay, job)
            return
        if (job.crashes and job.crashes == job.attempts and job.terminate_at is None
                and not self.stopping and last.retryable):
            job.last = dataclasses.replace(last, retryable=False, error=(
                f"{last.error}; it crashed the worker in all {job.attempts} attempt(s): a "
                "poison model, recorded as a permanent failure (--retry-failed tries again)"))
        self.outcomes.add(job, job.status())

    def _stops(self, now: float) -> bool:
        stop = self.b._stop_requests
        if stop <= self.stop_seen:
            return False
        if self.stop_seen == 0:
            jobs = self.waiting.take_all()
            retried = [job for job in jobs if job.last is not None]
            log.warning("stop requested: %d running worker(s) finish, %d task(s) not "
                        "started%s", len(self.running) + len(self.slots),
                        len(jobs) - len(retried),
                        f", {len(retried)} retry(ies) dropped" if retried else "")
            for job in retried:
                # Its last attempt failed transiently and the retry will not happen now:
                # report that failure (retryable, so the next run tries again).
                self.outcomes.add(job, "failed")
            self.slots.drain()
        if stop >= 2:
            self.running.terminate(now)
            self.slots.terminate(now)
        self.stop_seen = stop
        return True

    def _dispatch(self, now: float) -> bool:
        started = False
        queue = self.waiting.ready
        while queue and not self.stopping:
            job = queue[0]
            in_use = len(self.slots) + len(self.running)
            if job.task.row is not None and not job.task.argv and self.b.spec is not None:
                want = self.needs.want(job.task)
                if want is None:
                    break  # its shape is being looked up (.needs): next pass
                try:
                    taken = self.slots.offer(job, now, functools.partial(self.b.acquire, in_use),
                                             want)
                except LogDirError as e:
                    raise SweepError(f"{e} (--log-dir)") from e  # setup, not this task's
                except (OSError, ValueError) as e:
                    queue.popleft()
                    self.needs.taken()
                    self._could_not_start(job, e)
                    started = True
                    continue
                if not taken:
                    break
                queue.popleft()
                self.needs.taken()
            else:
                gpus = self.b.acquire(in_use, self.b.gpus_per_job)
                if gpus is None:
                    break
                queue.popleft()
                self._start_command(job, gpus, now)
            started = True
        return started

    def _start_command(self, job: Job, gpus: tuple[int, ...], now: float) -> None:
        """A custom command: one process for this attempt."""
        task = job.task
        job.wait_s += max(now - job.ready_since, 0.0)
        job.gpus, job.started, job.terminate_at, job.killed = gpus, now, None, False
        argv = self.b.argv(task, self.b.device)
        try:
            job.running = Attempt(task.key, argv, number=job.attempts + 1, gpus=gpus,
                                  env=task.env, logs=self.logs,
                                  threads=self.b.threads())
        except LogDirError as e:
            self.b.release(gpus)
            raise SweepError(f"{e} (--log-dir)") from e
        except (OSError, ValueError) as e:
            self.b.release(gpus)
            self._could_not_start(job, e, argv)
            return
        job.attempts += 1
        job.log_path = str(job.running.log_path) if job.running.log_path else None
        self.running.append(job)
        self._log_start(job, job.running.pid)

    def _could_not_start(self, job: Job, e: Exception, argv: Sequence[str] = ()) -> None:
        job.attempts += 1
        what = argv[0] if argv else (self.b.worker_cmd[0] if self.b.worker_cmd else "(empty)")
        job.last = Ended(None, None, (f"could not start: {e}",),
                         f"StartFailed: cannot run {what}: {e}", False)
        log.error("model=%s key=%s could not start: %s", job.task.label, job.task.key, e)
        self.outcomes.add(job, "failed")

    def _started(self, job: Job, slot: Slot) -> None:
        self._log_start(job, slot.worker.pid)

    def _log_start(self, job: Job, pid: int) -> None:
        task, gpus = job.task, job.gpus
        log.info("model=%s key=%s started attempt %d on %s pid=%d", task.label, task.key,
                 job.attempts, f"gpus={','.join(map(str, gpus))}" if gpus else "cpu", pid)
        if self.b.on_start is not None:
            self.b.on_start(task, gpus)
