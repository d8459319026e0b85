"""Long-lived workers on this machine: one `esd-worker --serve` per GPU slot (or CPU slot), fed
one model at a time plus what it may download ahead.

Owns the slots: which worker takes a job (one holding as many GPUs as the job wants: an idle
one first, then a new slot when the caller can get GPUs for one, then one with room to queue
ahead; idle workers of another count leave when the job can start nowhere), what the
workers' events mean for the jobs (started, ended, crashed under a model), the watch over each
worker's model in progress (its heartbeats: one quiet past its limit is hung, and its worker
is killed, esd_worker.core.watchdog), restarting after `--worker-reuse` models, idle workers
leaving so their GPUs go back, and stopping (drain, SIGTERM, SIGKILL). Does not decide
retries, GPU counts or record anything (controller.backends.local.backend, .needs).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.backends.local.process import Ended, WorkerLogs, describe_exit
from controller.backends.local.served import ServedWorker
from controller.backends.local.tasks import Job
from esd_worker.core.errors import signal_name
from esd_worker.core.protocol import DONE, PROGRESS, SKIPPED, Request, result_from
from esd_worker.core.watchdog import DEFAULT_MODEL_TIMEOUT_S, ModelWatch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """A worker on its GPUs: jobs sent and not started (`sent`), the one it analyses
    (`current`, watched over by `watch`)."""

    worker: ServedWorker
    gpus: tuple[int, ...]
    sent: deque[Job] = field(default_factory=deque)
    current: Job | None = None
    served: int = 0
    closing: bool = False  # its input is closed: it takes nothing more
    drained: bool = False  # a stop: what it was sent and did not start is not its fault
    terminate_at: float | None = None
    killed: bool = False
    watch: ModelWatch = field(default_factory=ModelWatch)
    hung: str | None = None  # killed as hung: the "ModelTimeout: ..." its model is charged

    @property
    def load(self) -> int:
        return len(self.sent) + (self.current is not None)


@dataclass
class Collected:
    """What the workers said since the last look: jobs that ended (their `last` set), jobs
    sent to a worker that exited before starting them, and GPUs given back."""

    ended: list[Job] = field(default_factory=list)
    unstarted: list[Job] = field(default_factory=list)
    released: list[tuple[int, ...]] = field(default_factory=list)


Acquire = Callable[[int], "tuple[int, ...] | None"]  # GPUs wanted -> the GPUs, or None


class Slots:
    """The long-lived workers. depth: models a worker holds at once (1 + its prefetch);
    reuse: models after which a worker is replaced (None: never); model_timeout: the floor
    of a model's no-progress limit, seconds (--model-timeout)."""

    def __init__(self, argv: Callable[[tuple[int, ...]], Sequence[str]], *, depth: int,
                 reuse: int | None, logs: WorkerLogs, threads: int | None,
                 release: Callable[[tuple[int, ...]], bool],
                 on_start: Callable[[Job, Slot], None] | None = None,
                 model_timeout: float = DEFAULT_MODEL_TIMEOUT_S,
                 env: Callable[[tuple[int, ...]], Mapping[str, str]] | None = None) -> None:
        self.argv = argv
        self.model_timeout = model_timeout
        self.depth = max(1, depth)
        self.reuse = reuse
        self.logs = logs
        self.threads = threads
        self.release = release
        self.on_start = on_start
        self.env = env
        self.live: list[Slot] = []
        self._started = 0

    def __len__(self) -> int:
        return len(self.live)

    @property
    def busy(self) -> int:
        """Models being analysed or queued in a worker."""
        return sum(slot.load for slot in self.live)

    # -- giving work ------------------------------------------------------------------------

    def offer(self, job: Job, now: float, acquire: Acquire, want: int = 1) -> bool:
        """Send the job to a worker holding `want` GPUs (0: a CPU slot); False when none can
        take it now. A worker only ever gets models of its own GPU count: an idle one first,
        then a new one on `want` GPUs from acquire, then one with room to queue ahead. When
        none can, idle workers of another count leave (make_room), so that their GPUs come
        back and a later offer can start the worker this job needs."""
        open_slots = [s for s in self.live if not s.closing and s.terminate_at is None]
        fits = [s for s in open_slots if len(s.gpus) == want]
        idle = [s for s in fits if s.load == 0]
        slot = idle[0] if idle else None
        if slot is None:
            gpus = acquire(want)
            if gpus is not None:
                try:
                    slot = self._spawn(gpus)
                except BaseException:
                    self.release(gpus)
                    raise
        if slot is None:
            roomy = [s for s in fits if s.load < self.depth]
            slot = min(roomy, key=lambda s: s.load) if roomy else None
        if slot is None:
            self._make_room(open_slots, want)
            return False
        self._send(slot, job, now)
        return True

    def _make_room(self, open_slots: list[Slot], want: int) -> None:
        """Idle workers of another GPU count exit: the job at the head of the queue waits for
        GPUs they hold (busy ones finish what they were sent first: the head's wait stops
        sends to them, so they go idle too, and no count waits on another forever)."""
        for slot in open_slots:
            if slot.load == 0 and len(slot.gpus) != want:
                log.info("worker %d on gpus=%s leaves: its GPUs go to a model on %d GPU(s)",
                         slot.worker.slot, ",".join(map(str, slot.gpus)), want)
                slot.worker.close_input()
                slot.closing = True

    def _spawn(self, gpus: tuple[int, ...]) -> Slot:
        """Raises LogDirError / OSError / ValueError (the caller releases the GPUs)."""
        self._started += 1
        worker = ServedWorker(self.argv(gpus), slot=self._started, gpus=gpus,
                              env=self.env(gpus) if self.env is not None else {},
                              logs=self.logs, threads=self.threads)
        log.info("worker %d started on %s pid=%d", self._started,
                 f"gpus={','.join(map(str, gpus))}" if gpus else "cpu", worker.pid)
        slot = Slot(worker, gpus, watch=ModelWatch(self.model_timeout))
        self.live.append(slot)
        return slot

    def _send(self, slot: Slot, job: Job, now: float) -> None:
        job.attempts += 1
        job.wait_s += max(now - job.ready_since, 0.0)
        job.gpus, job.terminate_at = slot.gpus, None  # SIGKILL is the slot's (Slot.killed)
        job.started = now  # until it starts: a model found done is answered without a start
        assert job.task.row is not None
        slot.sent.append(job)
        slot.worker.send(Request.for_row(job.task.row, job.attempts))
        slot.served += 1
        if self.reuse is not None and slot.served >= self.reuse:
            slot.worker.close_input()  # it exits after these; a fresh one takes the next
            slot.closing = True

    def close_idle(self) -> None:
        """No work is left: idle workers exit, giving their GPUs back."""
        for slot in self.live:
            if slot.load == 0 and not slot.closing:
                slot.worker.close_input()
                slot.closing = True

    # -- what happened ------------------------------------------------------------------------

    def collect(self, now: float) -> Collected:
        got = Collected()
        for slot in list(self.live):
            exited = not slot.worker.running()
            if exited:
                slot.worker.finish_reading()  # the last events and log lines
            for event in slot.worker.events():
                self._event(slot, event, now, got)
            if exited:
                self._exited(slot, now, got)
        return got

    def _event(self, slot: Slot, event: dict[str, Any], now: float, got: Collected) -> None:
        kind, key = event.get("event"), event.get("key")
        if kind == "start":
            job = _take(slot.sent, key)
            if job is None:
                log.warning("worker %d started %s, which it was not sent", slot.worker.slot, key)
                return
            slot.current, job.started = job, now
            slot.watch.start(job.task.key, now)
            job.log_path = None
            if self.on_start is not None:
                self.on_start(job, slot)
        elif kind == PROGRESS:
            size = event.get("bytes")
            # null until the worker knows the size (type, not isinstance: a bool is no size)
            slot.watch.beat(str(key), now, size if type(size) is int else None)
        elif kind == "result":
            job = slot.current if slot.current and slot.current.task.key == key else None
            job = job or _take(slot.sent, key)
            if job is None:
                return
            if slot.current is job:  # not a model found done, answered with no start
                slot.current = None
                slot.watch.end()
            try:
                result = result_from(event)
            except ValueError as e:
                log.error("worker %d: %s", slot.worker.slot, e)
                return
            ok = result.status in (DONE, SKIPPED)
            job.duration_s = result.seconds or max(now - job.started, 0.0)
            job.total_s += job.duration_s
            job.log_path = slot.worker.log_path(job.task.key)
            job.last = Ended(0 if ok else result.exit_code, None,
                             slot.worker.tail(key, ended=True),
                             "" if ok else result.error, not ok and result.retryable)
            slot.worker.forget(job.task.key)
            got.ended.append(job)

    def _exited(self, slot: Slot, now: float, got: Collected) -> None:
        self.live.remove(slot)
        got.released.append(slot.gpus)
        rc = slot.worker.returncode
        assert rc is not None
        job = slot.current
        if job is None and slot.sent and not slot.drained:
            # It exited without starting what it was sent (start-up failed, or it is not a
            # serving worker): that is the next job's attempt, as it would have been with
            # one process per model; retries stay bounded.
            job = slot.sent.popleft()
            job.started = now
            tail = slot.worker.tail(None)
        else:
            tail = slot.worker.tail(job.task.key) if job is not None else ()
        if job is not None:
            job.duration_s = max(now - job.started, 0.0)
            job.total_s += job.duration_s
            job.log_path = slot.worker.log_path(job.task.key)
            job.last = _crash(rc, tail, started=slot.current is job)
            if slot.current is job and slot.hung is not None:
                job.last = dataclasses.replace(job.last, error=slot.hung)
                job.hangs += 1
            elif slot.current is job:
                job.crashes += 1
            got.ended.append(job)
        elif rc != 0 and slot.terminate_at is None:
            log.warning("worker %d exited %s with no model in progress", slot.worker.slot,
                        describe_exit(rc)[0] or rc)
        for unstarted in slot.sent:
            unstarted.attempts -= 1  # sent, never started: not an attempt
            got.unstarted.append(unstarted)
        slot.sent.clear()

    # -- stopping --------------------------------------------------------------------------------

    def drain(self) -> None:
        """First stop: each worker finishes its model in progress, starts no other."""
        for slot in self.live:
            slot.worker.drain()
            slot.closing = slot.drained = True

    def terminate(self, now: float) -> None:
        """Second stop: SIGTERM every worker; the models in progress end cancelled."""
        for slot in self.live:
            if slot.terminate_at is None and slot.worker.running():
                log.warning("worker %d pid=%d: terminating", slot.worker.slot, slot.worker.pid)
                slot.worker.signal(signal.SIGTERM)
                slot.terminate_at = now
                if slot.current is not None:
                    slot.current.terminate_at = now

    def kill_hung(self, now: float) -> None:
        """SIGKILL the workers whose model in progress went quiet for its limit (its watch's):
        the exit charges the model the watch's ModelTimeout (_exited), and what the worker
        was sent and did not start goes back to the queue. A stop's SIGTERM (terminate_at)
        has its own deadline, and a model cancelled by it is not charged."""
        for slot in self.live:
            job = slot.current
            if job is None or slot.killed or slot.terminate_at is not None:
                continue
            error = slot.watch.overdue(now)
            if error is None:
                continue
            log.warning("model=%s key=%s hung: no progress for %.0f s (limit %.0f s, "
                        "--model-timeout sets the floor): SIGKILL worker %d pid=%d",
                        job.task.label, job.task.key, now - slot.watch.last_beat,
                        slot.watch.limit_s, slot.worker.slot, slot.worker.pid)
            slot.worker.signal(signal.SIGKILL)
            slot.killed, slot.hung = True, error

    def kill_overdue(self, now: float, grace: float) -> None:
        for slot in self.live:
            if (slot.terminate_at is not None and not slot.killed
                    and now - slot.terminate_at >= grace and slot.worker.running()):
                log.warning("worker %d did not exit %.0fs after SIGTERM: SIGKILL",
                            slot.worker.slot, grace)
                slot.worker.signal(signal.SIGKILL)
                slot.killed = True

    def reap_all(self, grace: float, release: Callable[[tuple[int, ...]], bool]) -> None:
        """Wait for terminated workers (SIGKILL after the grace period); free their GPUs."""
        deadline = time.monotonic() + grace
        for slot in self.live:
            slot.worker.wait(deadline - time.monotonic())
            release(slot.gpus)
        self.live.clear()


def _take(jobs: deque[Job], key: object) -> Job | None:
    for job in jobs:
        if job.task.key == key:
            jobs.remove(job)
            return job
    return None


def _crash(rc: int, tail: tuple[str, ...], *, started: bool) -> Ended:
    """How a job ended when its worker died: killed under it (a crash, retryable), or the
    worker's own exit status when it never got going."""
    exit_code, sig = (None, -rc) if rc < 0 else (rc, None)
    if exit_code == 0:
        exit_code = None  # exit 0 means "done" for a job, and this one is not
    if started:
        how = f"killed by {signal_name(sig)}" if sig is not None else f"exited {rc}"
        return Ended(exit_code, sig, tail,
                     f"WorkerCrashed: the worker was {how} while analysing this model", True)
    error, retryable = describe_exit(rc)
    return Ended(exit_code, sig, tail, error or "WorkerExited: the worker exited before "
                 "analysing this model", retryable if error else True)
