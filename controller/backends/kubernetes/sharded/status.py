"""Where one Indexed Job of a sharded run stands, and why its failed shards failed.

Owns reading an Indexed Job's status (completedIndexes, failedIndexes, active, ready) into
models done / failed / running (by the models each shard holds; per model once
sharded.progress has read the shards' progress documents: IndexedRun.counted), telling a
person once per timeout why the Job has no pod running, finding a Job stuck for good (its
pods unschedulable for the pending timeout), and, for a shard whose index failed (its pods never
finished it), the diagnosis of its last pod, given to the shard's models that have no
record of their own, and a ShardFailed Event with it on the Job (the first few indexes of a
Job each, the rest in one; common.jobevents). Reads the Job and its pods only; per-model
outcomes come from the store (controller.backends.kubernetes.sharded.backend).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.diagnosis import (
    Diagnosis,
    config_error,
    describe_pending,
    diagnose_failure,
    is_unschedulable,
    job_condition,
)
from controller.backends.kubernetes.common.jobevents import (
    JobEventRecorder,
    failure_line,
    foreign,
)
from controller.backends.kubernetes.common.kueue import queued_workloads
from controller.backends.kubernetes.common.names import (
    CLASS_LABEL,
    JOB_NAME_LABEL,
    RUN_LABEL,
)
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.errors import InfrastructureError
from esd_worker.core.errors import EXIT_DEVICE, ModelListError
from esd_worker.core.models.modellist import ModelRow, read_model_list
from esd_worker.core.store.layout import shard_key
from esd_worker.core.store.stores import Store

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)

_READERS = 16  # shard lists read at once when re-attaching (held_keys)
# Failed indexes of one Job that get a ShardFailed Event each; the rest share one.
SHARD_EVENTS_PER_JOB = 5

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # on the pods, from Kubernetes 1.28
MODELS_ANNOTATION = "esd-sweep/models"


def parse_indexes(text: str | None) -> list[int]:
    """The indexes of a Job's completedIndexes / failedIndexes ("1,3-5,7"), ascending."""
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            out.extend(range(int(low), int(high) + 1) if sep else [int(low)])
        except ValueError:
            log.warning("unreadable index range %r in a Job's status: ignored", part)
    return sorted(set(out))


@dataclass(frozen=True)
class ShardCounts:
    """An Indexed Job's models by state, per model, from its shards' progress documents
    (sharded.progress): done (or skipped as done before), failed, being analysed now."""

    done: int = 0
    failed: int = 0
    running: int = 0


