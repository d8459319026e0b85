"""Kubernetes batch/v1 Job objects for one model each: settings, labels, pod spec (dicts out).

Owns what a worker Job looks like (security context, GPU requests, secrets by reference,
podFailurePolicy, Kueue and Karpenter hints), the worker pod that sharded Indexed Jobs
(.indexed) share, and the YAML any of them is printed as (read back alike by YAML 1.2 and
1.1). Pure. Does not name Jobs or hold the label keys (controller.backends.kubernetes.common.names),
talk to a cluster (.client) or decide placement (the caller passes the node affinity in).
Worker exit codes are esd_worker.core.errors'.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.backends.kubernetes.common.errors import JobSpecError
from controller.backends.kubernetes.common.names import (
    APP_NAME,
    ATTEMPT_LABEL,
    COMPONENT,
    INSTANCE_LABEL,
    KUEUE_QUEUE_LABEL,
    MANAGED_BY_LABEL,
    MODEL_KEY_LABEL,
    OUTPUT_ANNOTATION,
    RUN_LABEL,
    check_ref,
    is_dns_label,
    is_dns_subdomain,
    is_extended_resource,
    is_label_key,
    is_label_value,
    job_name,
    model_key_label,
    output_annotation,
    version_label,
)
from controller.backends.kubernetes.common.quantities import quantity_problem
from controller.backends.kubernetes.common.workerenv import (
    CACHE_DIR,
    TMP_DIR,
    env_problems,
    worker_env,
)
from esd_worker.core.command.invocation import MODEL, WorkerInvocation
from esd_worker.core.errors import EXIT_CLASSES, EXIT_PERMANENT, EXIT_USAGE
from esd_worker.core.models.naming import split_model_ref

CONTAINER_NAME = "worker"
# What worker pods request by default; MIG slices are other extended resources
# (nvidia.com/mig-1g.10gb, …) on nodes that still carry the nvidia.com/gpu taint.
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = "nvidia.com/gpu"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
RUN_AS_USER = 1000
# The oldest Kubernetes esd-sweep runs on, stated once: podFailurePolicy, which every worker
# Job relies on, is GA from 1.31 (1.29 and 1.30 are out of upstream and cloud support). The
# sharded mode refuses older API servers; the tests validate against its strict schemas.
MIN_KUBERNETES = (1, 31)
TMP_SIZE = "1Gi"  # /tmp (HOME, TMPDIR): small files only; downloads go to the cache volume
PART_OF = "esd-sweep"  # app.kubernetes.io/part-of of every worker Job and pod

_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_RELATION = re.compile(r"[a-z]{0,32}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class JobSettings:
    """How every worker Job of a sweep looks (built once from `esd-sweep run` flags and env).

    image: container image with `esd-worker` on PATH. namespace: where the Jobs go.
    run_id: this run (label `esd-sweep/run`); sweep_name: label `app.kubernetes.io/instance`
    (default: run_id). Both must be valid label values (≤ 63 chars).
    gpus_per_job: `gpu_resource` requested and limited per pod (default 1; 0: a CPU-only
    Job, no GPU request, no GPU toleration, NVIDIA_VISIBLE_DEVICES=void).
    gpu_resource: the extended resource a GPU is (nvidia.com/gpu, or a MIG slice such as
    nvidia.com/mig-1g.10gb); the toleration stays nvidia.com/gpu's.
    cpu_request, memory_request: Kubernetes quantities (defaults "2", "16Gi");
    memory_limit: None = the memory request (every worker pod has a limit: see _resources);
    ephemeral_storage_request: None = none (the HF cache emptyDir lives on it). It also
    bounds the cache emptyDir (sizeLimit): a pod whose downloads outgrow it is evicted
    instead of filling the node's disk, an eviction counted as a failure (no
    DisruptionTarget) that the worker's hard download budget (--cache-budget: the request
    less the headroom) prevents.
    backoff_limit: pod failures counted before the Job fails (default 3; disruptions:
    preemptions, drains, node-pressure evictions, do not count, see pod_failure_policy).
    active_deadline_s: seconds a worker pod may run once it is on a node (the pod's
    activeDeadlineSeconds, so time pending for a node, an autoscaler or Kueue does not
    count; default 6 h; None = no limit).
    ttl_after_finished_s: seconds a finished Job is kept (default 24 h; None = forever).
    node_selector, priority_class, service_account, image_pull_secrets: passed to the pod.
    tolerations: (key, value or None, effect) each: the pods tolerate these taints too (GPU
    pools with custom taints); value None tolerates any value (operator Exists).
    hf_token_secret: "secret-name:key" holding the HF token (env HF_TOKEN, by reference,
    required: a missing Secret or key keeps the pod from starting, see workerenv).
    s3_secret: a Secret with keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally
    AWS_SESSION_TOKEN (by reference; absent keys leave room for IRSA / pod identity).
    env: extra non-secret environment (e.g. AWS_ENDPOINT_URL, AWS_REGION); names that look
    like credentials are refused, and so are URLs holding a user name or password.
    hf_cache_pvc: a PersistentVolumeClaim mounted at /cache (HF_HOME=/cache/hf) shared by
    Jobs; None = an emptyDir per pod.
    kueue_queue: LocalQueue name; the Job is created suspended and Kueue admits it.
    do_not_disrupt: ask Karpenter and the cluster autoscaler not to consolidate the node
    away from under a running worker.
    worker: what every worker of the run is given (esd_worker.core.command.invocation; its log
    format "json" for cluster log pipelines, or "text"); each Job's is it with the Job's
    model or shards and store (pod_argv). Device None: cuda with GPUs, else cpu.
    """

    image: str
    namespace: str
    run_id: str
    sweep_name: str | None = None
    gpus_per_job: int = 1
    gpu_resource: str = GPU_RESOURCE
    cpu_request: str = "2"
    memory_request: str = "16Gi"
    memory_limit: str | None = None
    ephemeral_storage_request: str | None = None
    backoff_limit: int = 3
    active_deadline_s: int | None = 6 * 3600
    ttl_after_finished_s: int | None = 24 * 3600
    node_selector: Mapping[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    tolerations: tuple[tuple[str, str | None, str], ...] = ()
    hf_token_secret: str | None = None
    s3_secret: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    hf_cache_pvc: str | None = None
    kueue_queue: str | None = None
    do_not_disrupt: bool = False
    worker: WorkerInvocation = field(
        default_factory=lambda: WorkerInvocation(MODEL, log_format="json"))

    @property
    def instance(self) -> str:
        return self.sweep_name or self.run_id

    def problems(self) -> list[str]:
        """Every problem with these settings, each naming its field (empty: usable)."""
        out: list[str] = []
        if not self.image or any(c.isspace() for c in self.image) or _CONTROL.search(self.image):
            out.append(f"image: {self.image!r} is not an image reference")
        if not is_dns_label(self.namespace):
            out.append(f"namespace: {self.namespace!r} is not a DNS-1123 label")
        for name, value in (("run_id", self.run_id), ("sweep_name", self.sweep_name)):
            if value is not None and not (value and is_label_value(value)):
                out.append(f"{name}: {value!r} is not a valid label value "
                           "(≤ 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends)")
        if isinstance(self.gpus_per_job, bool) or not isinstance(self.gpus_per_job, int) \
                or self.gpus_per_job < 0:
            out.append(f"gpus_per_job: {self.gpus_per_job!r} must be an integer ≥ 0")
        if not is_extended_resource(self.gpu_resource):
            out.append(f"gpu_resource: {self.gpu_resource!r} is not an extended resource "
                       "name (DOMAIN/NAME, e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb)")
        for name, quantity in (
            ("cpu_request", self.cpu_request), ("memory_request", self.memory_request),
            ("memory_limit", self.memory_limit),
            ("ephemeral_storage_request", self.ephemeral_storage_request),
        ):
            problem = None if quantity is None else quantity_problem(name, quantity)
            if problem:
                out.append(problem)
        for name, number, low in (
            ("backoff_limit", self.backoff_limit, 0),
            ("active_deadline_s", self.active_deadline_s, 1),
            ("ttl_after_finished_s", self.ttl_after_finished_s, 0),
        ):
            if number is not None and (isinstance(number, bool) or not isinstance(number, int)
                                       or number < low):
                out.append(f"{name}: {number!r} must be an integer ≥ {low}")
        for key, value in self.node_selector.items():
            if not is_label_key(key):
                out.append(f"node_selector: {key!r} is not a label key")
            if not isinstance(value, str) or not is_label_value(value):
                out.append(f"node_selector: value {value!r} of {key!r} is not a label value")
        for name, value in (
            ("priority_class", self.priority_class), ("service_account", self.service_account),
            ("s3_secret", self.s3_secret), ("hf_cache_pvc", self.hf_cache_pvc),
        ):
            if value is not None and not is_dns_subdomain(value):
                out.append(f"{name}: {value!r} is not a DNS-1123 subdomain name")
        for secret in self.image_pull_secrets:
            if not is_dns_subdomain(secret):
                out.append(f"image_pull_secrets: {secret!r} is not a DNS-1123 subdomain name")
        for key, value, effect in self.tolerations:
            if not is_label_key(key):
                out.append(f"tolerations: {key!r} is not a taint key")
            if value is not None and not is_label_value(value):
                out.append(f"tolerations: value {value!r} of {key!r} is not a taint value")
            if effect not in TAINT_EFFECTS:
                out.append(f"tolerations: effect {effect!r} of {key!r} is not one of "
                           + ", ".join(TAINT_EFFECTS))
        if self.hf_token_secret is not None:
            name, sep, key = self.hf_token_secret.partition(":")
            if not sep or not is_dns_subdomain(name) or not _SECRET_KEY.fullmatch(key):
                out.append(f"hf_token_secret: {self.hf_token_secret!r} must be "
                           "SECRET-NAME:KEY (e.g. hf-token:token)")
        out.extend(env_problems(self.env))
        if self.kueue_queue is not None and not (self.kueue_queue
                                                 and is_label_value(self.kueue_queue)):
            out.append(f"kueue_queue: {self.kueue_queue!r} is not a valid label value")
        # The worker's mode, target and store are each Job's (build_job, build_indexed_job).
        out.extend(f"worker: {p}" for p in self.worker.flag_problems())
        if self.worker.log_format is None:
            out.append("worker: log_format: must be given (json or text)")
        return out


def min_kubernetes() -> str:
    """MIN_KUBERNETES as people write it: "1.31"."""
    return ".".join(map(str, MIN_KUBERNETES))


def sweep_labels(settings: JobSettings) -> dict[str, str]:
    """The labels every worker Job of a run and its pods carry, per-model or sharded: the
    recommended app.kubernetes.io ones (name, instance, component, managed-by, part-of,
    version) and the run's."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        INSTANCE_LABEL: settings.instance,
        "app.kubernetes.io/component": COMPONENT, MANAGED_BY_LABEL: APP_NAME,
        "app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/version": version_label(),
        RUN_LABEL: settings.run_id,
    }


