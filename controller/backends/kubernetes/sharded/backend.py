"""The sharded Kubernetes backend: one Indexed Job per resource class over shards of the list.

Owns the Backend contract (controller.backends.base) for `--backend kubernetes` when models
are sharded (the default; `--shard-size 1` keeps one Job per model: per_model.backend):
checking the API server can run it, re-attaching to the sweep's Indexed Jobs a run before
left running, creating this run's Jobs, following them by polling (a handful of objects,
whatever the number of models), and each model's Outcome at the end, read from the store:
the workers write markers and failure records themselves; only a shard whose pods never
finished it (a failed index) is diagnosed from its pods. Does not cut shards (.sharding),
build Jobs (.indexed), wire its parts from the settings (common.wiring) or talk HTTP
(common.client).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TextIO

from controller.backends.base import Outcome, OutcomeCallback, Task, Work, WorkerSpec
from controller.backends.kubernetes.common.errors import sweep_errors
from controller.backends.kubernetes.common.jobevents import JobEventRecorder
from controller.backends.kubernetes.common.jobs import CACHE_DIR, JobSettings
from controller.backends.kubernetes.common.names import RUN_LABEL, sharded_selector
from controller.backends.kubernetes.common.resources import ResourceClass, cache_budget
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.common.wiring import (
    check_server,
    client_for,
    sweep_gpu_counts,
    sweep_job_settings,
    sweep_sizer,
    with_template_image,
)
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from controller.backends.kubernetes.sharded.budgets import DownloadBudgets
from controller.backends.kubernetes.sharded.devicefaults import DeviceFaults
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from controller.backends.kubernetes.sharded.milestones import (
    NO_WAIT,
    STOPPED,
    Finished,
    announce,
    completed,
    ended,
)
from controller.backends.kubernetes.sharded.plan import default_classes
from controller.backends.kubernetes.sharded.progress import ShardProgressReader
from controller.backends.kubernetes.sharded.sharding import ClassShards, write_shards
from controller.backends.kubernetes.sharded.status import IndexedRun, ShardFailures, held_keys
from controller.errors import InfrastructureError, SweepError
from controller.gpu.counts import GpuCounts
from controller.keyset import KeySet
from controller.output.tenure import Guarded
from controller.progress import ClassProgress, Progress
from esd_worker.core.errors import EXIT_DEVICE
from esd_worker.core.store.layout import iter_markers, list_failure_keys, shard_prefix
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.records import read_failure
from esd_worker.core.store.stores import Store

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.settings import SweepSettings

log = logging.getLogger(__name__)

RETURNED_FAILURES = 10_000  # store_outcomes' list: the first failures, all reported


class ShardedBackend(Guarded):
    """Runs a sweep as Indexed Jobs over shards (the Backend protocol).

    classes: the resource classes models are sorted into (.plan). size: a model's bytes
    (controller.weights.sizing.Sizer.size); base_size: an adapter's base's (Sizer.base_size;
    None: adapters count alone). gpus: a model's GPU count (controller.gpu.counts.GpuCounts;
    models it gives N > 1 go to a class "gpu-x<N>" of their own; None: every model to
    `classes`). poll_s: seconds between looks at the Jobs. clock / sleep: for tests.
    """

    name = "kubernetes"
    events: JobEventRecorder | None = None  # the run's Events on its Jobs (from run())

    def __init__(
        self, settings: ClusterSettings, kube: KubeClient | None, *, spec: WorkerSpec,
        job_settings: JobSettings, store: Store, classes: tuple[ResourceClass, ...],
        size: Callable[[Any], int], size_report: Callable[[], None] = lambda: None,
        base_size: Callable[[str], int] | None = None, gpus: GpuCounts | None = None,
        poll_s: float = 10.0, own_kube: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        problems = settings.problems()
        if problems:
            raise SweepError("invalid cluster settings: " + "; ".join(problems))
        self.settings = settings
        self.kube = kube
        self.spec = spec
        self.job_settings = job_settings
        self.store = store
        self.classes = classes
        self.size = size
        self.base_size = base_size
        self.size_report = size_report
        self.budgets = DownloadBudgets(settings, job_settings, spec)
        self.gpus = gpus
        self.poll_s = poll_s
        self.instance = job_settings.instance
        self._own_kube = own_kube
        self._clock = clock
        self._sleep = sleep
        self._stop_requests = 0
        self.runs: list[IndexedRun] = []  # this run's Jobs
        self.attached: list[IndexedRun] = []  # unfinished Jobs of earlier runs, waited for
        self.left_running: list[str] = []
        self._complete: set[str] = set()  # the Jobs whose ClassComplete went out
        # The running shards' progress documents: per-model counts, read every 30 s.
        self.shard_progress = ShardProgressReader(store)
        self.devices = DeviceFaults(settings.namespace, store, run_id=spec.run_id,
                                    max_faults=spec.max_retries + 1)

    @classmethod
    def from_settings(cls, settings: SweepSettings, spec: WorkerSpec, *,
                      kube: KubeClient | None = None) -> ShardedBackend:
        """The backend `esd-sweep run --backend kubernetes` uses (sharded mode)."""
        cluster = settings.cluster
        job_settings = sweep_job_settings(settings, spec)
        gpus = job_settings.gpus_per_job
        classes = default_classes(device="cpu" if gpus == 0 else "cuda", gpus_per_job=gpus,
                                  large_bytes=cluster.large_model_bytes)
        sizer = sweep_sizer(cluster)
        with client_for(settings, kube) as (client, own):
            cluster, job_settings = with_template_image(settings, job_settings, client)
            return cls(cluster, client, spec=spec, job_settings=job_settings,
                       store=open_store(spec.store_url), classes=classes, size=sizer.size,
                       size_report=sizer.log_stats, base_size=sizer.base_size,
                       gpus=sweep_gpu_counts(settings, sizer, job_settings),
                       poll_s=cluster.poll_interval_s, own_kube=own)

    # -- the Backend protocol ---------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_requests += 1

    def stop_notice(self, count: int) -> str:
        return ("stopping: the Indexed Jobs keep running on the cluster (the next run "
                "re-attaches to them)")

    @property
    def device(self) -> str:
        return "cuda" if self.job_settings.gpus_per_job > 0 else "cpu"

    def dry_run(self, work: Work, out: TextIO) -> int:
        """Print the Indexed Jobs this run would create (shards counted, not written)."""
        shards = self._shard(work, _Discard())  # type: ignore[arg-type]
        pods = sum(c.parallelism for c in shards)
        jobs = [self._job(c, pods) for c in shards]
        for c in shards:
            prefix = shard_prefix(self.spec.run_id, c.cls.name)
            where = f"{self.spec.store_url.rstrip('/')}/{prefix}"
            out.write(f"# class {c.cls.name}: {c.models} model(s) in {c.shards} shard(s), "
                      f"{c.parallelism} pod(s) at once; shards written to {where}\n")
        out.writelines(f"# {error}\n" for error in self.budgets.errors.values())
        out.write(jobs_to_yaml(jobs) if jobs else "")
        out.flush()
        return len(jobs)

    def run(self, work: Work, on_outcome: OutcomeCallback,
            progress: Progress | None = None) -> list[Outcome]:
        with sweep_errors():
            return self._run(work, on_outcome, progress)

    def report(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "gpus": [],
            "running": sum(r.models for r in self.runs if not r.finished),
            "kubernetes": {
                "mode": "sharded",
                "namespace": self.settings.namespace,
                "instance": self.instance,
                "image": self.settings.image,
                "jobs": [r.summary() for r in self.runs],
                "attached": [r.summary() for r in self.attached],
                "jobs_left_running": self.left_running,
                "api_requests": self.kube.requests if self.kube is not None else 0,
                "waited": self.settings.wait,
                "bad_nodes": self.devices.report(),
            },
        }

    def close(self) -> None:
        if self._own_kube and self.kube is not None:
            self.kube.close()

    # -- the run ----------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop_requests > 0 or self.lease_lost  # a Job under way still goes

    def _run(self, work: Work, on_outcome: OutcomeCallback,
             progress: Progress | None) -> list[Outcome]:
        kube = self._client()
        self.events = self.devices.events = JobEventRecorder(kube)
        check_server(kube)
        self.attached = _unfinished(kube, self.settings.namespace, self.instance,
                                    self.spec.run_id)
        # Sharded now, not after the attached Jobs end: what they do not hold, if any.
        remaining, attached = _not_held(work, self.store, self.attached)
        shards = self._shard(remaining, self.store)
        pods = sum(c.parallelism for c in shards)
        for c in shards:
            self.runs.append(self._create(kube, c, pods))
        following = [*self.attached, *self.runs]
        if not self.settings.wait:
            self.left_running = [r.name for r in following]
            log.info("--no-wait: %d Indexed Job(s) created; a later run re-attaches to them",
                     len(self.runs))
            ended(self.events, self.spec.run_id, following, NO_WAIT)
            return []
        followed = self._follow(kube, following, progress)
        self.runs = following[len(self.attached):]  # and any Job made while following
        if not followed:
            ended(self.events, self.spec.run_id, following, STOPPED)
            return []
        failures = ShardFailures(kube, self.store, self.settings, following, self.events)
        with Finished(self.events, self.spec.run_id, following, on_outcome) as counted:
            return store_outcomes(work, self.store, self.spec.run_id, failures, counted,
                                  too_big=self.budgets.errors, attached=attached)

    def _client(self) -> KubeClient:
        if self.kube is None:
            raise SweepError("the kubernetes backend has no client (built for a dry run)")
        return self.kube

    def _shard(self, work: Work, store: Store) -> list[ClassShards]:
        shards = write_shards(
            work, store=store, run_id=self.spec.run_id, classes=self.classes, size=self.size,
            budget=self.settings.max_parallel, max_models=self.settings.shard_size or 1000,
            gpus=self.gpus, base_size=self.base_size, cache_budget_of=self.budgets.of,
            on_too_big=self.budgets.too_big)
        self.budgets.log_count()
        self.size_report()
        if self.gpus is not None:
            self.gpus.log_stats()
        return shards

    def _job(self, c: ClassShards, pods: int) -> dict[str, Any]:
        """The Indexed Job of one class; pods: the run's pods at once, all classes (the
        sweep's hub rate is shared among them)."""
        hub_rate = self.settings.hub_rate / max(pods, 1)
        settings = self.settings.for_class(self.job_settings, c.cls)
        batch = self.spec.batch()
        if not self.spec.cache_dir and not settings.hf_cache_pvc:
            # The pod's disk is bounded (the cache volume's sizeLimit): the worker downloads
            # into a folder of its own there and deletes each model once analysed, within
            # the disk asked for less the headroom.
            budget = batch.cache_budget
            if budget is None:
                budget = cache_budget(settings.ephemeral_storage_request)
            batch = replace(batch, cache_dir=f"{CACHE_DIR}/models", cache_budget=budget)
        settings = replace(settings, worker=settings.worker.replace(batch=batch,
                                                                    hub_rate=hub_rate))
        prefix = shard_prefix(self.spec.run_id, c.cls.name).rstrip("/")
        return build_indexed_job(
            run_id=self.spec.run_id, class_name=c.cls.name, completions=c.shards,
            parallelism=c.parallelism, backoff_limit_per_index=self.spec.max_retries + 1,
            shards_url=f"{self.spec.store_url.rstrip('/')}/{prefix}",
            output_url=self.spec.store_url, settings=settings,
            models=c.models, shard_bytes=c.bytes // max(c.shards, 1),
            avoid_nodes=self.devices.avoided())

    def _create(self, kube: KubeClient, c: ClassShards, pods: int) -> IndexedRun:
        job = self._job(c, pods)
        ns, name = self.settings.namespace, job["metadata"]["name"]
        kube.create_job(ns, job)  # "exists": a create whose answer was lost; read back below
        created = kube.read_job(ns, name)
        if created is None or (created["metadata"].get("labels") or {}).get(
                RUN_LABEL) != self.spec.run_id:
            raise SweepError(f"Job {name} in namespace {ns} is not this run's: delete it")
        if "backoffLimitPerIndex" not in (created.get("spec") or {}):
            kube.delete_job(ns, name)
            raise SweepError(
                f"the API server dropped spec.backoffLimitPerIndex from Job {name} (the "
                "JobBackoffLimitPerIndex feature is off on this cluster): enable it, or run "
                "one Job per model with --shard-size 1")
        log.info("job=%s class=%s: %d shard(s), %d model(s), %d pod(s) at once", name,
                 c.cls.name, c.shards, c.models, c.parallelism)
        announce(self.events, created, c, self.spec.run_id)
        return self.devices.track(IndexedRun.from_job(created, per_shard=c.per_shard), c, pods)

    def _follow(self, kube: KubeClient, runs: list[IndexedRun],
                progress: Progress | None) -> bool:
        """Poll the Jobs until every one has finished; False when stopped first."""
        selector = sharded_selector(self.instance)
        while True:
            items, _ = kube.list_jobs(self.settings.namespace, selector)
            listed = {job["metadata"]["name"]: job for job in items}
            for r in runs:
                job = listed.get(r.name)
                if job is not None:
                    r.update(job, self._clock())
                elif not r.finished:
                    r.vanish()  # deleted under us: its unfinished shards have no outcome
                stuck = r.explain_pending(kube, self.settings, self._clock())
                if stuck is not None:  # a class no node can run ends the run (exit 3)
                    raise _give_up(kube, self.settings.namespace, r, runs, stuck, self.events)
            runs.extend(self.devices.follow(  # indexes whose GPU broke run again elsewhere
                kube, runs, self._clock(), lambda c, pods: self._create(kube, c, pods)))
            completed(self.events, runs, self._complete)  # counts the indexes run again
            if progress is not None:
                _show(progress, runs, self.shard_progress.poll(runs, self._clock()))
            if all(r.finished for r in runs):
                return True
            if self._stopping():
                self.left_running = [r.name for r in runs if not r.finished]
                log.warning("stop requested: %d Indexed Job(s) keep running on the cluster "
                            "(the next run re-attaches)", len(self.left_running))
                return False
            self._sleep(self.poll_s)

