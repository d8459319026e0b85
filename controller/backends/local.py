"""The local backend: workers as subprocesses on this machine's free GPUs (or CPU slots).

Owns scheduling on this machine: the gputracker rule decides when a GPU may take a worker
(controller.gpus), transient failures are retried with backoff, Ctrl+C once stops new
work and twice terminates it. A model task's worker command is built here from the run's
WorkerSpec. Does not know the store or records (controller.recorder turns Outcomes into
those) and does not touch processes itself (controller.backends.process).
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from controller.backends.base import Outcome, OutcomeCallback, Task, Work, WorkerSpec
from controller.backends.loop import Loop
from controller.backends.tasks import Job, Outcomes
from controller.errors import SweepError
from controller.gpus import GpuTracker, open_tracker
from controller.progress import Progress
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
    worker_reuse: models one long-lived worker analyses before a fresh one replaces it
        (default None: no limit).
    """

    max_retries: int = 2
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    cpu_workers: int = 1
    log_dir: Path | None = None
    terminate_grace_s: float = 10.0
    worker_reuse: int | None = None

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
        if self.worker_reuse is not None and self.worker_reuse < 1:
            problems.append(f"worker_reuse: must be >= 1, got {self.worker_reuse}")
        if not self.terminate_grace_s >= 0:
            problems.append(f"terminate_grace_s: must be >= 0 s, got {self.terminate_grace_s}")
        if problems:
            raise ValueError("invalid local backend settings: " + "; ".join(problems))


def worker_argv(
    command: Sequence[str], row: ModelRow, spec: WorkerSpec, device: str
) -> tuple[str, ...]:
    """A model's one-model worker command: a list, never a shell string (ids are not
    trusted). What --dry-run prints: run() feeds the same models to long-lived workers."""
    return (*command, *spec.model_args(row), "--device", device,
            "--log-format", spec.log_format, *spec.flags())


def serve_argv(command: Sequence[str], spec: WorkerSpec, device: str) -> tuple[str, ...]:
    """A long-lived worker's command: models come on its stdin (esd_worker.protocol)."""
    return (*command, "--serve", "--output", spec.store_url, "--device", device,
            "--log-format", spec.log_format, *spec.batch_flags(), *spec.flags())


class LocalBackend:
    """Runs tasks on this machine, each on its own GPUs (tracker) or a CPU slot (no tracker).

    Models go to long-lived workers (controller.backends.slots), one per slot: with a
    tracker a slot holds `gpus_per_job` GPUs (its CUDA_VISIBLE_DEVICES) while its worker
    lives; without one, up to `settings.cpu_workers` slots, no GPU visible. A custom command
    is one process per attempt on a slot of its own. Workers get their own session: Ctrl+C
    reaches the controller only (request_stop). open_tracker: called when the first tasks
    arrive (nothing to do opens no NVML). on_start: called as each attempt starts.
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
            return ("stopping: no new models start; running workers finish the model in "
                    "progress (press Ctrl+C again to terminate them)")
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

    def serve_command(self) -> tuple[str, ...]:
        """The command of a long-lived worker of this run."""
        assert self.spec is not None
        return serve_argv(self.worker_cmd, self.spec, self.device)

    def dry_run(self, work: Work, out: TextIO) -> int:
        """The one-model command lines equivalent to what run() does (device as asked)."""
        device = self.spec.device if self.spec is not None else "auto"
        count = 0
        for task in work:
            out.write(shlex.join(self.argv(task, device)) + "\n")
            count += 1
        out.flush()
        return count

    # The run loop -------------------------------------------------------------------------

    def run(
        self, work: Work, on_outcome: OutcomeCallback | None = None,
        progress: Progress | None = None,
    ) -> list[Outcome]:
        """Run every task; return when all have ended, or a stop was requested and the
        running ones have ended. The tasks are held as a list: this machine's worth.

        Returns one Outcome per task that started at least once (tasks never started
        because of a stop have none; the next run picks them up).
        """
        tasks = list(work)
        if tasks and self._open_tracker is not None:
            self.tracker, self._open_tracker = self._open_tracker(), None
            self._check_capacity()
        loop = Loop(self, tasks, Outcomes(on_outcome, progress))
        try:
            return loop.run()
        finally:
            loop.cleanup()

    # What the loop asks of the backend ---------------------------------------------------------

    def acquire(self, in_use: int) -> tuple[int, ...] | None:
        """GPUs for one more worker ((): a CPU slot), or None when none may start now."""
        if self.tracker is None:
            return () if in_use < self.settings.cpu_workers else None
        return self.tracker.acquire(self.gpus_per_job)

    def release(self, gpus: tuple[int, ...]) -> bool:
        if gpus and self.tracker is not None:
            self.tracker.release(gpus)
            return True
        return False

    def threads(self) -> int | None:
        """CPU threads per worker: N CPU workers each using every core run several times
        slower than N workers with cores/N threads (measured on 2 cores)."""
        if self.tracker is not None:
            return None
        return max(1, (os.cpu_count() or 1) // self.settings.cpu_workers)

    def backoff(self, job: Job) -> float:
        """Seconds before the next attempt: doubling from backoff_s, capped, with jitter."""
        base = min(self.settings.backoff_max_s,
                   self.settings.backoff_s * 2 ** (job.attempts - 1))
        return base * self._random.uniform(0.5, 1.0)
