"""controller.backends.kubernetes.common.diagnosis: why a Job failed or waits, from API objects
(pure, table-driven)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from controller.backends.kubernetes.common.diagnosis import describe_pending, diagnose_failure


def _pod(*, exit_code: int | None = None, reason: str = "Error",
         conditions: Sequence[Mapping[str, Any]] = (), phase: str = "Failed",
         status_reason: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": list(conditions)}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": {
            "exitCode": exit_code, "reason": reason, "message": "last line\n"}}}]
    if status_reason:
        status["reason"] = status_reason
        status["message"] = "The node was low on resource: ephemeral-storage."
    return {"metadata": {"name": "p", "creationTimestamp": "2026-11-23T07:00:00Z",
                         "resourceVersion": "5"}, "spec": {"nodeName": "n1"}, "status": status}


def _failed_job(reason: str, message: str = "m") -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": reason,
                                       "message": message}]}}


@pytest.mark.parametrize(
    ("job_reason", "pod", "error", "retryable"),
    [
        pytest.param("PodFailurePolicy", _pod(exit_code=3), "PermanentModelError", False,
                     id="exit3"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=4), "TransientError", True,
                     id="exit4"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=6), "DeviceError", True,
                     id="exit6-broken-gpu"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=137, reason="OOMKilled"),
                     "KilledBySignal: OOMKilled", True, id="oomkilled"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=143, conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
             "message": "preempted"}]), "Disrupted: PreemptionByScheduler", True,
            id="disruption"),
        pytest.param("BackoffLimitExceeded", _pod(status_reason="Evicted"), "Evicted:", True,
                     id="kubelet-eviction"),
        pytest.param("DeadlineExceeded", _pod(exit_code=143), "DeadlineExceeded", False,
                     id="deadline"),
        pytest.param("BackoffLimitExceeded", None, "JobFailed: BackoffLimitExceeded", True,
                     id="no-pod"),
    ],
)
def test_diagnose_failure(job_reason: str, pod: dict[str, Any] | None, error: str,
                          retryable: bool) -> None:
    """esd_worker.core.errors.classify_exit decides for exit codes; the pod's own state adds what
    only
    Kubernetes knows (OOMKilled, disruption, eviction, deadline)."""
    found = diagnose_failure(_failed_job(job_reason), [pod] if pod else [], "")
    assert found.error.startswith(error)
    assert found.retryable is retryable
    if pod and "containerStatuses" in pod["status"]:
        assert found.tail == ("last line",)  # the termination message without a log
    if pod:  # a broken GPU, like any failure, names the node it happened on
        assert found.node == "n1" and found.error.endswith("(pod p on n1)")


@pytest.mark.parametrize(
    ("job", "pods", "events", "expected"),
    [
        pytest.param({"spec": {"suspend": True}}, [], [], "suspended: waiting for Kueue",
                     id="kueue"),
        pytest.param({"spec": {}}, [_pod(phase="Pending", conditions=[{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 node(s) had untolerated taint "
                       "{dedicated: infra}."}])], [], "Unschedulable: 0/3 nodes are "
                       "available: 3 node(s) had untolerated taint", id="taint"),
        pytest.param({"spec": {}}, [], [{"type": "Warning", "reason": "FailedCreate",
                                         "message": 'pods "x" is forbidden: exceeded quota: '
                                                    'gpu-quota', "lastTimestamp": "t"}],
                     "FailedCreate: pods \"x\" is forbidden: exceeded quota", id="quota"),
    ],
)
def test_describe_pending(job: dict[str, Any], pods: list[dict[str, Any]],
                          events: list[dict[str, Any]], expected: str) -> None:
    assert describe_pending(job, pods, events).startswith(expected)