@dataclass(frozen=True)
class _Attached:
    """The earlier runs whose unfinished Jobs this run followed (run_ids) and the models
    their shards held then (keys): a failure record of one of those runs for one of those
    models is that model's outcome, as this run's own records are."""

    run_ids: frozenset[str] = frozenset()
    keys: KeySet | None = None

    def recorded(self, record_run_id: str, key: str) -> bool:
        return record_run_id in self.run_ids and self.keys is not None and key in self.keys


def _not_held(work: Work, store: Store, attached: list[IndexedRun]) -> tuple[Work, _Attached]:
    """The work without what the attached Jobs of earlier runs still hold (their shards'
    models, streamed into a KeySet) or what is done, and those runs for the outcomes."""
    if not attached:
        return work, _Attached()
    held = KeySet(held_keys(store, attached))
    log.info("re-attaching to %d Indexed Job(s) of this sweep left running by an earlier run "
             "(%s), which hold %d model(s); what they do not hold is sharded now",
             len(attached), ", ".join(r.name for r in attached), len(held))
    return (_NotDone(work, KeySet(iter_markers(store)), held),
            _Attached(frozenset(r.run_id for r in attached), held))


def _give_up(kube: KubeClient, namespace: str, stuck: IndexedRun, runs: list[IndexedRun],
             why: str, events: JobEventRecorder | None = None) -> InfrastructureError:
    """The error that ends a run whose class no node can schedule, once its Job is deleted
    (ours; its pending pods would keep an autoscaler trying for ever; an Unschedulable
    Event on it first); the other Jobs are left running for the next run to re-attach to."""
    if events is not None:
        events.warning(stuck.job, "Unschedulable",
                       f"{why}: the Job is deleted and the run ends (exit 3)")
    kube.delete_job(namespace, stuck.name)
    left = sum(1 for r in runs if not r.finished and r is not stuck)
    others = f"; {left} other Job(s) keep running (the next run re-attaches)" if left else ""
    return InfrastructureError(
        f"{why}; Job {stuck.name} deleted{others}: give the cluster nodes that fit (or "
        "change --ephemeral-storage-request, --memory-request, --node-selector, "
        "--toleration) and run again")


