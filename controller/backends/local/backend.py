"""The local backend: workers as subprocesses on this machine's free GPUs (or CPU slots).

Owns scheduling on this machine: the gputracker rule decides when a GPU may take a worker
(controller.gpu.gpus), transient failures are retried with backoff, Ctrl+C once stops new
work and twice terminates it. A model task's worker command is built here from the run's
WorkerSpec. Does not know the store or records (controller.run.recorder turns Outcomes into
those) and does not touch processes itself (controller.backends.local.process).
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from controller.backends.base import Outcome, OutcomeCallback, Task, Work, WorkerSpec
from controller.backends.local.loop import Loop
from controller.backends.local.needs import GpuNeeds
from controller.backends.local.process import cpu_share_env
from controller.backends.local.settings import LocalSettings
from controller.backends.local.tasks import Job, Outcomes
from controller.errors import SweepError
from controller.gpu.counts import GpuCounts
from controller.gpu.gpurule import GpuRule, describe
from controller.gpu.gpus import GpuTracker, open_tracker
from controller.output.tenure import Guarded
from controller.progress import Progress
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import ShapeFinder
from esd_worker.core.command.invocation import SERVE
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.watchdog import DEFAULT_MODEL_TIMEOUT_S

if TYPE_CHECKING:
    from controller.settings import SweepSettings

log = logging.getLogger(__name__)


def worker_argv(
    command: Sequence[str], row: ModelRow, spec: WorkerSpec, device: str
) -> tuple[str, ...]:
    """A model's one-model worker command: a list, never a shell string (ids are not
    trusted). What --dry-run prints: run() feeds the same models to long-lived workers."""
    return tuple(spec.for_row(row, device).command(command))


def serve_argv(command: Sequence[str], spec: WorkerSpec, device: str) -> tuple[str, ...]:
    """A long-lived worker's command: models come on its stdin (esd_worker.core.protocol)."""
    return tuple(spec.invocation(SERVE, device=device).command(command))


