"""The local backend's run loop: reap what ended, retry or report it, act on stop requests,
start what may start.

Owns the order of one pass (every ~20 ms) and the retry decision: a retryable failure with
attempts left goes back after a backoff; a model whose every attempt crashed its worker or
hung (killed for no heartbeat within its limit: .slots) is a poison model, reported as not
retryable. Models go to long-lived workers
(controller.backends.local.slots), custom commands to one process per attempt
(controller.backends.local.process). What may start where, and what it runs, is the
dispatcher's (Dispatcher, the local backend: GPU tracker, CPU slots, worker commands); how
many GPUs a model wants is controller.backends.local.needs'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from controller.backends.base import Outcome, Task
from controller.backends.local.needs import GpuNeeds
from controller.backends.local.process import Attempt, Ended, LogDirError, WorkerLogs
from controller.backends.local.settings import LocalSettings
from controller.backends.local.slots import Slot, Slots
from controller.backends.local.tasks import Job, Outcomes, Running, Waiting
from controller.errors import SweepError

log = logging.getLogger(__name__)

_REAP_WAIT_S = 0.02  # how often workers are checked: exits are noticed within this
_PROGRESS_EVERY_S = 0.5


class Dispatcher(Protocol):
    """What the loop asks of the backend it runs for (controller.backends.local.backend's
    LocalBackend): the run's settings, the stops asked for, which GPUs or CPU slot a worker
    may take, and what a worker runs. The loop reaches nothing else of it."""

    @property
    def settings(self) -> LocalSettings: ...

    @property
    def stop_requests(self) -> int:
        """Stops requested so far: 1 starts nothing new, 2 terminates running workers."""
        ...

    @property
    def worker_cmd(self) -> tuple[str, ...]:
        """The worker's command (named when it cannot start)."""
        ...

    @property
    def prefetch(self) -> int:
        """Models a long-lived worker is given ahead of the one it analyses."""
        ...

    @property
    def model_timeout(self) -> float:
        """The floor of a model's no-progress limit in a long-lived worker, seconds."""
        ...

    def serves(self, task: Task) -> bool:
        """Whether the task goes to a long-lived worker, else to a process of its own."""
        ...

    def serve_command(self) -> tuple[str, ...]:
        """A long-lived worker's command."""
        ...

    def command(self, task: Task) -> tuple[str, ...]:
        """The command of one attempt of a task that is not served."""
        ...

    def may_start(self) -> AbstractContextManager[bool]:
        """Held while one task starts: whether tasks may start (the output's lease is still
        held); a loss of the lease waits until the block ends."""
        ...

    def acquire(self, in_use: int, gpus: int) -> tuple[int, ...] | None:
        """`gpus` GPUs for one more worker ((): a CPU slot), or None when none may start."""
        ...

    def release(self, gpus: tuple[int, ...]) -> bool:
        """Give GPUs back; True when there were any."""
        ...

    def poll_gpus(self) -> float | None:
        """Look at the GPUs again; seconds until the next look (None: nothing to look at)."""
        ...

    def threads(self) -> int | None:
        """CPU threads per worker (None: no limit)."""
        ...

    def worker_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """Variables of a long-lived worker on `gpus` beside the run's (its CPU share)."""
        ...

    def backoff(self, job: Job) -> float:
        """Seconds before the job's next attempt."""
        ...

    def started(self, task: Task, gpus: tuple[int, ...]) -> None:
        """An attempt started on `gpus`."""
        ...


