"""Indexed Jobs played through the API: the Job controller and kubelet for Jobs with
`spec.completionMode: Indexed` (backoffLimitPerIndex, FailIndex, completed/failed indexes).

Owns what the Job controller does for an Indexed Job (a pod per completion index within
parallelism, podFailurePolicy per index, completedIndexes / failedIndexes, the end
conditions) and what the kubelet reports per pod. Not the API server (kubesim.KubeSim), nor
non-indexed Jobs (kubesim.JobSimulator, whose API plumbing and pod status shapes this
reuses), nor activeDeadlineSeconds, nor Kueue beyond admitting suspended Jobs.

Pods are bound to `nodes` (names; one by default): the least loaded node that meets the
pod's required node affinity (tests.support.scheduler), spec.nodeName set as it starts; a
pod no node admits stays Pending, Unschedulable. Every read and write goes over HTTP,
bypassing the faults injected for the controller under test, which sees the objects and
watch events a cluster would send. One `tick` lists the Jobs and the live pods once, then
only writes: Pending → Running (scheduled), Running → the outcome the `worker` callback
(playing the worker) returns, new pods for the lowest pending indexes up to `parallelism`,
one status patch per Job that changed.

    indexed = IndexedJobSimulator(sim, namespace="esd")
    def worker(job, index, attempt):   # once per pod, while it runs: "succeed", an exit
        return "succeed"                # code, Exit(2, log=...), "oom", "evict", "node_lost"
    # (a worker with a `pod` keyword also gets the running pod: spec.nodeName, its env)
    with indexed.autopilot(worker):     # or indexed.tick(worker), one round at a time
        ...run the controller...
    indexed.counters("job-name").outcomes  # Counter({"succeed": 5, "exit 2": 1})
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.support.indexsets import format_indexes, parse_indexes
from tests.support.kubesim import (
    MERGE_PATCH,
    POD_FAULTS,
    JobSimulator,
    KubeSim,
    condition,
    fail_job_message,
    failure_policy_action,
    fault_conditions,
    job_finished,
    now_rfc3339,
    pod_running_status,
    pod_terminated_status,
)
from tests.support.scheduler import least_loaded

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # annotation and label
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
IGNORED_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
INDEX_ENV = "JOB_COMPLETION_INDEX"
# The apiserver's generateName suffix: 5 characters of this alphabet (no vowels, no 0/1/3).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATED_PREFIX = 58  # 63 - the 5-character suffix
_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
_CLASS_LABEL = "esd-sweep/shard-class"  # the controller's resource class of an Indexed Job
_LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"
_SUCCESS = "Reached expected number of succeeded pods"


@dataclass(frozen=True)
class Exit:
    """A pod whose worker exits with `code`; `log` becomes its log and, as
    FallbackToLogsOnError makes it, the last lines its termination message."""

    code: int
    log: str = ""
    reason: str = "Error"


# "succeed", an exit code, Exit(...), or a POD_FAULTS name: "oom", "evict", "preempt",
# "node_lost".
Outcome = str | int | Exit
Worker = Callable[..., Outcome]  # (job, index, attempt), and pod= if it takes the pod


def succeed(job: Mapping[str, Any], index: int, attempt: int) -> Outcome:
    """The default worker: every pod succeeds."""
    return "succeed"


@dataclass
class JobCounters:
    """What the simulator did to one Job (by name): pods created, pod outcomes ("succeed",
    "exit 2", "oom", "evict", …), and the most pods it had active at once."""

    pods: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    max_active: int = 0
    nodes: collections.Counter[str] = field(default_factory=collections.Counter)  # pods bound


@dataclass
class _IndexHistory:
    """One index's earlier pods, as the Job controller keeps them in pod annotations."""

    failures: int = 0  # counted against backoffLimitPerIndex
    ignored: int = 0  # failures a podFailurePolicy Ignore rule matched


def pod_index(pod: Mapping[str, Any]) -> int:
    return int(pod["metadata"]["annotations"][COMPLETION_INDEX])


# -- the simulator ---------------------------------------------------------------------------


