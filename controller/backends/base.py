"""The backend contract: what the sweep hands a backend (Tasks) and what comes back (Outcomes).

A backend runs tasks somewhere (this machine's GPUs, a Kubernetes cluster) and reports how
each ended; it knows nothing of the store's records or the summary (controller.run.recorder
turns Outcomes into records). What every worker computes and where it writes is the same
for every backend: `WorkerSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from controller.output.tenure import Tenure
from controller.progress import Progress
from esd_worker.core.command.flags import PREFETCH
from esd_worker.core.command.invocation import BATCH_MODES, MODEL, BatchOptions, WorkerInvocation
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow


@dataclass(frozen=True)
class Task:
    """One unit of work.

    key: model_key (or "cmd-<line>" in custom-commands mode); names logs and Jobs.
    label: for logs and progress: the model reference or the command line.
    row: the model to analyse; None for a custom command.
    argv: a custom command as an argument list (never a shell string); empty for a model,
        whose worker command the backend builds from `row` and its WorkerSpec.
    env: extra environment for a local worker. Secrets never go in argv: workers inherit
        HF_TOKEN / AWS_* from the controller's environment (or a Secret, on Kubernetes).
    """

    key: str
    label: str
    row: ModelRow | None = None
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def for_model(cls, row: ModelRow) -> Task:
        return cls(key=row.key, label=row.ref, row=row)


@dataclass(frozen=True)
class Outcome:
    """How a task ended.

    status: "done" (the worker succeeded), "failed" (last attempt failed; no retry left, not
        retryable, or a stop was requested), "cancelled" (stopped by a second stop request).
    exit_code: the last attempt's exit status; None when killed by a signal or never started.
    signal: the signal number that killed the last attempt, else None.
    attempts: attempts started.
    duration_s: run time of the last attempt, seconds; total_s: of all attempts (pauses
        between them not included); wait_s: time spent waiting for a GPU, a CPU slot or a
        node, all attempts.
    where: where the last attempt ran, for people: "gpus=0,1", "cpu", "pod=NS/NAME node=N",
        "job=NS/NAME".
    gpus: local GPU indices of the last attempt (empty on CPU and on Kubernetes).
    stderr_tail: last lines of the last attempt's output.
    log_path: the worker's log file, or None.
    error: "" when done, else "<Class>: <what happened>" (esd_worker.core.errors.classify_exit).
    retryable: whether another attempt could help.
    recorded: the store holds this outcome already (the worker wrote the marker or the
        failure record itself, as a sharded Kubernetes run's workers do): the recorder
        tallies it and writes nothing.
    """

    task: Task
    status: str
    exit_code: int | None
    signal: int | None
    attempts: int
    duration_s: float
    total_s: float
    wait_s: float
    where: str
    stderr_tail: tuple[str, ...]
    error: str
    retryable: bool
    gpus: tuple[int, ...] = ()
    log_path: str | None = None
    recorded: bool = False


class Work(Protocol):
    """The tasks of a run, in run order, and how many there are. Iterating may read them
    from the model list again (controller.run.plan.ListPlan: a list of millions is never held);
    a backend that needs them all at once makes a list (the local backend: one machine's
    worth of models). A list or tuple of Tasks is Work."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Task]: ...


OutcomeCallback = Callable[[Outcome], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a run computes and where it writes, whatever runs it.

    run_id: this run (runs/<run_id>.json; a label on Kubernetes). store_url: the output.
    analysis, save_eigs, trust_remote_code: the worker's analysis flags. log_format: the
    worker's log lines (text or json). device: auto, cpu or cuda, as asked.
    gpus_per_job: GPUs per model (0: CPU only). max_retries: extra attempts for
    retryable failures. overwrite: recompute models that are done. prefetch: models a
    long-lived worker downloads ahead; cache_budget: its bytes on disk for them (None:
    the worker's default); cache_dir: a download directory the worker owns and evicts
    (None: the HF cache, never evicted). model_timeout: the floor of a model's no-progress
    limit (None: the worker's default). parallel_gpu: a worker spreads one model over all its
    GPUs (False: --no-parallel-gpu). host_eigensolvers: a worker's host eigensolver threads
    (None: its default). Its workers' command lines: invocation(), for_row().
    """

    run_id: str
    store_url: str
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)
    save_eigs: bool = True
    trust_remote_code: bool = False
    log_format: str = "text"
    device: str = "auto"
    gpus_per_job: int = 1
    max_retries: int = 2
    overwrite: bool = False
    prefetch: int = PREFETCH
    cache_budget: int | None = None
    cache_dir: str | None = None
    parallel_gpu: bool = True
    model_timeout: float | None = None
    host_eigensolvers: int | None = None

    def batch(self) -> BatchOptions:
        """The many-models flags of this run's long-lived workers (--serve, --shards)."""
        return BatchOptions(run_id=self.run_id, max_retries=self.max_retries,
                            prefetch=self.prefetch, overwrite=self.overwrite,
                            cache_dir=self.cache_dir or None, cache_budget=self.cache_budget,
                            model_timeout=self.model_timeout)

    def invocation(self, mode: str = MODEL, target: str = "", *,
                   device: str | None = None) -> WorkerInvocation:
        """A worker of this run (esd_worker.core.command.invocation): its store, analysis, switches
        and log format, the run's batch flags in a batch mode; device None leaves --device
        out. With the default mode and no target, the template a backend gives each model
        (WorkerInvocation.for_model)."""
        return WorkerInvocation(
            mode=mode, target=target, output=self.store_url, log_format=self.log_format,
            device=device, batch=self.batch() if mode in BATCH_MODES else BatchOptions(),
            analysis=self.analysis, save_eigs=self.save_eigs,
            trust_remote_code=self.trust_remote_code, parallel_gpu=self.parallel_gpu,
            host_eigensolvers=self.host_eigensolvers)

    def for_row(self, row: ModelRow, device: str | None = None) -> WorkerInvocation:
        """The one-model worker of `row` (its reference, key, relation and base)."""
        return self.invocation(device=device).for_model(
            row.ref, key=row.key, relation=row.relation, base_model=row.source_model)


class Backend(Protocol):
    """Runs tasks and reports each one's end.

    run: run every task of `work`; call on_outcome once for each task that ended (done, failed,
    cancelled), in the calling thread, and return the outcomes it kept: all of them for a
    backend that holds its tasks (local, one Job per model), the failed ones for a sharded
    run, which never holds its millions (on_outcome got every one). Returns when every task
    has ended, or soon after request_stop.
    request_stop: safe from a signal handler; `stop_notice(n)` says, for people, what the
    n-th request does.
    guard: before run, the output's lease: no task starts once it is lost (a loss found while
    a task starts waits for that start: Tenure.holding makes the check and the start one
    step).
    dry_run: print what run would start (commands or Jobs) and start nothing; the count.
    report: the backend's part of runs/<run_id>.json: "device", "gpus", and anything of
    its own under its name; "running": tasks left running when run returned.
    close: free what the backend holds (NVML, API connections).
    """

    name: str

    def run(
        self, work: Work, on_outcome: OutcomeCallback, progress: Progress | None = None,
    ) -> Sequence[Outcome]: ...

    def request_stop(self) -> None: ...

    def guard(self, tenure: Tenure) -> None: ...

    def stop_notice(self, count: int) -> str: ...

    def dry_run(self, work: Work, out: TextIO) -> int: ...

    def report(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