def _unfinished(kube: KubeClient, namespace: str, instance: str,
                run_id: str) -> list[IndexedRun]:
    """The sweep's Indexed Jobs of earlier runs that are still running (re-attached to)."""
    items, _ = kube.list_jobs(namespace, sharded_selector(instance))
    runs = [IndexedRun.from_job(job) for job in items]
    return [r for r in runs if not r.finished and r.run_id != run_id]


def store_outcomes(work: Work, store: Store, run_id: str, failures: ShardFailures,
                   on_outcome: OutcomeCallback, *, too_big: Mapping[str, str] | None = None,
                   attached: _Attached | None = None) -> list[Outcome]:
    """Each model's Outcome from the store (one listing of markers and one of failure
    records); a model of a failed index without a record of this run (or of the attached
    run whose shard held it) gets the diagnosis of the index's last pod; one with neither
    is a retryable NoOutcome. too_big: the models the plan sharded nowhere (key -> error),
    each a permanent failure. A shard given up after broken GPUs (exit 6) is tallied,
    never written as a model's record. Every outcome goes to on_outcome; the list returned
    holds the first RETURNED_FAILURES failed ones only (a sweep of millions may fail
    hundreds of thousands)."""
    too_big = too_big or {}
    attached = attached or _Attached()
    done = KeySet(iter_markers(store))
    records = list_failure_keys(store)
    outcomes: list[Outcome] = []
    for task in work:
        key = task.key
        where = failures.where(key)
        record = read_failure(store, key) if key not in done and key in records else None
        diagnosis = failures.diagnosis(key)
        if key in done:
            outcome = _outcome(task, "done", where=where, recorded=True)
        elif key in too_big:
            outcome = _outcome(task, "failed", where=where, error=too_big[key])
        elif record is not None and (record.run_id == run_id
                                     or attached.recorded(record.run_id, key)):
            outcome = _outcome(task, "failed", where=where, recorded=True, error=record.error,
                               retryable=record.retryable, exit_code=record.exit_code,
                               attempts=record.attempts, tail=record.stderr_tail)
        elif diagnosis is not None:  # broken GPUs are no model's fault: recorded as nothing
            outcome = _outcome(task, "failed", where=where, error=diagnosis.error,
                               retryable=diagnosis.retryable, exit_code=diagnosis.exit_code,
                               signal=diagnosis.signal, tail=diagnosis.tail,
                               recorded=diagnosis.exit_code == EXIT_DEVICE)
        else:
            outcome = _outcome(task, "failed", where=where, retryable=True, error=(
                "NoOutcome: the shard's pod ended without a result or a failure record "
                "for this model (the next run tries it again)"))
        if outcome.status != "done" and len(outcomes) < RETURNED_FAILURES:
            outcomes.append(outcome)
        on_outcome(outcome)
    return outcomes


