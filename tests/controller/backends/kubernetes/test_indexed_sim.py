"""The Indexed Job simulator as the real `kubernetes` client sees it: a pod per completion
index within parallelism, backoffLimitPerIndex and podFailurePolicy per index, the
completed/failed index strings, the end conditions, Kueue admission, stopping and
restarting; and the emulator's /version and its feature-gate-off apiserver.

The expected values follow Kubernetes' Job controller (pkg/controller/job, 1.31): Ignore
rules count nothing, FailIndex fails the index at once, a counted failure past
backoffLimitPerIndex fails the index, and a Job with failed indexes is Failed
(FailedIndexes) only once every index has finished.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from controller.backends.kubernetes.common.client import KubeClient
from tests.support.cluster import NS, RETRY, assert_stored_objects_valid
from tests.support.indexed import (
    COMPLETION_INDEX,
    FAILURE_COUNT,
    IGNORED_COUNT,
    Exit,
    IndexedJobSimulator,
    Outcome,
    Worker,
    pod_index,
)
from tests.support.indexsets import format_indexes, parse_indexes
from tests.support.kubesim import KubeSim, job_finished
from tests.support.podenv import resolve_env

JOB = "esd-shards-gpu"
SELECTOR = "esd-sweep/class=gpu"


def make_indexed_job(
    name: str = JOB, *, completions: int = 5, parallelism: int = 2,
    per_index: int | None = 1, max_failed: int | None = None, suspend: bool = False,
    fail_job_codes: Sequence[int] = (), backoff_limit: int | None = None,
) -> dict[str, Any]:
    """A small valid Indexed Job: DisruptionTarget → Ignore, exit 2/3 → FailIndex (only
    with backoffLimitPerIndex, as validation demands), fail_job_codes → FailJob."""
    rules: list[dict[str, Any]] = [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                  "status": "True"}]}]
    if per_index is not None:
        rules.append({"action": "FailIndex", "onExitCodes": {
            "containerName": "worker", "operator": "In", "values": [2, 3]}})
    if fail_job_codes:
        rules.append({"action": "FailJob", "onExitCodes": {
            "containerName": "worker", "operator": "In", "values": list(fail_job_codes)}})
    spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": completions, "parallelism": parallelism,
        "suspend": suspend, "podFailurePolicy": {"rules": rules},
        "template": {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "worker", "image": "ghcr.io/example/esd-sweep:0.1.0",
            "args": ["--shards", "s3://esd-results/atlas/_shards/r1/gpu",
                     "--output", "s3://esd-results/atlas"]}]}},
    }
    if per_index is not None:
        spec["backoffLimitPerIndex"] = per_index
    if max_failed is not None:
        spec["maxFailedIndexes"] = max_failed
    if backoff_limit is not None:
        spec["backoffLimit"] = backoff_limit
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": NS, "labels": {"esd-sweep/class": "gpu"}},
            "spec": spec}


def by_index(scripts: Mapping[int, Sequence[Outcome]]) -> Worker:
    """A worker whose pod for (index, attempt) ends as scripts[index][attempt] (past the
    script, or for an index without one: succeed)."""
    def worker(job: dict[str, Any], index: int, attempt: int) -> Outcome:
        script = scripts.get(index, ())
        return script[attempt] if attempt < len(script) else "succeed"
    return worker


def ends(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(c["type"], c["reason"]) for c in job["status"].get("conditions") or []]


def created(kube: KubeClient, job: dict[str, Any]) -> str:
    """Create the Job; its resourceVersion (watch from it to see everything after)."""
    assert kube.create_job(NS, job) == "created"
    stored = kube.read_job(NS, job["metadata"]["name"])
    assert stored is not None
    return str(stored["metadata"]["resourceVersion"])


def pod_events(sim: KubeSim, since: str) -> list[tuple[str, dict[str, Any]]]:
    """Every pod watch event after `since`, replayed from the emulator's event window."""
    core = k8s.CoreV1Api(sim.api_client())
    stream = k8s_watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=since,
                                      timeout_seconds=1)
    return [(e["type"], e["raw_object"]) for e in stream]