@dataclass
class IndexedRun:
    """One Indexed Job: its shards' model counts (per_shard, by index; empty for a Job of
    an earlier run, whose shards count `models / completions` each) and its state."""

    name: str
    run_id: str
    class_name: str
    completions: int
    models: int
    per_shard: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    active: int = 0
    ready: int = 0
    finished: bool = False
    state: str = ""  # Complete, Failed, Deleted
    job: dict[str, Any] = field(default_factory=dict)
    created_at: float | None = None
    _explained_at: float | None = None
    # Since when the Job has had pods to place and none running (None: running, or
    # suspended: Kueue holds it for quota, which is waiting, not being stuck).
    _stuck_since: float | None = None
    # Failed indexes that are not this Job's to diagnose (sharded.devicefaults): handed to
    # a replacement Job (index → its name; its models' outcomes are that Job's), or given
    # up after broken GPUs on too many nodes (index → the DeviceError for its models).
    replaced: dict[int, str] = field(default_factory=dict)
    device_errors: dict[int, str] = field(default_factory=dict)
    # Per-model counts from the shards' progress documents (sharded.progress); None until
    # one is read: the counts are then by whole shard, and "running" an estimate.
    counted: ShardCounts | None = None

    @classmethod
    def from_job(cls, job: Mapping[str, Any], per_shard: Sequence[int] = ()) -> IndexedRun:
        meta = job.get("metadata") or {}
        labels = meta.get("labels") or {}
        spec = job.get("spec") or {}
        try:
            models = int((meta.get("annotations") or {}).get(MODELS_ANNOTATION) or 0)
        except ValueError:
            models = 0
        run = cls(name=str(meta.get("name")), run_id=str(labels.get(RUN_LABEL) or ""),
                  class_name=str(labels.get(CLASS_LABEL) or ""),
                  completions=int(spec.get("completions") or 0),
                  models=sum(per_shard) or models, per_shard=list(per_shard))
        run.update(job, None)
        return run

    def _count(self, indexes: Sequence[int]) -> int:
        if self.per_shard:
            return sum(self.per_shard[i] for i in indexes if 0 <= i < len(self.per_shard))
        return round(len(indexes) * self.models / max(self.completions, 1))

    def shard_models(self, index: int) -> int | None:
        """Shard `index`'s model count, when this run knows it (its own Jobs do)."""
        return self.per_shard[index] if 0 <= index < len(self.per_shard) else None

    @property
    def models_done(self) -> int:
        if self.counted is not None:
            return self.counted.done
        return self._count(self.completed)

    @property
    def models_failed(self) -> int:
        if self.counted is not None:
            return self.counted.failed
        return self._count([i for i in self.failed if i not in self.replaced])

    @property
    def models_replaced(self) -> int:
        return self._count(list(self.replaced))

    @property
    def models_running(self) -> int:
        if self.counted is not None:
            return self.counted.running
        return round(self.ready * self.models / max(self.completions, 1))

    def update(self, job: Mapping[str, Any], now: float | None) -> None:
        status = job.get("status") or {}
        self.job = dict(job)
        done_before = len(self.completed)
        self.completed = parse_indexes(status.get("completedIndexes"))
        self.failed = parse_indexes(status.get("failedIndexes"))
        self.active = int(status.get("active") or 0)
        self.ready = int(status.get("ready") or 0)
        state, _, _ = job_condition(job)
        self.finished = state is not None
        self.state = state or ""
        if self.created_at is None:
            self.created_at = now
        if self.ready or self.completed:
            self._explained_at = now  # running: no reason to explain for a while
        # A pod ran since the last look (ready now, or a shard completed in between), or
        # Kueue holds the Job: not stuck; else stuck since the first look that saw it so.
        ran = self.ready or len(self.completed) > done_before
        if ran or self.finished or (job.get("spec") or {}).get("suspend"):
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = now

    def vanish(self) -> None:
        """The Job was deleted before it finished: its unfinished shards failed."""
        done = set(self.completed)
        self.failed = [i for i in range(self.completions) if i not in done]
        self.finished, self.state = True, "Deleted"

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "run_id": self.run_id, "class": self.class_name,
                "shards": self.completions, "models": self.models,
                "shards_done": len(self.completed),
                "shards_failed": len(self.failed) - len(self.replaced),
                "shards_replaced": len(self.replaced),
                "state": self.state or "Running"}

    def explain_pending(self, kube: KubeClient, settings: ClusterSettings,
                        now: float) -> str | None:
        """No pod of the Job ready for pending_timeout_s: say why, once per timeout.

        Returns a line when the Job is stuck for good: its pods have had no node for
        pending_timeout_s (the scheduler says Unschedulable: no node has the GPUs, disk,
        memory or toleration they ask for), none running, and Kueue not holding it; the
        line names its class, what its pods ask for and the scheduler's reason. Pods that
        wait for something else (an image, a quota) are only explained, and looked at again
        a timeout later."""
        if self.finished or self.ready:
            return None
        ns = settings.namespace
        selector = f"{JOB_NAME_LABEL}={self.name}"
        # Listed once a poll, and only while pods exist: the same list explains a wait below.
        pods = kube.list_pods(ns, selector) if self.active else None
        if pods:  # a pod that can never start (a Secret missing) ends the run now
            line = config_error(pods, namespace=ns, hf_token_secret=settings.hf_token_secret)
            if line is not None:
                kube.delete_job(ns, self.name)
                raise InfrastructureError(f"{line} (Job {self.name} deleted)")
        timeout = settings.pending_timeout_s
        since = self._explained_at if self._explained_at is not None else self.created_at
        explain = since is not None and now - since >= timeout
        stuck_for = now - self._stuck_since if self._stuck_since is not None else 0.0
        if not explain and stuck_for < timeout:
            return None
        if pods is None:
            pods = kube.list_pods(ns, selector)
        pending = [p for p in pods if (p.get("status") or {}).get("phase") == "Pending"][:1]
        events: list[dict[str, Any]] = []
        for obj in [self.name, *(p["metadata"]["name"] for p in pending)]:
            # The sweep's own Events on its Job explain nothing about why it waits.
            events += foreign(kube.list_events(ns, f"involvedObject.name={obj}"))
        reason = describe_pending(self.job, pending, events,
                                  queued_workloads(kube, settings, self.job))
        if explain and since is not None:
            self._explained_at = now
            log.warning("job=%s: no pod running for %.0fs: %s", self.name, now - since, reason)
        if stuck_for >= timeout:
            if is_unschedulable(pending, events):
                return (f"class {self.class_name} cannot be scheduled: no pod of Job "
                        f"{self.name} has found a node for {stuck_for:.0f}s "
                        f"(--pending-timeout {timeout:g}); its pods ask for "
                        f"{pod_requests(self.job)}: {reason.rstrip('. ')}")
            self._stuck_since = now  # pending for another reason: look again a timeout on
        return None


