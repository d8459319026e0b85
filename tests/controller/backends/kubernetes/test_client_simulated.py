"""The Job simulator's outcomes as the real client sees them: status, logs, events, deletion.

The fixtures are the package conftest's: KubeSim, a client on it, and the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from controller.backends.kubernetes.common.client import (
    KubeClient,
)
from controller.backends.kubernetes.common.names import run_selector
from tests.support.cluster import NS, RUN, assert_stored_objects_valid, make_job
from tests.support.kubesim import (
    JobSimulator,
    KubeSim,
    job_finished,
)

# -- the simulator through the client --------------------------------------------------------

OUTCOMES = [
    # pod outcomes in order, the Job's end, its reason, status.failed, exit codes on the pods
    (["succeed"], "Complete", None, 0, [0]),
    ([3], "Failed", "PodFailurePolicy", 1, [3]),
    ([2], "Failed", "PodFailurePolicy", 1, [2]),
    (["evict", "preempt", "succeed"], "Complete", None, 0, [143, 143, 0]),
    (["node_lost", "succeed"], "Complete", None, 0, [137, 0]),
    ([4, 5, "succeed"], "Complete", None, 2, [4, 5, 0]),
    (["oom", "oom", "oom", "oom"], "Failed", "BackoffLimitExceeded", 4, [137] * 4),
    (["deadline"], "Failed", "DeadlineExceeded", 1, [143]),
]


@pytest.mark.parametrize(("script", "end", "reason", "failed", "codes"), OUTCOMES,
                         ids=["succeed", "exit3", "exit2", "evicted-preempted", "node-lost",
                              "transient-then-ok", "oomkilled", "deadline"])
def test_simulated_outcomes_seen_through_the_client(
        sim: KubeSim, kube: KubeClient, cluster: JobSimulator, script: list[Any], end: str,
        reason: str | None, failed: int, codes: list[int]) -> None:
    """podFailurePolicy as the Job controller applies it: exit 2/3 fail at once, disruptions
    (eviction, preemption, node lost) retry without counting, the rest count against
    backoffLimit 3 (the 4th counted failure ends the Job). The controller sees it all
    through list_jobs / list_pods."""
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    for outcome in script:
        cluster.run(name)
        cluster.step(name, outcome)
    (stored,), _ = kube.list_jobs(NS, run_selector(RUN))
    assert job_finished(stored) == end
    if reason:
        conditions = {c["type"]: c for c in stored["status"]["conditions"]}
        assert conditions["Failed"]["reason"] == reason
    assert int(stored["status"].get("failed") or 0) == failed
    pods = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    seen = [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods]
    assert sorted(seen) == sorted(codes)
    if "oom" in script:
        assert {p["status"]["containerStatuses"][0]["state"]["terminated"]["reason"]
                for p in pods} == {"OOMKilled"}
    if "evict" in script or "node_lost" in script:
        disrupted = [c for p in pods for c in p["status"]["conditions"]
                     if c["type"] == "DisruptionTarget"]
        assert disrupted and all(c["status"] == "True" for c in disrupted)
    assert_stored_objects_valid(sim)


def test_failure_log_and_events(sim: KubeSim, kube: KubeClient, cluster: JobSimulator) -> None:
    """The last log lines (pods/log, and the FallbackToLogsOnError termination message) and
    why a pod is Pending (FailedScheduling events) are readable through the client."""
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    cluster.step(name, "pending")
    (pod,) = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    pod_name = pod["metadata"]["name"]
    scheduled = {c["type"]: c for c in pod["status"]["conditions"]}["PodScheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    (event,) = kube.list_events(NS, f"involvedObject.name={pod_name}")
    assert event["reason"] == "FailedScheduling" and "nvidia.com/gpu" in event["message"]
    assert kube.list_events(NS, "involvedObject.name=someone-else") == []
    assert kube.read_pod_log(NS, pod_name) == ""  # 400: the container never started

    log = "".join(f"line {i}\n" for i in range(100)) + "PermanentModelError: gated\n"
    cluster.run(name)
    cluster.fail(name, 3, log=log)
    assert kube.read_pod_log(NS, pod_name, tail_lines=2) == "line 99\nPermanentModelError: gated\n"
    (pod,) = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    message = pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert message.endswith("PermanentModelError: gated\n")
    assert kube.read_pod_log(NS, "no-such-pod") == ""
    assert_stored_objects_valid(sim)


def test_delete_job_takes_its_pods(sim: KubeSim, kube: KubeClient,
                                   cluster: JobSimulator) -> None:
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    cluster.run(name)
    assert kube.read_job(NS, name) is not None
    assert kube.delete_job(NS, name) is True
    assert kube.delete_job(NS, name) is False
    assert kube.read_job(NS, name) is None
    assert kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}") == []


def test_kueue_job_waits_for_admission(sim: KubeSim, kube: KubeClient,
                                       cluster: JobSimulator) -> None:
    job = make_job(kueue_queue="gpu-queue")
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    with pytest.raises(RuntimeError, match="suspended"):
        cluster.start(name)
    assert cluster.admit(name)["spec"]["suspend"] is False
    assert job_finished(cluster.succeed(name)) == "Complete"


def test_autopilot_runs_every_job(sim: KubeSim, kube: KubeClient,
                                  cluster: JobSimulator) -> None:
    """The simulator on its own: each Job follows its script while the client watches."""
    refs: dict[str, list[Any]] = {
        "org/ok": ["succeed"], "org/gated": [3], "org/evicted": ["evict", "succeed"]}
    _, version = kube.list_jobs(NS, run_selector(RUN))

    def script(job: Mapping[str, Any]) -> list[Any]:
        return refs[job["metadata"]["annotations"]["esd-sweep/model-ref"]]

    ends: dict[str, str] = {}
    with cluster.autopilot(script):
        for ref in refs:
            kube.create_job(NS, make_job(ref, kueue_queue="q"))
        for event in kube.watch_jobs(NS, run_selector(RUN), version, timeout_s=10):
            end = job_finished(event.object)
            if end:
                ends[event.object["metadata"]["annotations"]["esd-sweep/model-ref"]] = end
            if len(ends) == len(refs):
                break
    assert ends == {"org/ok": "Complete", "org/gated": "Failed", "org/evicted": "Complete"}
    assert_stored_objects_valid(sim)
