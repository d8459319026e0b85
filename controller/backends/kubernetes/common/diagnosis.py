"""Why a worker Job failed or is not running, from the objects the API returns (pure).

Owns reading Job conditions, pods and events into a Diagnosis (error "Class: what
happened", retryable or not), a one-line pending reason, or the line that ends a run
whose pods can never start (config_error: a required Secret missing). The worker's exit
codes mean what esd_worker.core.errors.classify_exit says; this module adds what only
Kubernetes knows (OOMKilled, disruptions, evictions, deadlines, scheduling, a pod's config
refused). Does not fetch anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controller.backends.kubernetes.common.jobs import CONTAINER_NAME
from esd_worker.core.errors import classify_exit, signal_name


@dataclass(frozen=True)
class Diagnosis:
    """Why a Job failed: error "Class: what happened", whether a retry may help, how the
    worker ended (exit code / signal, None when unknown) and the last log lines."""

    error: str
    retryable: bool
    exit_code: int | None
    signal: int | None
    tail: tuple[str, ...]
    pod: str | None = None
    node: str | None = None


def job_condition(job: Mapping[str, Any]) -> tuple[str | None, str, str]:
    """("Complete" | "Failed" | None, reason, message) of a Job from its conditions."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return str(cond["type"]), str(cond.get("reason") or ""), str(cond.get("message") or "")
    return None, "", ""


def pod_sort_key(pod: Mapping[str, Any]) -> tuple[str, int]:
    meta = pod.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), int(meta.get("resourceVersion") or 0)


def worker_terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER_NAME:
            terminated = (cs.get("state") or {}).get("terminated")
            return terminated if isinstance(terminated, Mapping) else None
    return None


def _pod_condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def _lines(text: str, n: int) -> tuple[str, ...]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return tuple(lines[-n:]) if n > 0 else ()


def diagnose_failure(
    job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], log_text: str, *,
    tail_lines: int = 20,
) -> Diagnosis:
    """Why a Failed Job failed, from the Job's condition, its last failed pod and its log.

    The exit code goes through esd_worker.core.errors.classify_exit (the one mapping of the
    worker's exit codes): 3 → permanent, 4/5 → transient, 128+N → killed by a signal
    (transient; this includes OOMKilled, the kernel's OOM killer on host memory). Deadline
    exceeded is not retried (the next attempt would get the same deadline); an eviction or
    disruption is.
    """
    _, reason, message = job_condition(job)
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    pod = max(failed or pods, key=pod_sort_key) if (failed or pods) else None
    terminated = worker_terminated(pod) if pod is not None else None
    pod_name = str((pod.get("metadata") or {}).get("name")) if pod is not None else None
    node = str((pod.get("spec") or {}).get("nodeName") or "") or None if pod else None
    tail = _lines(log_text, tail_lines)
    if not tail and terminated is not None and terminated.get("message"):
        tail = _lines(str(terminated["message"]), tail_lines)  # FallbackToLogsOnError
    exit_code = terminated.get("exitCode") if terminated is not None else None
    exit_code = int(exit_code) if isinstance(exit_code, int) else None
    signal = exit_code - 128 if exit_code is not None and 128 < exit_code <= 192 else None
    where = f" (pod {pod_name}{' on ' + node if node else ''})" if pod_name else ""

    def out(error: str, retryable: bool) -> Diagnosis:
        return Diagnosis(error + where, retryable, exit_code, signal, tail, pod_name, node)

    pod_reason = ((pod.get("status") or {}).get("reason") if pod is not None else None)
    if reason == "DeadlineExceeded" or pod_reason == "DeadlineExceeded":
        return out("DeadlineExceeded: the worker ran longer than --active-deadline "
                   f"(activeDeadlineSeconds): {message or pod_reason}", False)
    if terminated is not None and terminated.get("reason") == "OOMKilled":
        cls, retryable = classify_exit(exit_code, None)
        return out(f"{cls}: OOMKilled: the worker ran out of host memory (exit "
                   f"{exit_code}); raise --memory-request if it repeats", retryable)
    disruption = _pod_condition(pod, "DisruptionTarget") if pod is not None else None
    if disruption is not None:
        return out(f"Disrupted: {disruption.get('reason')}: {disruption.get('message')}",
                   True)
    status = (pod.get("status") or {}) if pod is not None else {}
    if status.get("reason") == "Evicted":
        return out(f"Evicted: {status.get('message') or 'the kubelet evicted the pod'}", True)
    if exit_code is not None:
        cls, retryable = classify_exit(exit_code, None)
        if signal is not None:
            detail = f"the worker was killed by {signal_name(signal)} (exit {exit_code})"
        else:
            detail = f"the worker exited {exit_code}"
        return out(f"{cls}: {detail}", retryable)
    # No pod ran to an end: the Job failed around it (pods never created, quota, ...).
    return out(f"JobFailed: {reason or 'unknown reason'}: {message}".rstrip(": "), True)


