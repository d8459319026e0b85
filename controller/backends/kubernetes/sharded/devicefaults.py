"""Broken GPUs in a sharded run: the nodes they are on, and replacement Jobs that avoid them.

Owns finding the indexes whose pod exited 6 (EXIT_DEVICE: the worker found its device
broken and recorded nothing; the Indexed Job failed the index at once, FailIndex), the
run's bad nodes (BAD_NODE_FAULTS such pods on a node), the replacement Indexed Jobs that run
those shards again (their lists copied to a class `<class>-r<n>` of this run; every Job
created after a node turned bad keeps its pods off it by a required node affinity), batched
per class, and the bound on the chain (a shard that met broken devices on more than
max_faults nodes gets a retryable DeviceError for its models); a GPUBroken Event on the Job
whose pod found a node bad (common.jobevents). Reads the failed pods' status
only, never a log. Does not build or create Jobs (.indexed; the backend's create callback)
nor read per-model outcomes (.status, the store).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.diagnosis import pod_sort_key, worker_terminated
from controller.backends.kubernetes.common.jobevents import JobEventRecorder
from controller.backends.kubernetes.common.names import JOB_NAME_LABEL
from controller.backends.kubernetes.sharded.sharding import ClassShards
from controller.backends.kubernetes.sharded.status import INDEX_LABEL, IndexedRun
from esd_worker.core.errors import EXIT_DEVICE
from esd_worker.core.store.layout import shard_key
from esd_worker.core.store.stores import Store

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)

# A node is bad from its first device-fault pod: the worker exits 6 only after its device
# self-check or a CUDA/NVML error that poisons the context, never for a model's fault, and
# every pod sent there again would fail the same way.
BAD_NODE_FAULTS = 1
# Replacements are batched: one Job per class at most this often while Jobs of the class
# still run (at once when none does), not one per failed index.
REPLACE_EVERY_S = 60.0
_SELECTOR_INDEXES = 100  # indexes per pod listing (`index in (…)` keeps the selector short)

Create = Callable[[ClassShards, int], IndexedRun]  # (a class's shards, the run's pods at once)


@dataclass
class BadNode:
    """A node where pods found their GPU broken: how many, and the last one's error line."""

    node: str
    device_faults: int = 0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "device_faults": self.device_faults, "error": self.error}


@dataclass(frozen=True)
class _Waiting:
    """A shard waiting for its replacement: the index of `run` that broke, and every node
    where this shard's pods met a broken device so far (oldest first)."""

    run: IndexedRun
    index: int
    nodes: tuple[str, ...]


