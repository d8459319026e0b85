"""The Indexed Job of a sharded run: one per resource class, one completion index per shard.

Owns what a sharded worker Job looks like (its name, the worker's mode, the per-index
podFailurePolicy, the labels and annotations a controller finds it by). Pure: dicts out, no
client. Does not check the API server's version (common.wiring.check_server), cut the shards
or write them to the store (the shard lists' keys are esd_worker.core.store.layout's), submit
or watch Jobs, or read per-model outcomes (those are in the store). The pod is the per-model
Jobs' pod (jobs.pod_spec); label keys are names'; worker exit codes esd_worker.core.errors'.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from controller.backends.kubernetes.common.errors import JobSpecError
from controller.backends.kubernetes.common.jobs import (
    CONTAINER_NAME,
    JobSettings,
    job_object,
    pod_annotations,
    pod_argv,
    pod_spec,
    sweep_labels,
)
from controller.backends.kubernetes.common.names import (
    CLASS_LABEL,
    JOB_NAME_PREFIX,
    KUEUE_QUEUE_LABEL,
    MODE_LABEL,
    MODE_SHARDED,
    MODELS_ANNOTATION,
    OUTPUT_ANNOTATION,
    SHARD_BYTES_ANNOTATION,
    SHARDS_ANNOTATION,
    check_ref,
    output_annotation,
)
from controller.backends.kubernetes.common.telemetry import HOSTNAME_KUBERNETES_LABEL
from esd_worker.core.command.invocation import SHARDS
from esd_worker.core.errors import EXIT_DEVICE, EXIT_PERMANENT, EXIT_USAGE
from esd_worker.core.redact import without_userinfo

# Pods of an Indexed Job are named <job>-<index>-<5 random> and get the hostname
# <job>-<index>, which must stay a 63-char DNS label: 50 + '-' + a 5-digit index fits, and
# the API server allows at most 100000 completions with backoffLimitPerIndex (index 99999).
MAX_NAME = 50
MAX_COMPLETIONS = 100_000
_HASH_LEN = 8
# The class is never cut, so it must leave room for "esd-" + the run id's hash + "-".
MAX_CLASS = MAX_NAME - len(JOB_NAME_PREFIX) - _HASH_LEN - 1
_CLASS = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NOT_NAME = re.compile(r"[^a-z0-9-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# backoffLimitPerIndex and the FailIndex action: beta and on by default from 1.29, GA in
# 1.33; podFailurePolicy GA in 1.31, the minimum (jobs.MIN_KUBERNETES). An older API server
# drops the fields it does not know: the Job would be created without per-index limits and
# with a policy it cannot act on.
KUEUE_MIN_PARALLELISM = "kueue.x-k8s.io/job-min-parallelism"


def indexed_job_name(run_id: str, class_name: str) -> str:
    """`esd-<run id>-<class>`: the run id lowercased, characters outside [a-z0-9-] as '-'.

    A DNS-1123 label of at most MAX_NAME chars (room for the pods' `-<index>` hostnames).
    The run-id part is what gets cut, never the class; when it is cut, or when characters
    had to be replaced (two run ids could then read the same), a hash of the full run id is
    kept at its end, so every run gets its own name. Run ids differing only in case share a
    name (new run ids are UTC times, always the same case). Raises JobSpecError.
    """
    if not isinstance(class_name, str) or not _CLASS.fullmatch(class_name) \
            or len(class_name) > MAX_CLASS:
        raise JobSpecError(f"class_name: {class_name!r} must be ≤ {MAX_CLASS} of a-z 0-9 -, "
                           "alphanumeric at both ends")
    if not isinstance(run_id, str) or not run_id.strip():
        raise JobSpecError(f"run_id: {run_id!r} is empty")
    readable = _NOT_NAME.sub("-", run_id.lower()).strip("-")
    room = MAX_NAME - len(JOB_NAME_PREFIX) - 1 - len(class_name)
    if readable and len(readable) <= room and readable == run_id.lower():
        return f"{JOB_NAME_PREFIX}{readable}-{class_name}"
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:_HASH_LEN]
    cut = readable[: max(room - _HASH_LEN - 1, 0)].rstrip("-")
    run_part = f"{cut}-{digest}" if cut else digest
    return f"{JOB_NAME_PREFIX}{run_part}-{class_name}"


def shard_failure_policy() -> dict[str, Any]:
    """How a failed pod of a shard counts (rules are tried in order, the first match wins).

    A disruption (eviction, preemption, node drain or loss, spot reclaim: the pod gets the
    DisruptionTarget condition) is ignored: the index runs again without using one of its
    retries, and the worker skips the models already done. Exit 2 (usage) and 3 (the store
    unusable as configured) mean the shard itself cannot run (no shard file, bad flags, no
    bucket): FailIndex ends that index at once, the others go on. Exit 6 (the node's GPU is
    broken; the worker recorded nothing) fails the index at once too: a retry of the index
    could land on the same node, so the controller runs the shard again in a replacement
    Job that keeps off the node (sharded.devicefaults). A model that failed for
    good is an outcome, not a pod failure: `esd-worker --shards` records it and exits 0
    once the rest of its shard is done. Everything else (4 transient, 5 GPU out of memory,
    137 OOMKilled, a segfault) counts against backoffLimitPerIndex: the next pod skips what
    is done, and the worker's attempt notes find a model that kills every pod and record it
    as a failure once it has used its starts, so the rest of the shard still completes.
    """
    return {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailIndex",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": sorted({EXIT_USAGE, EXIT_PERMANENT, EXIT_DEVICE}),
                },
            },
        ]
    }


def _check_count(what: str, value: object, low: int, high: int | None,
                 problems: list[str]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f"≥ {low}"
        problems.append(f"{what}: {value!r} must be an integer {bound}")


def _check_url(what: str, url: str, problems: list[str]) -> None:
    # The URL as the pod gets it is what must be one safe argv element; the messages then
    # quote it without a user:password@ part, which may be a credential.
    if not isinstance(url, str):
        problems.append(f"{what}: {url!r} is not a string")
        return
    if _CONTROL.search(url):  # before urlsplit, which silently drops newlines and tabs
        problems.append(f"{what}: contains control characters")
        return
    try:
        shown = without_userinfo(url)
    except ValueError:
        problems.append(f"{what}: not a URL")
        return
    check_ref(what, shown, problems)


def build_indexed_job(
    *,
    run_id: str,
    class_name: str,
    completions: int,
    parallelism: int,
    backoff_limit_per_index: int,
    shards_url: str,
    output_url: str,
    settings: JobSettings,
    active_deadline_s: int | None = None,
    models: int | None = None,
    shard_bytes: int | None = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """The batch/v1 Indexed Job that runs one resource class's shards (a plain dict).

    run_id / class_name: fix the name (indexed_job_name) and the labels; completions: the
    number of shards (index i runs shard i); parallelism: pods at once (the GPU budget,
    capped by completions); backoff_limit_per_index: counted pod failures an index absorbs
    before it fails; shards_url: the store URL of the class's shard lists; output_url: the
    result store; settings.worker: the rest of the worker's command line (its batch flags,
    hub rate); active_deadline_s: a limit on
    the whole Job (None: none; a sharded run may last days; settings.active_deadline_s is
    each pod's, and the sharded backend leaves it unset unless asked); models / shard_bytes:
    recorded as annotations for people and the run report; avoid_nodes: nodes its pods may
    not land on (avoid_nodes_affinity: bad GPUs). Raises JobSpecError listing every problem.
    """
    problems = list(settings.problems())
    name = ""
    try:
        name = indexed_job_name(run_id, class_name)
    except JobSpecError as e:
        problems.append(str(e))
    if run_id != settings.run_id:
        problems.append(f"run_id: {run_id!r} is not the settings' run {settings.run_id!r}")
    _check_count("completions", completions, 1, MAX_COMPLETIONS, problems)
    _check_count("parallelism", parallelism, 1, None, problems)
    _check_count("backoff_limit_per_index", backoff_limit_per_index, 0, None, problems)
    if active_deadline_s is not None:
        _check_count("active_deadline_s", active_deadline_s, 1, None, problems)
    for what, count in (("models", models), ("shard_bytes", shard_bytes)):
        if count is not None:
            _check_count(what, count, 0, None, problems)
    _check_url("shards_url", shards_url, problems)
    _check_url("output_url", output_url, problems)
    if problems:
        raise JobSpecError("; ".join(problems))

    labels = {**sweep_labels(settings), MODE_LABEL: MODE_SHARDED, CLASS_LABEL: class_name}
    job_labels = dict(labels)
    if settings.kueue_queue:
        job_labels[KUEUE_QUEUE_LABEL] = settings.kueue_queue  # the Job's, not the pods'
    annotations = {
        OUTPUT_ANNOTATION: output_annotation(output_url),
        SHARDS_ANNOTATION: output_annotation(shards_url),
    }
    if models is not None:
        annotations[MODELS_ANNOTATION] = str(models)
    if shard_bytes is not None:
        annotations[SHARD_BYTES_ANNOTATION] = str(shard_bytes)
    if settings.kueue_queue:
        # One Workload asks for every pod at once; partial admission (on by default from
        # Kueue 0.5) lets Kueue start it with as few as one pod when quota is short.
        annotations[KUEUE_MIN_PARALLELISM] = "1"

    # The worker picks its shard <shards_url>/<JOB_COMPLETION_INDEX>.csv itself (Kubernetes
    # sets the variable in Indexed Job pods): no $(VAR) expansion. It reads the store with
    # the AWS credential chain and refuses user:password@ in a URL, which anyone who can
    # get the Job would read in its argv.
    worker = settings.worker.replace(mode=SHARDS, target=without_userinfo(shards_url),
                                     output=without_userinfo(output_url))
    pod = pod_spec(pod_argv(settings, worker), settings,
                   avoid_nodes_affinity(avoid_nodes) if avoid_nodes else None)
    template_meta: dict[str, Any] = {"labels": dict(labels)}
    if settings.do_not_disrupt:
        template_meta["annotations"] = pod_annotations(settings)

    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": completions,
        "parallelism": min(parallelism, completions),
        # No backoffLimit: with backoffLimitPerIndex each index has its own count.
        "backoffLimitPerIndex": backoff_limit_per_index,
        "podFailurePolicy": shard_failure_policy(),
        "template": {"metadata": template_meta, "spec": pod},
    }
    if active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = active_deadline_s
    return job_object(name, settings, job_labels, annotations, spec)


def avoid_nodes_affinity(nodes: Sequence[str]) -> dict[str, Any]:
    """A pod `affinity` that keeps it off `nodes`: required (a preference would still send
    pods to a free broken node), on the kubernetes.io/hostname label, which the kubelet sets
    to the node name unless it runs with --hostname-override. IgnoredDuringExecution: a pod
    already running there is left alone (it exits 6 on its own)."""
    avoid = {"key": HOSTNAME_KUBERNETES_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [avoid]}]}}}