def describe_pending(
    job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]], workloads: Sequence[Mapping[str, Any]] | None = (),
) -> str:
    """One line on why a Job is not running: Kueue (from its Workload's conditions),
    Unschedulable (insufficient GPUs, untolerated taint, ...), quota, image pulls, from pod
    conditions and events. workloads None: the Job's Workloads could not be read (RBAC)."""
    if (job.get("spec") or {}).get("suspend"):
        if workloads is None:
            return ("suspended: waiting for Kueue to admit it (its Workload could not be "
                    "read: grant list on workloads.kueue.x-k8s.io, manifests/components/kueue)")
        return describe_workload(workloads)
    for pod in sorted(pods, key=pod_sort_key, reverse=True):
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}"
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
                return f"{waiting.get('reason')}: {waiting.get('message') or ''}"
    warnings = [e for e in events if e.get("type") == "Warning"]
    if warnings:
        last = max(warnings, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime")
                                                  or ""))
        return f"{last.get('reason')}: {last.get('message')}"
    if not pods:
        return "no pod created yet (see the Job's events; a ResourceQuota may be full)"
    return "pending: the scheduler has not placed the pod yet"


_NO_SECRET = re.compile(r'secret "(?P<name>[^"]+)" not found')
_NO_KEY = re.compile(r"couldn't find key (?P<key>\S+) in Secret (?P<ns>[^/\s]+)/(?P<name>\S+)")


def config_error(pods: Sequence[Mapping[str, Any]], *, namespace: str,
                 hf_token_secret: str | None) -> str | None:
    """One line when a worker pod can never start as it is: its container waits in
    CreateContainerConfigError (a required Secret or key missing, a config the kubelet
    refuses), which no wait mends; None otherwise. hf_token_secret ("NAME:KEY", the one
    required Secret of a worker pod) words the line for --hf-token-secret."""
    for pod in sorted(pods, key=pod_sort_key, reverse=True):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") != "CreateContainerConfigError":
                continue
            message = str(waiting.get("message") or "")
            token = (hf_token_secret or "").partition(":")[0]
            missing = _NO_SECRET.search(message)
            no_key = _NO_KEY.search(message)
            if missing and missing["name"] == token:
                return (f"Secret {token} (--hf-token-secret) not found in namespace "
                        f"{namespace}: create it (docs/kubernetes.md), or drop "
                        "--hf-token-secret if no model in the list is gated")
            if no_key and no_key["name"] == token:
                return (f"Secret {token} (--hf-token-secret) in namespace {namespace} has no "
                        f"key {no_key['key']}: add it, or name the key as --hf-token-secret "
                        f"{token}:KEY")
            name = (pod.get("metadata") or {}).get("name")
            return (f"pod {name} cannot start: CreateContainerConfigError: "
                    f"{message or 'the kubelet refused its configuration'}")
    return None


# Events an autoscaler puts on a pod it is bringing a node up for (cluster-autoscaler,
# Karpenter): after the scheduler's last FailedScheduling, a node is on its way.
_SCALING_UP = frozenset({"TriggeredScaleUp", "Nominated"})


def is_unschedulable(pods: Sequence[Mapping[str, Any]],
                     events: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the scheduler has said it cannot place these pods, and no autoscaler has
    answered since: a Pending pod with PodScheduled False for reason Unschedulable, or a
    FailedScheduling event, unless the latest of those events is older than an autoscaler's
    TriggeredScaleUp or Nominated. No node has what they ask for (GPUs, disk, memory, a
    toleration, a node affinity), as opposed to pods that wait for an image, a volume, a
    quota, Kueue, or a node being added."""
    said = any(e.get("reason") == "FailedScheduling" for e in events)
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        for cond in status.get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                said = True
    if not said:
        return False
    failed = [_event_time(e) for e in events if e.get("reason") == "FailedScheduling"]
    scaling = [_event_time(e) for e in events if e.get("reason") in _SCALING_UP]
    return not scaling or (bool(failed) and max(failed) > max(scaling))


def _event_time(event: Mapping[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or "")


def describe_workload(workloads: Sequence[Mapping[str, Any]]) -> str:
    """Why Kueue has not admitted a suspended Job, from its Workload (kueue.x-k8s.io): the
    message of the condition that holds it back (Evicted, QuotaReserved False, Admitted
    False: "couldn't assign flavors to pod set main: insufficient unused quota for
    nvidia.com/gpu in flavor ..."), or what is missing when there is no Workload."""
    if not workloads:
        return ("suspended: waiting for Kueue, which has made no Workload for it (is Kueue "
                "running, and does the Job's LocalQueue exist?)")
    workload = max(workloads, key=lambda w: str((w.get("metadata") or {})
                                                .get("creationTimestamp") or ""))
    conditions = {str(c.get("type")): c for c in
                  (workload.get("status") or {}).get("conditions") or []}

    def said(kind: str) -> str:
        cond = conditions[kind]
        return f"{cond.get('reason') or kind}: {cond.get('message') or ''}".rstrip(": ")

    for kind, status in (("Evicted", "True"), ("Preempted", "True"),
                         ("QuotaReserved", "False"), ("Admitted", "False")):
        if conditions.get(kind, {}).get("status") == status:
            return f"Kueue: {said(kind)}"
    if conditions.get("Admitted", {}).get("status") == "True":
        return "Kueue admitted it: the Job is being unsuspended"
    if conditions.get("QuotaReserved", {}).get("status") == "True":
        return f"Kueue: quota reserved, waiting for admission checks ({said('QuotaReserved')})"
    queue = ((workload.get("spec") or {}).get("queueName")) or "?"
    return f"Kueue: queued in LocalQueue {queue}, not considered yet"


def seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return max((datetime.fromisoformat(end) - datetime.fromisoformat(start))
                   .total_seconds(), 0.0)
    except ValueError:
        return None


def last_transition(job: Mapping[str, Any]) -> str | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed"):
            return str(cond.get("lastTransitionTime") or "") or None
    return None