class LocalBackend(Guarded):
    """Runs tasks on this machine, each on its own GPUs (tracker) or a CPU slot (no tracker).

    Models go to long-lived workers (controller.backends.local.slots), one per slot: with a
    tracker a slot holds its GPUs (its CUDA_VISIBLE_DEVICES) while its worker lives, as many
    as `rule` gives its models (controller.gpu.gpurule: `gpus_per_job` for all, or with auto a
    count per model from its shape, found by `finder`, default: through the hub at
    HF_ENDPOINT; controller.backends.local.needs); without one, up to `settings.cpu_workers`
    slots, no GPU visible. A custom command is one process per attempt on `gpus_per_job`
    GPUs. Workers get their own session: Ctrl+C reaches the controller only (request_stop).
    open_tracker: called when the first tasks arrive (nothing to do opens no NVML).
    on_start: called as each attempt starts. dry_run_cap: the most GPUs a model gets in a
    dry run (default: the rule's cap).
    """

    name = "local"

    def __init__(
        self,
        settings: LocalSettings,
        tracker: GpuTracker | None = None,
        *,
        gpus_per_job: int = 1,
        rule: GpuRule | None = None,
        finder: ShapeFinder | None = None,
        spec: WorkerSpec | None = None,
        worker_cmd: Sequence[str] = (sys.executable, "-m", "esd_worker.cli"),
        open_tracker: Callable[[], GpuTracker | None] | None = None,
        on_start: Callable[[Task, tuple[int, ...]], None] | None = None,
        dry_run_cap: int | None = None,
    ) -> None:
        settings.validate()
        rule = rule or GpuRule(explicit=gpus_per_job)
        rule.validate()
        if rule.base < 1:
            raise ValueError(f"gpus_per_job: must be >= 1, got {rule.base}")
        self.settings = settings
        self.tracker = tracker
        self.rule = rule
        self.gpus_per_job = rule.base  # custom commands, and every model unless auto
        self.finder = finder
        self.dry_run_cap = rule.max_gpus_per_job if dry_run_cap is None else dry_run_cap
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
        gpu, rule = settings.gpu, settings.applied_gpu_rule
        usable = [n for n in (len(gpu.gpu_list) if gpu.gpu_list else None, gpu.max_gpus)
                  if n is not None]
        return cls(
            settings.local, None, rule=rule, spec=spec,
            worker_cmd=settings.worker_cmd,
            open_tracker=lambda: open_tracker(settings.device, settings.gpu,
                                              settings.local.cpu_workers),
            # --dry-run opens no NVML: the rule's cap, and the GPUs the flags allow.
            dry_run_cap=min([rule.max_gpus_per_job, *usable]),
        )

    @property
    def cap(self) -> int:
        """The most GPUs one worker may hold: the rule's cap within what the tracker manages
        (0: CPU slots)."""
        if self.tracker is None:
            return 0
        return min(self.rule.max_gpus_per_job, self.tracker.capacity)

    def gpu_counts(self, cap: int) -> GpuCounts | None:
        """The rule over model shapes when models may get different counts (else None: every
        model gets gpus_per_job, and no shape is looked up)."""
        if not self.rule.splits(cap) or self.spec is None:
            return None
        if self.finder is None:
            self.finder = ShapeFinder(Sizer(), self.rule)  # HF_ENDPOINT, HF_TOKEN, offline
        return GpuCounts(self.rule, self.finder, cap)

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
        """The one-model command lines equivalent to what run() does (device as asked). With
        --gpus-per-job auto and GPUs, a `# gpus=N` comment before each model the rule gives
        several (dry_run_cap: NVML is not opened)."""
        device = self.spec.device if self.spec is not None else "auto"
        counts = None if device == "cpu" else self.gpu_counts(self.dry_run_cap)
        if counts is not None:
            out.write("# --gpus-per-job auto: each model runs on 1 GPU unless a '# gpus=N' "
                      "line before it says otherwise\n")
        tasks = list(work) if counts is not None else work
        listed = ({t.row.key: t.row for t in tasks if t.row is not None}
                  if counts is not None else {})
        count = 0
        for task in tasks:
            if counts is not None and task.row is not None and not task.argv:
                gpus, shape = counts.decide(task.row, listed.get)
                if gpus > 1 and shape is not None:
                    out.write(f"# gpus={gpus}: {describe(task.row.ref, shape, gpus)}\n")
            out.write(shlex.join(self.argv(task, device)) + "\n")
            count += 1
        if counts is not None:
            counts.log_stats()
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
        fixed = self.gpus_per_job if self.tracker is not None else 0
        if self.tracker is not None:
            log.info("GPUs per model: %s", self.rule.explain(self.cap))
        needs = GpuNeeds(self.gpu_counts(self.cap), fixed,
                         [t.row for t in tasks if t.row is not None and not t.argv])
        loop = Loop(self, tasks, Outcomes(on_outcome, progress), needs)
        try:
            return loop.run()
        finally:
            needs.close()
            loop.cleanup()

    # What the loop asks of the backend (loop.Dispatcher) ----------------------------------------

    @property
    def stop_requests(self) -> int:
        """Stops requested so far: 1 starts nothing new, 2 terminates running workers."""
        return self._stop_requests

    @property
    def prefetch(self) -> int:
        """Models a long-lived worker is given ahead of the one it analyses."""
        return self.spec.prefetch if self.spec is not None else 0

    @property
    def model_timeout(self) -> float:
        """The floor of a model's no-progress limit in a long-lived worker (--model-timeout),
        seconds: the watch's default when the run's WorkerSpec gives none."""
        timeout = self.spec.model_timeout if self.spec is not None else None
        return DEFAULT_MODEL_TIMEOUT_S if timeout is None else timeout

    def serves(self, task: Task) -> bool:
        """Whether the task goes to a long-lived worker (a model, with this run's WorkerSpec);
        else it is a custom command, one process per attempt (command)."""
        return task.row is not None and not task.argv and self.spec is not None

    def command(self, task: Task) -> tuple[str, ...]:
        """The command of one attempt of a task that is not served, on this run's device."""
        return self.argv(task, self.device)

    def poll_gpus(self) -> float | None:
        """Look at the GPUs again; seconds until the next look (None: no tracker, CPU slots)."""
        if self.tracker is None:
            return None
        self.tracker.poll()
        return self.tracker.settings.poll_interval_s

    def started(self, task: Task, gpus: tuple[int, ...]) -> None:
        """An attempt started on `gpus` (on_start's)."""
        if self.on_start is not None:
            self.on_start(task, gpus)

    def acquire(self, in_use: int, gpus: int) -> tuple[int, ...] | None:
        """`gpus` GPUs for one more worker ((): a CPU slot), or None when none may start now."""
        if self.tracker is None:
            return () if in_use < self.settings.cpu_workers else None
        return self.tracker.acquire(gpus)

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

    def worker_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """A GPU worker's share of the machine's CPUs (process.cpu_share_env)."""
        return cpu_share_env(gpus, self.tracker.capacity if self.tracker is not None else 0)

    def backoff(self, job: Job) -> float:
        """Seconds before the next attempt: doubling from backoff_s, capped, with jitter."""
        base = min(self.settings.backoff_max_s,
                   self.settings.backoff_s * 2 ** (job.attempts - 1))
        return base * self._random.uniform(0.5, 1.0)