class IndexedJobSimulator:
    """The Job controller and kubelet for the Indexed Jobs of one namespace (see the module
    docstring). `tick` is one round over every Job; `autopilot` runs ticks on a thread."""

    def __init__(self, sim: KubeSim, namespace: str = "esd", node: str = "gpu-node-0",
                 nodes: Sequence[str] = ()) -> None:
        self.sim = sim
        self.namespace = namespace
        self.node = node
        self.nodes = list(nodes) or [node]
        self._load: collections.Counter[str | None] = collections.Counter()  # pods by node
        self.api = JobSimulator(sim, namespace=namespace, node=node)  # plumbing, bypassing faults
        self.calls: collections.Counter[str] = collections.Counter()  # "list pods", …
        self.ticks = 0
        self._counters: dict[str, JobCounters] = {}
        self._history: dict[str, dict[int, _IndexHistory]] = {}  # by Job uid
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._rng = random.Random()
        # The scheduler's message for the pods of these Jobs (by class label or Job name):
        # they stay Pending, PodScheduled False/Unschedulable, with a FailedScheduling event.
        self.unschedulable: dict[str, str] = {}

    def jobs(self) -> list[dict[str, Any]]:
        """The namespace's Indexed Jobs, as stored."""
        return [j for j in self.api.jobs() if _indexed(j)]

    def counters(self, job_name: str) -> JobCounters:
        return self._counters.setdefault(job_name, JobCounters())

    def admit(self, name: str) -> dict[str, Any]:
        """Kueue admits a suspended Job (spec.suspend → false)."""
        return self.api.admit(name)

    # -- one round --

    def tick(self, worker: Worker = succeed, *, admit: bool = True) -> None:
        """One round of the Job controller and kubelet over every unfinished Indexed Job."""
        with self._lock:
            self.ticks += 1
            self.calls["list jobs"] += 1
            jobs = [j for j in self.api.jobs() if _indexed(j) and not job_finished(j)]
            if not jobs:
                return
            self.calls["list pods"] += 1
            doc = self.api._doc(self.api._core.list_namespaced_pod(
                self.namespace, label_selector=COMPLETION_INDEX, field_selector=_LIVE_PODS,
                _preload_content=False))
            live: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            self._load = collections.Counter(p["spec"].get("nodeName") for p in doc["items"]
                                             if p["status"].get("phase") == "Running")
            for pod in doc["items"]:  # the label the apiserver put on the Job's template
                live[pod["metadata"]["labels"].get(_CONTROLLER_UID, "")].append(pod)
            for job in jobs:
                if job["spec"].get("suspend"):
                    if admit:
                        self._write("patch jobs", self.api.admit, job["metadata"]["name"])
                    continue
                self._sync(job, live.get(job["metadata"]["uid"], []), worker)

    def run_until_finished(self, worker: Worker = succeed, *, max_ticks: int = 1000,
                           admit: bool = True) -> None:
        """tick() until every Indexed Job is Complete or Failed."""
        for _ in range(max_ticks):
            if all(job_finished(j) for j in self.jobs()):
                return
            self.tick(worker, admit=admit)
        raise AssertionError(f"Indexed Jobs still running after {max_ticks} ticks")

    def _sync(self, job: dict[str, Any], pods: list[dict[str, Any]], worker: Worker) -> None:
        """One Job: advance its live pods, apply podFailurePolicy per index, then either end
        the Job or start the lowest pending indexes, and write its status if it changed."""
        spec, status = job["spec"], dict(job.get("status") or {})
        name = job["metadata"]["name"]
        history = self._adopt(job)
        per_index = spec.get("backoffLimitPerIndex") is not None
        succeeded = parse_indexes(status.get("completedIndexes"))
        failed_indexes = parse_indexes(status.get("failedIndexes"))
        failed = int(status.get("failed") or 0)
        end: tuple[str, str] | None = None  # (reason, message) of a Failed Job
        active: list[dict[str, Any]] = []
        for pod in sorted(pods, key=pod_index):
            index = pod_index(pod)
            if index in succeeded or index in failed_indexes or end is not None:
                active.append(pod)  # a leftover; deleted below when the Job ends
                continue
            if pod["status"].get("phase") == "Pending":
                running = self._unschedulable(job, pod) or self._run(pod)
                if running is not None:
                    active.append(running)
                continue
            ix = history.setdefault(index, _IndexHistory())
            attempt = ix.failures + ix.ignored
            self._load[pod["spec"].get("nodeName")] -= 1
            ended = self._end(pod, worker(job, index, attempt, pod=pod) if _takes_pod(worker)
                              else worker(job, index, attempt), name)
            if ended is None:
                continue  # deleted meanwhile: the index is pending again
            pod = ended
            if pod["status"]["phase"] == "Succeeded":
                succeeded.add(index)
                continue
            action, rule = failure_policy_action(job, pod)
            if action == "Ignore":
                ix.ignored += 1
                continue
            failed += 1
            if action == "FailJob":
                end = ("PodFailurePolicy", fail_job_message(job, pod, int(rule or 0)))
            elif action == "FailIndex" and per_index:
                failed_indexes.add(index)
            else:
                ix.failures += 1
                if per_index and ix.failures > int(spec["backoffLimitPerIndex"]):
                    failed_indexes.add(index)
        completions = int(spec["completions"])
        limit = spec.get("backoffLimit", 2**31 - 1 if per_index else 6)
        max_failed = spec.get("maxFailedIndexes")
        if end is None and failed > int(limit):
            end = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        elif end is None and max_failed is not None and len(failed_indexes) > int(max_failed):
            end = ("MaxFailedIndexesExceeded",
                   "Job has exceeded the specified maximal number of failed indexes")
        elif end is None and failed_indexes and \
                len(failed_indexes) + len(succeeded) >= completions:
            end = ("FailedIndexes", "Job has failed indexes")
        new: dict[str, Any] = {"succeeded": len(succeeded), "failed": failed}
        if succeeded:  # omitted while empty, as the apiserver serialises it
            new["completedIndexes"] = format_indexes(succeeded)
        if per_index:
            new["failedIndexes"] = format_indexes(failed_indexes)
        conditions = list(status.get("conditions") or [])
        if end is not None:
            for pod in active:  # the Job controller deletes what still runs
                self._write("delete pods", self.api._core.delete_namespaced_pod,
                            pod["metadata"]["name"], self.namespace)
            active = []
            reason, message = end
            new["conditions"] = [*conditions, condition("FailureTarget", reason, message),
                                 condition("Failed", reason, message)]
        elif len(succeeded) >= completions:
            new["completionTime"] = now_rfc3339()
            new["conditions"] = [
                *conditions, condition("SuccessCriteriaMet", "CompletionsReached", _SUCCESS),
                condition("Complete", "CompletionsReached", _SUCCESS)]
        else:
            # the lowest pending indexes first (the Job controller's firstPendingIndexes)
            busy = succeeded | failed_indexes | {pod_index(p) for p in active}
            room = max(0, int(spec.get("parallelism", 1)) - len(active))
            pending = (i for i in range(completions) if i not in busy)
            for index in itertools.islice(pending, room):
                active.append(self._create_pod(job, index, history.setdefault(
                    index, _IndexHistory())))
        counters = self.counters(name)
        counters.max_active = max(counters.max_active, len(active))
        new["active"] = len(active)
        new["ready"] = sum(p["status"].get("phase") == "Running" for p in active)
        if active and not status.get("startTime"):
            new["startTime"] = now_rfc3339()
        changed = {k: v for k, v in new.items() if status.get(k) != v}
        if changed:
            self._write("patch jobs/status", self.api._patch_job, name, changed)

    # -- the Job controller's and the kubelet's writes --

    def _adopt(self, job: Mapping[str, Any]) -> dict[int, _IndexHistory]:
        """Per-index history of a Job, rebuilt from its finished pods the first time this
        simulator sees it (a simulator started over a Job that already ran carries on)."""
        uid = str(job["metadata"]["uid"])
        if uid not in self._history:
            history: dict[int, _IndexHistory] = {}
            self.calls["list pods"] += 1
            doc = self.api._doc(self.api._core.list_namespaced_pod(
                self.namespace, label_selector=f"{_CONTROLLER_UID}={uid}",
                _preload_content=False))
            for pod in doc["items"]:
                if pod["status"].get("phase") != "Failed":
                    continue
                ix = history.setdefault(pod_index(pod), _IndexHistory())
                if failure_policy_action(job, pod)[0] == "Ignore":
                    ix.ignored += 1
                else:
                    ix.failures += 1
            self._history[uid] = history
        return self._history[uid]

    def _create_pod(self, job: Mapping[str, Any], index: int,
                    history: _IndexHistory) -> dict[str, Any]:
        """A pod for one index, as the Job controller makes it from the template."""
        name = job["metadata"]["name"]
        template = copy.deepcopy(job["spec"]["template"])
        labels = {**(template["metadata"].get("labels") or {}), COMPLETION_INDEX: str(index)}
        annotations = {**(template["metadata"].get("annotations") or {}),
                       COMPLETION_INDEX: str(index)}
        if job["spec"].get("backoffLimitPerIndex") is not None:
            annotations[FAILURE_COUNT] = str(history.failures)
            if history.ignored:
                annotations[IGNORED_COUNT] = str(history.ignored)
        spec = template["spec"]
        spec["hostname"] = f"{name}-{index}"
        if len(spec["hostname"]) > 63:
            raise ValueError(f"hostname {spec['hostname']!r} is longer than 63 characters: "
                             "the apiserver would refuse every pod of this Job")
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            env = container.setdefault("env", [])
            if not any(v.get("name") == INDEX_ENV for v in env):
                env.append({"name": INDEX_ENV, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.labels['{COMPLETION_INDEX}']"}}})
        prefix = f"{name}-{index}-"
        if len(prefix) > _MAX_GENERATED_PREFIX:
            prefix = name[:_MAX_GENERATED_PREFIX - len(f"-{index}-")] + f"-{index}-"
        suffix = "".join(self._rng.choice(_NAME_ALPHABET) for _ in range(5))
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": prefix + suffix, "generateName": prefix, "namespace": self.namespace,
                "labels": labels, "annotations": annotations,
                "ownerReferences": [{
                    "apiVersion": "batch/v1", "kind": "Job", "name": name,
                    "uid": job["metadata"]["uid"], "controller": True,
                    "blockOwnerDeletion": True}],
            },
            "spec": spec,
        }
        pod: dict[str, Any] = self._write("create pods", lambda: self.api._doc(
            self.api._core.create_namespaced_pod(self.namespace, body, _preload_content=False)))
        self.counters(name).pods += 1
        return pod

    def _unschedulable(self, job: Mapping[str, Any],
                       pod: Mapping[str, Any]) -> dict[str, Any] | None:
        """The pod, left Pending, when its Job's class (or name) is in `unschedulable`: the
        scheduler's condition and FailedScheduling event are written once, as the
        scheduler reports a pod it cannot place (kubesim.JobSimulator.start does the same
        for plain Jobs); None for a pod the scheduler may place."""
        meta = job["metadata"]
        message = self.unschedulable.get(meta["name"]) or self.unschedulable.get(
            (meta.get("labels") or {}).get(_CLASS_LABEL, ""))
        if message is None:
            return None
        return self._leave_pending(pod, message)

    def _leave_pending(self, pod: Mapping[str, Any], message: str) -> dict[str, Any] | None:
        """The scheduler's PodScheduled False condition and FailedScheduling event, once."""
        if any(c.get("type") == "PodScheduled" for c in pod["status"].get("conditions") or []):
            return dict(pod)
        self.api._event(pod, "FailedScheduling", message, component="default-scheduler")
        doc: dict[str, Any] | None = self._write(
            "patch pods/status", self.api._patch_pod, pod["metadata"]["name"],
            {"phase": "Pending", "conditions": [
                condition("PodScheduled", "Unschedulable", message, status="False")]})
        return doc

    def _run(self, pod: Mapping[str, Any]) -> dict[str, Any] | None:
        """The scheduler binds the pod to a node and its container starts (one write); a pod
        no node admits stays Pending with PodScheduled False (written once)."""
        node = least_loaded(pod["spec"], self.nodes, self._load)
        if node is None:
            return self._leave_pending(pod, f"0/{len(self.nodes)} nodes are available: "
                                       f"{len(self.nodes)} node(s) didn't match Pod's node "
                                       "affinity/selector.")
        self._load[node] += 1
        self.counters(pod["metadata"]["ownerReferences"][0]["name"]).nodes[node] += 1
        patch = {"spec": {"nodeName": node}, "status": pod_running_status(pod)}
        doc: dict[str, Any] | None = self._write("patch pods", lambda: self.api._doc(
            self.api._core.patch_namespaced_pod(
                pod["metadata"]["name"], self.namespace, patch, _preload_content=False,
                _content_type=MERGE_PATCH)))
        return doc

    def _end(self, pod: Mapping[str, Any], outcome: Outcome,
             job_name: str) -> dict[str, Any] | None:
        """The pod ends as `outcome` says; its log (and termination message) is set first, as
        the controller may read it as soon as it sees the pod fail."""
        pod_name = pod["metadata"]["name"]
        if outcome == "succeed" or (isinstance(outcome, int) and not isinstance(outcome, bool)):
            code = 0 if outcome == "succeed" else int(outcome)
            outcome = Exit(code, f"worker exited with {code}\n" if code else "done\n")
        if isinstance(outcome, Exit):
            code, reason, log, conditions = outcome.code, outcome.reason, outcome.log, []
            label = f"exit {code}" if code else "succeed"
        elif outcome in POD_FAULTS:
            code, reason, _ = POD_FAULTS[outcome]
            log, label, conditions = "", outcome, fault_conditions(outcome)
        else:
            raise ValueError(f"unknown pod outcome {outcome!r}")
        reason = reason if code else "Completed"
        self.counters(job_name).outcomes[label] += 1
        if log:
            self.sim.set_log(self.namespace, pod_name, log)
        message = "" if code == 0 else "".join(log.splitlines(keepends=True)[-80:])
        status = pod_terminated_status(
            pod, exit_code=code, reason=reason, message=message, conditions=conditions,
            phase="Succeeded" if code == 0 else "Failed")
        doc: dict[str, Any] | None = self._write("patch pods/status", self.api._patch_pod,
                                                 pod_name, status)
        return doc

    def _write(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One write; None for a 404 (the controller deleted the Job or pod meanwhile): the
        Job controller drops work for objects that are gone."""
        self.calls[what] += 1
        try:
            return fn(*args)
        except ApiException as e:
            if e.status != 404:
                raise
            return None

    # -- on its own --

    def start_autopilot(self, worker: Worker = succeed, *, interval_s: float = 0.005,
                        admit: bool = True) -> None:
        """tick(worker) on a background thread every interval_s until stop_autopilot()."""
        if self._thread is not None:
            raise RuntimeError("the autopilot is already running")
        stop = threading.Event()
        self._stop, self._error = stop, None

        def loop() -> None:
            try:
                while not stop.is_set():
                    self.tick(worker, admit=admit)
                    stop.wait(interval_s)
            except BaseException as e:  # surfaced by stop_autopilot / wait_finished
                self._error = e

        self._thread = threading.Thread(target=loop, name="indexed-autopilot", daemon=True)
        self._thread.start()

    def stop_autopilot(self) -> None:
        """Stop after the tick in progress (a controller restart test pauses the cluster);
        raises what the thread raised."""
        if self._thread is None or self._stop is None:
            return
        self._stop.set()
        self._thread.join(30)
        self._thread = self._stop = None
        if self._error is not None:
            raise RuntimeError("indexed autopilot failed") from self._error

    @contextlib.contextmanager
    def autopilot(self, worker: Worker = succeed, *, interval_s: float = 0.005,
                  admit: bool = True) -> Iterator[IndexedJobSimulator]:
        """Drive every Indexed Job of the namespace while the block runs; errors in the
        thread fail the block."""
        self.start_autopilot(worker, interval_s=interval_s, admit=admit)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(RuntimeError):
                self.stop_autopilot()
            raise
        self.stop_autopilot()

    def wait_finished(self, names: Iterable[str], timeout_s: float = 30.0) -> dict[str, str]:
        """Wait until each named Job is Complete or Failed; {name: "Complete"|"Failed"}.
        Raises the autopilot's error at once if its thread died."""
        wanted = set(names)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._error is not None:
                raise RuntimeError("indexed autopilot failed") from self._error
            ends = {j["metadata"]["name"]: job_finished(j) for j in self.jobs()}
            done = {n: str(ends[n]) for n in wanted if ends.get(n)}
            if len(done) == len(wanted):
                return done
            if time.monotonic() > deadline:
                raise AssertionError(f"Jobs not finished in {timeout_s} s: {wanted - set(done)}")
            time.sleep(0.01)


def _indexed(job: Mapping[str, Any]) -> bool:
    return (job.get("spec") or {}).get("completionMode") == "Indexed"


def _takes_pod(worker: Worker) -> bool:
    return "pod" in inspect.signature(worker).parameters