class DeviceFaults:
    """The device faults of one sharded run (see the module docstring).

    run_id: this run's (only its own Jobs are replaced; the Jobs of an earlier run it
    re-attached to only teach which nodes are bad).
    max_faults: device faults a shard may meet, each on another node, before its models get
    a DeviceError (the worker's --max-retries + 1). every_s: REPLACE_EVERY_S.
    """

    def __init__(self, namespace: str, store: Store, *, run_id: str, max_faults: int,
                 threshold: int = BAD_NODE_FAULTS, every_s: float = REPLACE_EVERY_S) -> None:
        self.namespace = namespace
        self.store = store
        self.run_id = run_id
        self.max_faults = max_faults
        self.threshold = threshold
        self.every_s = every_s
        self.nodes: dict[str, BadNode] = {}
        self._read: dict[str, set[int]] = {}  # failed indexes looked at, by Job name
        self._origin: dict[str, str] = {}  # class name → the class its shards came from
        self._shards: dict[str, tuple[ClassShards, int]] = {}  # origin → (shards, pods)
        self._lineage: dict[tuple[str, int], tuple[str, ...]] = {}  # (Job, index) → nodes
        self._waiting: dict[str, list[_Waiting]] = {}  # by origin class
        self._since: dict[str, float] = {}  # origin → last replacement (or first fault)
        self._replacements: Counter[str] = Counter()
        self.events: JobEventRecorder | None = None  # the run's (set by the backend's run)

    def track(self, run: IndexedRun, shards: ClassShards, pods: int) -> IndexedRun:
        """A Job this run created, for `shards` (pods: the run's pods at once); returned."""
        origin = self._origin.setdefault(run.class_name, run.class_name)
        self._shards.setdefault(origin, (shards, pods))
        return run

    def avoided(self) -> list[str]:
        """The bad nodes, which every Job created from now on keeps its pods off."""
        return sorted(n.node for n in self.nodes.values() if n.device_faults >= self.threshold)

    def report(self) -> list[dict[str, Any]]:
        return [self.nodes[n].as_dict() for n in sorted(self.nodes)]

    def follow(self, kube: KubeClient, runs: Sequence[IndexedRun], now: float,
               create: Create) -> list[IndexedRun]:
        """Look at the indexes that failed since the last call (one pod listing per Job
        that has some), then create the replacements that are due; the new Jobs."""
        for run in runs:
            seen = self._read.setdefault(run.name, set())
            new = [i for i in run.failed if i not in seen]
            seen.update(new)
            if new and run.state != "Deleted":
                self._look(kube, run, new, now)
        due = [origin for origin, waiting in self._waiting.items() if waiting and (
            now - self._since[origin] >= self.every_s
            or not any(not r.finished and self._origin.get(r.class_name) == origin
                       for r in runs))]
        made = (self._replace(origin, now, create, busy=sum(
            r.active for r in runs if not r.finished and self._origin.get(r.class_name) == origin))
            for origin in due)
        return [run for run in made if run is not None]

    # -- reading the failed pods --

    def _look(self, kube: KubeClient, run: IndexedRun, indexes: Sequence[int],
              now: float) -> None:
        last: dict[int, Mapping[str, Any]] = {}
        for chunk in _chunks(indexes, _SELECTOR_INDEXES):
            selector = f"{JOB_NAME_LABEL}={run.name},{INDEX_LABEL} in ({','.join(map(str, chunk))})"
            for pod in kube.list_pods(self.namespace, selector):
                if (pod.get("status") or {}).get("phase") != "Failed":
                    continue
                index = _index_of(pod)
                if index is not None and (index not in last
                                          or pod_sort_key(pod) > pod_sort_key(last[index])):
                    last[index] = pod
        for index in indexes:
            found = last.get(index)
            terminated = worker_terminated(found) if found is not None else None
            if found is None or terminated is None or terminated.get("exitCode") != EXIT_DEVICE:
                continue  # another failure: .status diagnoses it
            node = str((found.get("spec") or {}).get("nodeName") or "")
            self._fault(run, index, node, _last_line(terminated), now)

    def _fault(self, run: IndexedRun, index: int, node: str, error: str, now: float) -> None:
        log.info("job=%s index=%d node=%s: the GPU is broken (exit %d), no model charged: %s",
                 run.name, index, node or "?", EXIT_DEVICE, error)
        if node:
            bad = self.nodes.setdefault(node, BadNode(node))
            bad.device_faults += 1
            bad.error = error
            if bad.device_faults == self.threshold:
                log.warning(
                    "node %s: GPU broken (exit %d): its indexes run elsewhere; quarantine it: "
                    "kubectl cordon %s, then check its GPU (kubectl describe node %s, "
                    "nvidia-smi, the GPU operator's validator pods): %s",
                    node, EXIT_DEVICE, node, node, error)
                if self.events is not None:
                    self.events.warning(run.job, "GPUBroken", (
                        f"node {node}: GPU broken (exit {EXIT_DEVICE}) under shard {index}, "
                        f"no model charged; its shards run again on other nodes; quarantine "
                        f"it: kubectl cordon {node}: {error}"))
        if run.run_id != self.run_id:
            # An earlier run's Job, re-attached: its class is not this run's to rebuild; the
            # shard's models end with the pod's DeviceError (retryable, no record written)
            # and the next run tries them, off the nodes known bad by then.
            return
        nodes = (*self._lineage.get((run.name, index), ()), node or "?")
        if len(nodes) > self.max_faults:
            run.device_errors[index] = (
                f"DeviceError: shard {index} of job {run.name} met a broken GPU on "
                f"{len(nodes)} nodes ({', '.join(dict.fromkeys(nodes))}): nothing was "
                "recorded against its models, which the next run tries again; check or "
                "cordon those nodes")
            log.warning("job=%s index=%d: %s", run.name, index, run.device_errors[index])
            return
        origin = self._origin.setdefault(run.class_name, run.class_name)
        self._since.setdefault(origin, now)
        self._waiting.setdefault(origin, []).append(_Waiting(run, index, nodes))

    # -- the replacement --

    def _replace(self, origin: str, now: float, create: Create, *,
                 busy: int) -> IndexedRun | None:
        """One Job for every shard of `origin` waiting: its lists copied to the next class
        `<origin>-r<n>` (index j of the new Job is the j-th waiting shard). busy: pods the
        class's Jobs still have; the new Job's parallelism is what they leave of the class's
        GPU budget (at least 1: a Job cannot have none)."""
        self._since[origin] = now
        self._replacements[origin] += 1
        name = f"{origin}-r{self._replacements[origin]}"
        waiting: list[_Waiting] = []
        per_shard: list[int] = []
        for w in self._waiting.pop(origin):
            count = self._copy(w, name, len(waiting))
            if count is not None:
                waiting.append(w)
                per_shard.append(count)
        if not waiting:
            return None
        first, pods = self._shards[origin]
        each = first.bytes // max(first.shards, 1)
        shards = ClassShards(cls=replace(first.cls, name=name),
                             parallelism=max(1, min(first.parallelism - busy, len(waiting))),
                             models=sum(per_shard), bytes=each * len(waiting),
                             per_shard=per_shard, largest=first.largest)
        self._origin[name] = origin
        run = create(shards, pods)
        for j, w in enumerate(waiting):
            self._lineage[(run.name, j)] = w.nodes
            w.run.replaced[w.index] = run.name
        log.warning("job=%s: %d shard(s) of class %s whose GPU broke run again, on any node "
                    "but %s", run.name, len(waiting), origin, ", ".join(self.avoided()) or "-")
        return run

    def _copy(self, waiting: _Waiting, class_name: str, index: int) -> int | None:
        """Shard `waiting` as shard `index` of class_name; its model count (None: its list
        is gone, removed by hand: its models get a DeviceError, tried by the next run)."""
        run = waiting.run
        data = self.store.get_bytes(shard_key(run.run_id, run.class_name, waiting.index))
        if data is None:
            run.device_errors[waiting.index] = (
                f"DeviceError: shard {waiting.index} of job {run.name} met a broken GPU on "
                f"{', '.join(waiting.nodes)} and its shard list is gone: the next run tries "
                "its models again")
            return None
        self.store.put_bytes(shard_key(self.run_id, class_name, index), data)
        if 0 <= waiting.index < len(run.per_shard):
            return run.per_shard[waiting.index]
        return max(data.count(b"\n") - 1, 0)


def _chunks(items: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _index_of(pod: Mapping[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    text = (meta.get("labels") or {}).get(INDEX_LABEL) or (
        meta.get("annotations") or {}).get(INDEX_LABEL)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _last_line(terminated: Mapping[str, Any]) -> str:
    """The termination message's last line (FallbackToLogsOnError: the log's tail)."""
    lines = [line.strip() for line in str(terminated.get("message") or "").splitlines()]
    lines = [line for line in lines if line]
    return lines[-1][:500] if lines else f"the worker exited {EXIT_DEVICE}"