def pod_requests(job: Mapping[str, Any]) -> str:
    """What a Job's worker pods ask the scheduler for: the container's resource requests
    and the pod's node selector ("cpu 2, memory 64Gi, ephemeral-storage 400Gi, ...")."""
    pod = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or [{}]
    requests = (containers[0].get("resources") or {}).get("requests") or {}
    parts = [f"{name} {value}" for name, value in requests.items()]
    parts += [f"node {key}={value}" for key, value in (pod.get("nodeSelector") or {}).items()]
    return ", ".join(parts) or "nothing"


class ShardFailures:
    """The diagnosis of every failed index of this run's Jobs, given to its models: the
    index's last pod (exit code, reason, log tail), read once per index; each a ShardFailed
    Event on its Job (events: None sends none)."""

    def __init__(self, kube: KubeClient, store: Store, settings: ClusterSettings,
                 runs: Sequence[IndexedRun], events: JobEventRecorder | None = None) -> None:
        self._by_key: dict[str, tuple[Diagnosis, str]] = {}
        self.namespace = settings.namespace
        for run in runs:
            failed: list[tuple[int, int, Diagnosis]] = []  # (index, its models, diagnosis)
            for index in run.failed:
                if index in run.replaced:
                    continue  # its models' outcomes are the replacement Job's
                diagnosis = (_device_error(run.device_errors[index])
                             if index in run.device_errors
                             else self._diagnose(kube, settings, run, index))
                where = f"job={self.namespace}/{run.name} index={index}"
                models = self._models(store, run, index)
                for row in models:
                    self._by_key[row.key] = (diagnosis, where)
                failed.append((index, len(models), diagnosis))
            if events is not None and run.state != "Deleted":
                _shard_events(events, run, failed)

    def _diagnose(self, kube: KubeClient, settings: ClusterSettings, run: IndexedRun,
                  index: int) -> Diagnosis:
        if run.state == "Deleted":
            return Diagnosis(f"JobDeleted: Job {run.name} was deleted before shard {index} "
                             "finished", True, None, None, ())
        pods = kube.list_pods(settings.namespace,
                              f"{JOB_NAME_LABEL}={run.name},{INDEX_LABEL}={index}")
        failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
        text = ""
        if failed:
            last = max(failed, key=lambda p: str(p["metadata"].get("creationTimestamp")))
            text = kube.read_pod_log(settings.namespace, last["metadata"]["name"],
                                     tail_lines=settings.log_tail_lines)
        return diagnose_failure(run.job, pods, text, tail_lines=settings.log_tail_lines)

    @staticmethod
    def _models(store: Store, run: IndexedRun, index: int) -> tuple[ModelRow, ...]:
        url = f"{store.url.rstrip('/')}/{shard_key(run.run_id, run.class_name, index)}"
        try:
            return read_model_list(url).rows
        except Exception as e:  # the shard list itself is gone: nothing to attribute
            log.warning("cannot read shard %d of job %s (%s): its models get no diagnosis",
                        index, run.name, e)
            return ()

    def diagnosis(self, key: str) -> Diagnosis | None:
        found = self._by_key.get(key)
        return found[0] if found else None

    def where(self, key: str) -> str:
        found = self._by_key.get(key)
        return found[1] if found else f"namespace={self.namespace}"