def labels_for(model_key: str, settings: JobSettings, attempt: int = 0) -> dict[str, str]:
    """The labels of a worker Job and its pods (selectable by run, model key, attempt)."""
    return {
        **sweep_labels(settings),
        MODEL_KEY_LABEL: model_key_label(model_key),
        ATTEMPT_LABEL: str(attempt),
    }


def pod_argv(settings: JobSettings, worker: WorkerInvocation) -> list[str]:
    """The worker container's argv, `esd-worker` and `worker`'s flags, one element per
    argument (never a shell string); a device the run left open is the pod's: cuda when
    it asks for GPUs, else cpu (the one place a Job's --device is decided)."""
    if worker.device is None:
        worker = worker.replace(device="cuda" if settings.gpus_per_job > 0 else "cpu")
    return worker.command()


def pod_failure_policy() -> dict[str, Any]:
    """How a failed worker pod counts (rules are tried in order, the first match wins).

    A disruption (preemption, API-initiated or node-pressure eviction, node drain, spot
    reclaim, node lost: the pod gets the DisruptionTarget condition) comes first, so a
    worker that happens to exit 2 or 3 while being killed is still retried, and without
    using up backoffLimit. An eviction for passing the cache volume's sizeLimit carries no
    DisruptionTarget and is counted like a crash: the worker's hard download budget is
    what prevents it. Exit 2 (usage) and 3 (permanent: not found, gated, unsupported) fail
    the Job at once: retrying cannot help. The retryable codes (4 transient, 5 GPU out of
    memory, 6 the node's GPU broken) count against backoffLimit like any other failure
    (OOMKilled, crashes): the next pod can land on another node or an idle GPU (time-slicing,
    MIG); the controller reads the exit code afterwards (a Job failed by 6 gets a new Job).
    """
    return {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": [EXIT_USAGE, EXIT_PERMANENT],
                },
            },
            {
                "action": "Count",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": sorted(c for c, (_, retry) in EXIT_CLASSES.items() if retry),
                },
            },
        ]
    }