def _outcome(task: Task, status: str, *, where: str, recorded: bool = False, error: str = "",
             retryable: bool = False, exit_code: int | None = None,
             signal: int | None = None, attempts: int = 1,
             tail: tuple[str, ...] = ()) -> Outcome:
    return Outcome(task=task, status=status, exit_code=0 if status == "done" else exit_code,
                   signal=signal, attempts=max(attempts, 1), duration_s=0.0, total_s=0.0,
                   wait_s=0.0, where=where, stderr_tail=tuple(tail), error=error,
                   retryable=retryable, recorded=recorded)


def _show(progress: Progress, runs: list[IndexedRun],
          classes: list[ClassProgress] | None = None) -> None:
    """The bar's totals (per model once the shards' progress documents are read) and, for
    the observers, each class's progress."""
    if classes is not None:
        progress.update_classes(classes)
    done = sum(r.models_done for r in runs)
    failed = sum(r.models_failed for r in runs)
    running = sum(r.models_running for r in runs)
    total = sum(r.models - r.models_replaced for r in runs)  # a replaced shard counts once
    progress.update(done=done, failed=failed, running=running,
                    waiting=max(total - done - failed - running, 0))


class _NotDone:
    """Work without the models that have a marker now or that Jobs of an earlier run hold
    (after re-attaching)."""

    def __init__(self, work: Work, done: KeySet, held: KeySet) -> None:
        self.work, self.done, self.held = work, done, held
        self._count: int | None = None

    def __len__(self) -> int:
        if self._count is None:
            self._count = sum(1 for _ in self)
        return self._count

    def __iter__(self) -> Iterator[Task]:
        return (task for task in self.work
                if task.key not in self.done and task.key not in self.held)


class _Discard:
    """A store that takes shard lists and keeps nothing (--dry-run counts shards only)."""

    url = "dry-run://"

    def put_bytes(self, key: str, data: bytes) -> None:
        pass