class Loop:
    """One run() over `tasks` for `dispatcher`; needs: each model's GPU count."""

    def __init__(self, dispatcher: Dispatcher, tasks: Sequence[Task], outcomes: Outcomes,
                 needs: GpuNeeds) -> None:
        now = time.monotonic()
        self.d = dispatcher
        self.needs = needs
        self.settings = dispatcher.settings
        self.waiting = Waiting([Job(task, ready_since=now) for task in tasks])
        self.running = Running()
        # One for the run: a full disk is said once, whichever worker's log found it.
        self.logs = WorkerLogs(self.settings.log_dir)
        self.slots = Slots(
            lambda gpus: dispatcher.serve_command(), depth=1 + dispatcher.prefetch,
            reuse=self.settings.worker_reuse,
            logs=self.logs, threads=dispatcher.threads(), release=dispatcher.release,
            on_start=self._started, model_timeout=dispatcher.model_timeout,
            env=dispatcher.worker_env,
        )
        self.outcomes = outcomes
        self.next_poll = self.next_progress = now
        self.stop_seen = 0

    @property
    def stopping(self) -> bool:
        return self.d.stop_requests > 0

    def run(self) -> list[Outcome]:
        while True:
            now = time.monotonic()
            changed = self._reap(now)
            changed |= self._stops(now)
            self.slots.kill_hung(now)  # after _reap: every heartbeat read so far counts
            grace = self.settings.terminate_grace_s
            self.running.kill_overdue(now, grace)
            self.slots.kill_overdue(now, grace)
            changed |= self.waiting.move_due(now)
            if self.waiting.ready:
                if now >= self.next_poll:
                    interval = self.d.poll_gpus()
                    if interval is not None:
                        self.next_poll = now + interval
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
            self.running.reap_all(self.settings.terminate_grace_s, self.d.release)
            self.slots.reap_all(self.settings.terminate_grace_s, self.d.release)

    # -- steps ----------------------------------------------------------------------------------

    def _reap(self, now: float) -> bool:
        changed = False
        for job in self.running.ended():
            changed = True
            assert job.running is not None
            job.duration_s = max(now - job.started, 0.0)
            job.total_s += job.duration_s
            job.last = job.running.ended()
            self._released(self.d.release(job.gpus), now)
            self._ended(job, now)
        got = self.slots.collect(now)
        for gpus in got.released:
            self._released(self.d.release(gpus), now)
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
            delay = self.d.backoff(job)
            log.warning("model=%s key=%s attempt %d failed (%s); retry in %.3gs",
                        job.task.label, job.task.key, job.attempts, last.error, delay)
            self.waiting.retry_at(now + delay, job)
            return
        killed = job.crashes + job.hangs
        if (killed and killed == job.attempts and job.terminate_at is None
                and not self.stopping and last.retryable):
            what = ("crashed the worker" if not job.hangs else "hung" if not job.crashes
                    else "crashed or hung the worker")
            job.last = dataclasses.replace(last, retryable=False, error=(
                f"{last.error}; it {what} in all {job.attempts} attempt(s): a poison model, "
                "recorded as a permanent failure (--retry-failed tries again)"))
        self.outcomes.add(job, job.status())

    def _stops(self, now: float) -> bool:
        stop = self.d.stop_requests
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
        while self.waiting.ready:
            # The check and the start are one step: a lease lost after the check waits for
            # this start (Dispatcher.may_start), so no task starts once the loss is known
            # ("no task starts", controller.run.sweep), however the threads interleave.
            with self.d.may_start() as allowed:
                if not allowed or self.stopping or not self._start_next(now):
                    break
            started = True
        return started

    def _start_next(self, now: float) -> bool:
        """Start the job at the head of the queue, or record that it could not start; False
        when nothing can start now (no GPU or slot, its shape still being looked up)."""
        queue = self.waiting.ready
        job = queue[0]
        in_use = len(self.slots) + len(self.running)
        if not self.d.serves(job.task):
            # needs.fixed: the run's count for a custom command (0 on CPU slots)
            gpus = self.d.acquire(in_use, self.needs.fixed)
            if gpus is None:
                return False
            queue.popleft()
            self._start_command(job, gpus, now)
            return True
        want = self.needs.want(job.task)
        if want is None:
            return False  # its shape is being looked up (.needs): next pass
        try:
            taken = self.slots.offer(job, now, functools.partial(self.d.acquire, in_use), want)
        except LogDirError as e:
            raise SweepError(f"{e} (--log-dir)") from e  # setup, not this task's
        except (OSError, ValueError) as e:
            queue.popleft()
            self.needs.taken()
            self._could_not_start(job, e)
            return True
        if not taken:
            return False
        queue.popleft()
        self.needs.taken()
        return True

    def _start_command(self, job: Job, gpus: tuple[int, ...], now: float) -> None:
        """A custom command: one process for this attempt."""
        task = job.task
        job.wait_s += max(now - job.ready_since, 0.0)
        job.gpus, job.started, job.terminate_at, job.killed = gpus, now, None, False
        argv = self.d.command(task)
        try:
            job.running = Attempt(task.key, argv, number=job.attempts + 1, gpus=gpus,
                                  env=task.env, logs=self.logs,
                                  threads=self.d.threads())
        except LogDirError as e:
            self.d.release(gpus)
            raise SweepError(f"{e} (--log-dir)") from e
        except (OSError, ValueError) as e:
            self.d.release(gpus)
            self._could_not_start(job, e, argv)
            return
        job.attempts += 1
        job.log_path = str(job.running.log_path) if job.running.log_path else None
        self.running.append(job)
        self._log_start(job, job.running.pid)

    def _could_not_start(self, job: Job, e: Exception, argv: Sequence[str] = ()) -> None:
        job.attempts += 1
        what = argv[0] if argv else (self.d.worker_cmd[0] if self.d.worker_cmd else "(empty)")
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
        self.d.started(task, gpus)