@pytest.fixture
def indexed(sim: KubeSim) -> IndexedJobSimulator:
    return IndexedJobSimulator(sim, namespace=NS)


# -- the index string format ------------------------------------------------------------------


@pytest.mark.parametrize(("indexes", "text"), [
    ([], ""), ([5], "5"), ([3, 4], "3,4"), ([0, 1, 2, 3, 4], "0-4"),
    ([7, 1, 5, 4, 3], "1,3-5,7"), ([0, 2, 3, 9, 10, 11, 12], "0,2,3,9-12"),
], ids=["none", "one", "pair", "run", "docs-example", "mixed"])
def test_index_strings(indexes: list[int], text: str) -> None:
    """JobStatus.completedIndexes' documented format: "1,3-5,7" for 1,3,4,5,7; only runs of
    three or more are compressed (the controller writes 3,4 as two numbers)."""
    assert format_indexes(indexes) == text
    assert parse_indexes(text) == set(indexes)


# -- a Job that succeeds ------------------------------------------------------------------------


def test_every_index_succeeds_within_parallelism(
        sim: KubeSim, kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """5 completions, parallelism 2: the lowest pending indexes start first, never more than
    2 pods live at once (replayed from the pod watch), one pod per index, then Complete
    with SuccessCriteriaMet first and completedIndexes "0-4"."""
    seen: list[tuple[int, int]] = []

    def worker(job: dict[str, Any], index: int, attempt: int) -> Outcome:
        seen.append((index, attempt))
        return "succeed"

    since = created(kube, make_indexed_job())
    with indexed.autopilot(worker):
        assert indexed.wait_finished([JOB]) == {JOB: "Complete"}
    job = kube.read_job(NS, JOB)
    assert job is not None
    assert ends(job) == [("SuccessCriteriaMet", "CompletionsReached"),
                         ("Complete", "CompletionsReached")]
    status = job["status"]
    assert (status["completedIndexes"], status["succeeded"], status["failed"],
            status["active"]) == ("0-4", 5, 0, 0)
    assert sorted(seen) == [(i, 0) for i in range(5)]

    live: set[str] = set()
    most, started = 0, []
    for kind, pod in pod_events(sim, since):
        name = pod["metadata"]["name"]
        if kind == "ADDED":
            started.append(pod_index(pod))
        if kind != "DELETED" and pod["status"].get("phase") in ("Pending", "Running"):
            live.add(name)
        else:
            live.discard(name)
        most = max(most, len(live))
    assert most == 2
    assert started[:2] == [0, 1] and sorted(started) == [0, 1, 2, 3, 4]
    assert indexed.counters(JOB).max_active == 2

    pods = kube.list_pods(NS, f"batch.kubernetes.io/job-name={JOB}")
    for pod in pods:
        i = pod_index(pod)
        assert re.fullmatch(rf"{JOB}-{i}-[bcdfghjklmnpqrstvwxz2456789]{{5}}",
                            pod["metadata"]["name"])
        assert pod["metadata"]["labels"][COMPLETION_INDEX] == str(i)
        assert pod["metadata"]["annotations"][FAILURE_COUNT] == "0"
        assert pod["spec"]["hostname"] == f"{JOB}-{i}"
        assert resolve_env(pod, "worker")["JOB_COMPLETION_INDEX"] == str(i)
        assert pod["status"]["phase"] == "Succeeded" and pod["spec"]["nodeName"]
    assert_stored_objects_valid(sim)


# -- failures, per index -------------------------------------------------------------------------

OUTCOMES = [
    # job options, scripts by index, end, reason, completedIndexes, failedIndexes (None:
    # not tracked), status.failed, pods per index
    ({}, {1: [2]}, "Failed", "FailedIndexes", "0,2-4", "1", 1, [1, 1, 1, 1, 1]),
    ({}, {4: [Exit(3, log="PermanentModelError: gated\n")]}, "Failed", "FailedIndexes",
     "0-3", "4", 1, [1, 1, 1, 1, 1]),
    ({}, {0: [4, 4], 2: [4]}, "Failed", "FailedIndexes", "1-4", "0", 3, [2, 1, 2, 1, 1]),
    ({}, {3: ["oom"]}, "Complete", "CompletionsReached", "0-4", "", 1, [1, 1, 1, 2, 1]),
    ({}, {0: ["evict", "preempt"], 4: ["node_lost"]}, "Complete", "CompletionsReached",
     "0-4", "", 0, [3, 1, 1, 1, 2]),
    ({"max_failed": 0}, {0: [3]}, "Failed", "MaxFailedIndexesExceeded", "1", "0", 1,
     [1, 1, 0, 0, 0]),
    ({"fail_job_codes": [5]}, {2: [5]}, "Failed", "PodFailurePolicy", "0,1", "", 1,
     [1, 1, 1, 0, 0]),
    ({"per_index": None, "backoff_limit": 1}, {0: [4, 4]}, "Failed", "BackoffLimitExceeded",
     "1,2", None, 2, [2, 1, 1, 0, 0]),
]


@pytest.mark.parametrize(
    ("options", "scripts", "end", "reason", "completed", "failed_indexes", "failed", "pods"),
    OUTCOMES, ids=["exit2-fails-index", "exit3-fails-index", "second-count-fails-index",
                   "oom-counted", "disruptions-ignored", "max-failed-indexes", "fail-job",
                   "no-per-index-backoff-limit"])
def test_failures_per_index(
        sim: KubeSim, kube: KubeClient, indexed: IndexedJobSimulator,
        options: dict[str, Any], scripts: dict[int, list[Outcome]], end: str, reason: str,
        completed: str, failed_indexes: str | None, failed: int, pods: list[int]) -> None:
    """podFailurePolicy per index (5 completions, parallelism 2, backoffLimitPerIndex 1):
    exit 2/3 fail the index at once; exit 4 and OOM count, the 2nd counted failure of an
    index fails it; disruptions are Ignored (a new pod, nothing counted); maxFailedIndexes
    0 ends the Job at the first failed index; FailJob ends it at once; without
    backoffLimitPerIndex the Job-wide backoffLimit applies. When the Job ends early the
    pods still running are deleted and no new index starts."""
    kube.create_job(NS, make_indexed_job(**options))
    indexed.run_until_finished(by_index(scripts))
    job = kube.read_job(NS, JOB)
    assert job is not None
    assert job_finished(job) == end
    terminal = ("Complete" if end == "Complete" else "Failed", reason)
    first = ("SuccessCriteriaMet" if end == "Complete" else "FailureTarget", reason)
    assert ends(job) == [first, terminal]
    status = job["status"]
    assert status.get("completedIndexes", "") == completed
    assert status.get("failedIndexes") == failed_indexes
    assert (status["failed"], status["succeeded"]) == (failed, len(parse_indexes(completed)))
    listed = kube.list_pods(NS, f"batch.kubernetes.io/job-name={JOB}")
    assert [sum(pod_index(p) == i for p in listed) for i in range(5)] == pods
    assert all(p["status"]["phase"] in ("Succeeded", "Failed") for p in listed)
    assert status["active"] == 0
    assert_stored_objects_valid(sim)


def test_failed_pods_as_the_controller_reads_them(
        kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """What a failed pod carries: the exit code and reason, the log and its tail as the
    termination message, DisruptionTarget on disruptions, and the per-index failure counts
    (counted and ignored) on each replacement pod."""
    log = "".join(f"line {i}\n" for i in range(100)) + "PermanentModelError: gated\n"
    kube.create_job(NS, make_indexed_job(completions=3, parallelism=3))
    indexed.run_until_finished(by_index({0: [4, 4], 1: ["evict", "oom"], 2: [Exit(3, log)]}))
    pods: dict[int, list[dict[str, Any]]] = {}
    for pod in kube.list_pods(NS, f"batch.kubernetes.io/job-name={JOB}"):
        pods.setdefault(pod_index(pod), []).append(pod)
    for same_index in pods.values():  # oldest first: by the failures before each pod
        same_index.sort(key=lambda p: sum(int(p["metadata"]["annotations"].get(k, 0))
                                          for k in (FAILURE_COUNT, IGNORED_COUNT)))

    def terminated(pod: dict[str, Any]) -> tuple[int, str]:
        state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        return state["exitCode"], state["reason"]

    def counts(pod: dict[str, Any]) -> tuple[str, str | None]:
        annotations = pod["metadata"]["annotations"]
        return annotations[FAILURE_COUNT], annotations.get(IGNORED_COUNT)

    assert [(terminated(p), counts(p)) for p in pods[0]] == [
        ((4, "Error"), ("0", None)), ((4, "Error"), ("1", None))]
    assert [(terminated(p), counts(p)) for p in pods[1]] == [
        ((143, "Error"), ("0", None)), ((137, "OOMKilled"), ("0", "1")),
        ((0, "Completed"), ("1", "1"))]
    assert any(c["type"] == "DisruptionTarget" for c in pods[1][0]["status"]["conditions"])
    (gated,) = pods[2]
    name = gated["metadata"]["name"]
    assert kube.read_pod_log(NS, name, tail_lines=2) == "line 99\nPermanentModelError: gated\n"
    message = gated["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert message.endswith("PermanentModelError: gated\n") and message.count("\n") == 80
    assert indexed.counters(JOB).outcomes == {"exit 4": 2, "evict": 1, "oom": 1,
                                              "succeed": 1, "exit 3": 1}


def test_a_failed_index_lets_the_others_finish(
        kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """The Job records index 1 in failedIndexes at once and keeps running the others; it
    turns Failed only when every index has finished (seen through the Job watch)."""
    since = created(kube, make_indexed_job())
    indexed.run_until_finished(by_index({1: [2]}))
    statuses = []
    for event in kube.watch_jobs(NS, SELECTOR, since, timeout_s=5):
        statuses.append(event.object["status"])
        if job_finished(event.object):
            break
    marked = next(i for i, s in enumerate(statuses) if s.get("failedIndexes") == "1")
    ended = next(i for i, s in enumerate(statuses) if s.get("conditions"))
    assert marked < ended and not job_finished({"status": statuses[marked]})
    assert parse_indexes(statuses[marked].get("completedIndexes")) < {0, 2, 3, 4}
    assert statuses[ended]["completedIndexes"] == "0,2-4"


# -- admission, stopping, taking over --------------------------------------------------------------


def test_suspended_until_admitted(kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """A Job created suspended (Kueue) runs nothing until admitted; admit=True admits it."""
    kube.create_job(NS, make_indexed_job(suspend=True))
    with indexed.autopilot(admit=False):
        ticks = indexed.ticks
        while indexed.ticks < ticks + 5:
            time.sleep(0.005)
        assert kube.list_pods(NS, f"batch.kubernetes.io/job-name={JOB}") == []
        assert indexed.admit(JOB)["spec"]["suspend"] is False
        assert indexed.wait_finished([JOB]) == {JOB: "Complete"}
    kube.create_job(NS, make_indexed_job("esd-shards-cpu", suspend=True))
    with indexed.autopilot():
        assert indexed.wait_finished(["esd-shards-cpu"]) == {"esd-shards-cpu": "Complete"}


def test_stop_and_restart_the_autopilot(kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """Stopped mid-run, nothing moves; started again, the Job finishes with each index run
    exactly once."""
    gate = threading.Event()

    def worker(job: dict[str, Any], index: int, attempt: int) -> Outcome:
        if index >= 2:
            gate.wait(5)  # holds the cluster mid-run until the test has stopped it
        return "succeed"

    kube.create_job(NS, make_indexed_job(completions=6))
    indexed.start_autopilot(worker)
    deadline = time.monotonic() + 10
    while (indexed.counters(JOB).outcomes["succeed"] < 2) and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    indexed.stop_autopilot()
    before = kube.read_job(NS, JOB)
    ticks = indexed.ticks
    time.sleep(0.05)
    assert indexed.ticks == ticks and kube.read_job(NS, JOB) == before
    assert before is not None and not job_finished(before)
    with indexed.autopilot(worker):
        assert indexed.wait_finished([JOB]) == {JOB: "Complete"}
    assert indexed.counters(JOB).outcomes == {"succeed": 6}
    assert indexed.counters(JOB).pods == 6


def test_a_new_simulator_takes_over_a_running_job(
        sim: KubeSim, kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """A fresh simulator rebuilds each index's failures from the pods: index 0 failed once
    (exit 4) under the first, so its second failure under the second fails the index."""
    kube.create_job(NS, make_indexed_job(completions=2))
    worker = by_index({0: [4, 4]})
    while not indexed.counters(JOB).outcomes["exit 4"]:
        indexed.tick(worker)
    attempts: list[tuple[int, int]] = []

    def recording(job: dict[str, Any], index: int, attempt: int) -> Outcome:
        attempts.append((index, attempt))
        return worker(job, index, attempt)

    IndexedJobSimulator(sim, namespace=NS).run_until_finished(recording)
    job = kube.read_job(NS, JOB)
    assert job is not None and job["status"]["failedIndexes"] == "0"
    assert (0, 1) in attempts and job["status"]["failed"] == 2


def test_deleted_job_and_worker_errors(kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """A Job the controller deletes mid-run is dropped quietly; an error in the worker
    callback fails the autopilot block."""
    kube.create_job(NS, make_indexed_job())
    indexed.tick()
    indexed.tick()
    assert kube.delete_job(NS, JOB) is True
    for _ in range(3):
        indexed.tick()
    assert kube.list_pods(NS, f"batch.kubernetes.io/job-name={JOB}") == []

    def broken(job: dict[str, Any], index: int, attempt: int) -> Outcome:
        raise OSError("store unreachable")

    kube.create_job(NS, make_indexed_job("esd-shards-cpu"))
    with pytest.raises(RuntimeError, match="autopilot failed"), indexed.autopilot(broken):
        indexed.wait_finished(["esd-shards-cpu"], timeout_s=10)


def test_each_tick_lists_once(kube: KubeClient, indexed: IndexedJobSimulator) -> None:
    """The simulator keeps up with thousands of indexes: per tick one list of Jobs and one
    of live pods (plus one list when it first meets a Job), then three writes per pod."""
    for name in ("esd-shards-gpu", "esd-shards-cpu"):
        kube.create_job(NS, make_indexed_job(name, completions=20, parallelism=10))
    indexed.run_until_finished()
    calls = indexed.calls
    assert calls["list jobs"] == indexed.ticks
    assert calls["list pods"] == indexed.ticks + 2
    assert (calls["create pods"], calls["patch pods"], calls["patch pods/status"]) == \
        (40, 40, 40)
    assert calls["patch jobs/status"] <= 2 * indexed.ticks
    assert indexed.counters("esd-shards-cpu").max_active == 10


# -- the emulator: /version and an apiserver without backoffLimitPerIndex --------------------------


@pytest.mark.parametrize(("version", "minor", "git"), [
    (None, "31", "v1.31.0"), ("1.28.3", "28", "v1.28.3"),
    ("1.29.4-eks-036c24b", "29+", "v1.29.4-eks-036c24b"),
], ids=["default", "old", "managed"])
def test_server_version(version: str | None, minor: str, git: str) -> None:
    """GET /version as kubernetes.client.VersionApi reads it; managed clusters report a
    "29+" minor and their suffix in gitVersion."""
    options = {} if version is None else {"server_version": version}
    with KubeSim(**options) as server:
        info = k8s.VersionApi(server.api_client()).get_code()
    assert (info.major, info.minor, info.git_version) == ("1", minor, git)


@pytest.fixture(params=[True, False], ids=["gate-on", "gate-off"])
def gated(request: pytest.FixtureRequest) -> Iterator[tuple[bool, KubeClient]]:
    with KubeSim(per_index_backoff=request.param) as server, \
            KubeClient(server.configuration(), retry=RETRY) as client:
        yield request.param, client


def test_apiserver_without_per_index_backoff(gated: tuple[bool, KubeClient]) -> None:
    """With the JobBackoffLimitPerIndex gate off the apiserver accepts the Job and silently
    drops backoffLimitPerIndex, maxFailedIndexes and the FailIndex rules; backoffLimit then
    defaults to 6 instead of MaxInt32. Only reading the Job back shows it."""
    enabled, client = gated
    assert client.create_job(NS, make_indexed_job(max_failed=2)) == "created"
    job = client.read_job(NS, JOB)
    assert job is not None
    spec = job["spec"]
    actions = [r["action"] for r in spec["podFailurePolicy"]["rules"]]
    if enabled:
        assert (spec["backoffLimitPerIndex"], spec["maxFailedIndexes"]) == (1, 2)
        assert actions == ["Ignore", "FailIndex"] and spec["backoffLimit"] == 2**31 - 1
    else:
        assert "backoffLimitPerIndex" not in spec and "maxFailedIndexes" not in spec
        assert actions == ["Ignore"] and spec["backoffLimit"] == 6


# -- nodes ---------------------------------------------------------------------------------------


def test_pods_spread_over_nodes_and_keep_off_the_nodes_their_affinity_excludes(
    sim: KubeSim, kube: KubeClient,
) -> None:
    """Pods go to the least loaded of the nodes their required node affinity allows
    (kubernetes.io/hostname NotIn), spec.nodeName set as they start; the worker callback
    that takes `pod` sees it, and NODE_NAME from the Downward API resolves to it. A Job
    whose affinity allows no node keeps its pod Pending, Unschedulable, and runs nothing."""
    nodes = ["n0", "n1", "n2"]
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=nodes)
    job = make_indexed_job(completions=9, parallelism=3)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "NODE_NAME",
                         "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    job["spec"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                  "values": ["n1"]}]}]}}}
    created(kube, job)
    seen: list[tuple[str, str]] = []

    def worker(job: dict[str, Any], index: int, attempt: int,
               pod: Mapping[str, Any] | None = None) -> Outcome:
        assert pod is not None
        seen.append((pod["spec"]["nodeName"], resolve_env(pod)["NODE_NAME"]))
        return "succeed"

    indexed.run_until_finished(worker)
    assert len(seen) == 9 and all(node == env for node, env in seen)
    # n1 excluded; 3 pods at a time over the 2 others: 2 + 1 (ties to the first listed)
    assert indexed.counters(JOB).nodes == {"n0": 6, "n2": 3}

    stuck = make_indexed_job("esd-shards-nowhere", completions=1, parallelism=1)
    stuck["spec"]["template"]["spec"]["affinity"] = job["spec"]["template"]["spec"]["affinity"]
    stuck["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] = nodes
    created(kube, stuck)
    for _ in range(4):
        indexed.tick(by_index({}))
    (pod,) = kube.list_pods(NS, "batch.kubernetes.io/job-name=esd-shards-nowhere")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    (scheduled,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled["reason"] == "Unschedulable" and "0/3 nodes" in scheduled["message"]
    assert indexed.counters("esd-shards-nowhere").nodes == {}
    assert_stored_objects_valid(sim)