def _resources(settings: JobSettings) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": settings.cpu_request, "memory": settings.memory_request}
    limits: dict[str, str] = {}
    if settings.ephemeral_storage_request:
        requests["ephemeral-storage"] = settings.ephemeral_storage_request
    # Every worker pod has a memory limit (its request unless one was given): a model that
    # leaks host memory gets its own container OOM-killed, which is charged to the model
    # in progress, instead of pressing the node into evicting its neighbours (an eviction
    # is a disruption, charged to nobody, so such a model would be retried without end).
    # The worker's own supervisor watches the model's memory below this limit.
    limits["memory"] = settings.memory_limit or settings.memory_request
    if settings.gpus_per_job > 0:
        # Extended resources cannot be overcommitted: request == limit.
        requests[settings.gpu_resource] = str(settings.gpus_per_job)
        limits[settings.gpu_resource] = str(settings.gpus_per_job)
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def pod_annotations(settings: JobSettings) -> dict[str, str]:
    """The worker pods' annotations: with do_not_disrupt, ask Karpenter and the cluster
    autoscaler not to consolidate the node away under a running worker (empty otherwise)."""
    if not settings.do_not_disrupt:
        return {}
    return {"karpenter.sh/do-not-disrupt": "true",
            "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def pod_spec(args: list[str], settings: JobSettings,
             affinity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The worker pod of every esd-sweep Job, per-model or sharded: `args` is the container's
    argv (no command, no shell), affinity None = wherever the scheduler finds room."""
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": settings.image,
        "args": args,
        "env": worker_env(gpus=settings.gpus_per_job, hf_token_secret=settings.hf_token_secret,
                          s3_secret=settings.s3_secret, env=settings.env),
        "resources": _resources(settings),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": "cache", "mountPath": CACHE_DIR},
        ],
        # The last log lines land in the pod status when the worker fails: the failure
        # record gets them without a log read.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    cache: dict[str, Any] = (
        {"name": "cache", "persistentVolumeClaim": {"claimName": settings.hf_cache_pvc}}
        if settings.hf_cache_pvc else {"name": "cache", "emptyDir": {}}
    )
    if settings.ephemeral_storage_request and "emptyDir" in cache:
        # Downloads that outgrow the pod's disk get it evicted instead of filling the node;
        # that eviction has no DisruptionTarget, so it is counted against the pod's retries:
        # the worker's hard download budget (the request less the headroom) prevents it.
        cache["emptyDir"]["sizeLimit"] = settings.ephemeral_storage_request
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # the worker never talks to the API server
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}, cache],
    }
    if settings.active_deadline_s is not None:
        # The pod's deadline, not the Job's: a Job's runs from its creation (or Kueue's
        # admission), so a pod waiting for a node or an autoscaler would use it up.
        spec["activeDeadlineSeconds"] = settings.active_deadline_s
    tolerations = [{"key": key, "operator": "Exists", "effect": effect} if value is None
                   else {"key": key, "operator": "Equal", "value": value, "effect": effect}
                   for key, value, effect in settings.tolerations]
    if settings.gpus_per_job > 0:
        tolerations.insert(0, {"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        spec["tolerations"] = tolerations
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.priority_class:
        spec["priorityClassName"] = settings.priority_class
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    if affinity:
        spec["affinity"] = copy.deepcopy(dict(affinity))
    return spec


def build_job(
    *,
    model_ref: str,
    model_key: str,
    relation: str,
    source_model: str | None,
    output_url: str,
    settings: JobSettings,
    attempt: int = 0,
    affinity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that analyses one model (a plain dict, ready for the API or YAML).

    model_ref: `id[@revision]` or a path, as the worker takes it; model_key: its store key
    (esd_worker.core.models.naming.model_key), which fixes the Job name; relation / source_model:
    the
    adapter's relation and base; output_url: the result store; attempt: 0 for the first
    submission, N for the Nth resubmission (name suffix -aN); affinity: the pod's affinity
    (e.g. nodes whose GPUs have room), None = anywhere the GPU request fits.
    Raises JobSpecError listing every problem with the settings and the model.
    """
    problems = list(settings.problems())
    check_ref("model_ref", model_ref, problems)
    if source_model is not None:
        check_ref("source_model", source_model, problems)
    check_ref("output_url", output_url, problems)
    if not isinstance(relation, str) or not _RELATION.fullmatch(relation):
        problems.append(f"relation: {relation!r} is not a relation name")
    try:
        name = job_name(model_key, attempt)
    except JobSpecError as e:
        problems.append(str(e))
    if problems:
        raise JobSpecError("; ".join(problems))

    model_id, revision = split_model_ref(model_ref)
    labels = labels_for(model_key, settings, attempt)
    annotations: dict[str, str] = {
        "esd-sweep/model-id": model_id,
        "esd-sweep/model-ref": model_ref,
        "esd-sweep/revision": revision or "",
        MODEL_KEY_LABEL: model_key,
        ATTEMPT_LABEL: str(attempt),
        "esd-sweep/relation": relation,
        OUTPUT_ANNOTATION: output_annotation(output_url),
    }
    if source_model:
        annotations["esd-sweep/source-model"] = source_model

    job_labels = dict(labels)
    if settings.kueue_queue:
        job_labels[KUEUE_QUEUE_LABEL] = settings.kueue_queue

    template_meta: dict[str, Any] = {"labels": dict(labels)}
    if settings.do_not_disrupt:
        template_meta["annotations"] = pod_annotations(settings)
    args = pod_argv(settings, settings.worker.for_model(
        model_ref, key=model_key, relation=relation, base_model=source_model,
    ).replace(output=output_url))
    spec: dict[str, Any] = {
        "backoffLimit": settings.backoff_limit,
        "podFailurePolicy": pod_failure_policy(),
        "template": {
            "metadata": template_meta,
            "spec": pod_spec(args, settings, affinity),
        },
    }
    return job_object(name, settings, job_labels, annotations, spec)


def job_object(name: str, settings: JobSettings, labels: Mapping[str, str],
               annotations: Mapping[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    """The batch/v1 Job around `spec`, with what every Job of a sweep shares: the TTL
    after it finishes, and suspend when Kueue admits it (by setting suspend: false)."""
    if settings.ttl_after_finished_s is not None:
        spec["ttlSecondsAfterFinished"] = settings.ttl_after_finished_s
    if settings.kueue_queue:
        spec["suspend"] = True
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": dict(labels),
                     "annotations": dict(annotations)},
        "spec": spec,
    }