def _shard_events(events: JobEventRecorder, run: IndexedRun,
                  failed: Sequence[tuple[int, int, Diagnosis]]) -> None:
    """ShardFailed on the Job: the first SHARD_EVENTS_PER_JOB failed indexes one Event
    each, the others one Event that counts them (a class of thousands of shards that all
    fail must not write thousands of Events)."""
    for index, models, diagnosis in failed[:SHARD_EVENTS_PER_JOB]:
        events.warning(run.job, "ShardFailed", f"shard {index} of class {run.class_name} "
                       f"({models} model(s)) failed: "
                       f"{failure_line(diagnosis.error, diagnosis.tail)}")
    rest = failed[SHARD_EVENTS_PER_JOB:]
    if rest:
        shown = ", ".join(str(index) for index, _, _ in rest[:20])
        more = f" and {len(rest) - 20} more" if len(rest) > 20 else ""
        events.warning(run.job, "ShardFailed", (
            f"{len(rest)} more shard(s) of class {run.class_name} "
            f"({sum(m for _, m, _ in rest)} model(s)) failed: indexes {shown}{more}; the "
            f"first: {failure_line(rest[0][2].error, rest[0][2].tail)}"))


def _device_error(error: str) -> Diagnosis:
    """A shard given up after broken GPUs (sharded.devicefaults): retryable, no node at
    fault for the next run."""
    return Diagnosis(error, True, EXIT_DEVICE, None, ())


def held_keys(store: Store, runs: Sequence[IndexedRun], *,
              threads: int = _READERS) -> Iterator[str]:
    """The keys of the models the shards of these (unfinished) Jobs hold that may still run:
    every index neither completed (its models have markers) nor failed (to be sharded
    again). The shard lists are read `threads` at a time (a store's GET latency is the
    cost) and handed on in order, a few at a time, so a caller can stream the keys into a
    KeySet: an earlier run's million models are never held as strings. A list that cannot
    be read is skipped, logged: its pod cannot read it either."""
    wanted: list[tuple[IndexedRun, int]] = []
    for run in runs:
        ended = set(run.completed) | set(run.failed)
        wanted += [(run, index) for index in range(run.completions) if index not in ended]

    def read(shard: tuple[IndexedRun, int]) -> list[str]:
        run, index = shard
        url = f"{store.url.rstrip('/')}/{shard_key(run.run_id, run.class_name, index)}"
        try:
            return [row.key for row in read_model_list(url).rows]
        except (ModelListError, OSError) as e:
            log.warning("cannot read shard %d of job %s (%s): its models are sharded "
                        "again", index, run.name, e)
            return []

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for start in range(0, len(wanted), 4 * threads):
            for keys in pool.map(read, wanted[start:start + 4 * threads]):
                yield from keys
