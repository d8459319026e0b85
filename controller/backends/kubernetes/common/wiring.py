"""What both Kubernetes modes build from the sweep's settings before they run anything.

Owns the wiring from SweepSettings to a Kubernetes backend's parts: every Job's settings
(sweep_job_settings, after checking the pods can reach the output), the model sizer
(sweep_sizer), the GPU rule's per-model counts (sweep_gpu_counts), the worker image read
from --worker-template's PodTemplate (with_template_image), the API server's version check
(check_server), and the API client a
backend uses and whether it owns it (client_for, open_client: the only place that imports
common.client, so the optional `kubernetes` package is needed only once a client is
opened). Does not run anything: the per_model and sharded backends do, each in its own way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.errors import sweep_errors
from controller.backends.kubernetes.common.jobs import MIN_KUBERNETES, JobSettings, min_kubernetes
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.errors import SweepError
from controller.gpu.counts import GpuCounts
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import ShapeFinder

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.settings import SweepSettings

log = logging.getLogger(__name__)

_VERSION = re.compile(r"v?(\d+)\.(\d+)")  # an API server's gitVersion: v1.31.4-eks-…


def sweep_job_settings(settings: SweepSettings, spec: WorkerSpec) -> JobSettings:
    """How every Job of this run looks (checking first that pods can reach the output,
    unless nothing will be created: --dry-run)."""
    if not settings.dry_run:
        check_output(settings)
    gpus = 0 if settings.device == "cpu" else max(settings.gpu.gpus_per_job, 0)
    return settings.cluster.job_settings(
        run_id=spec.run_id, instance=sweep_instance(spec.store_url), gpus_per_job=gpus,
        worker=spec.invocation())


def sweep_gpu_counts(settings: SweepSettings, sizer: Sizer,
                     job_settings: JobSettings) -> GpuCounts | None:
    """The GPU rule over model shapes (found through `sizer`, the run's sizes' lookups) for
    this run's GPU Jobs, at most --max-gpus-per-job each; None: every Job asks for the run's
    count (CPU Jobs, an explicit --gpus-per-job, --no-parallel-gpu)."""
    rule = settings.applied_gpu_rule
    if job_settings.gpus_per_job == 0 or not rule.splits(rule.max_gpus_per_job):
        return None
    return GpuCounts(rule, ShapeFinder(sizer, rule), rule.max_gpus_per_job)


def sweep_sizer(cluster: ClusterSettings) -> Sizer:
    """Model sizes for requests and shards: from the list's size_bytes column, local files
    or the hub's metadata. Hub lookups are about a minute's worth at the sweep's hub rate,
    then the estimate (a size_bytes column makes them unnecessary)."""
    return Sizer(rate_per_s=cluster.hub_rate, lookup_limit=max(100, int(cluster.hub_rate * 60)))


@contextmanager
def client_for(settings: SweepSettings,
               kube: KubeClient | None) -> Iterator[tuple[KubeClient | None, bool]]:
    """(the client a backend uses, whether the backend owns it): `kube` when given, none
    for a dry run, else one from the kubeconfig, closed again if the backend fails to build."""
    own = kube is None and not settings.dry_run
    if own:
        kube = open_client(settings.cluster.kube_context)
    try:
        yield kube, own
    except BaseException:
        if own and kube is not None:
            kube.close()
        raise


def check_output(settings: SweepSettings) -> None:
    """The pods must reach the store: object storage, or a shared volume when allowed."""
    url = settings.output
    remote = "://" in url and not url.startswith("file://")
    if not remote and not settings.cluster.allow_local_output:
        raise SweepError(
            f"--output-dir {url}: the kubernetes backend needs a store the pods can reach "
            "(s3://bucket/prefix); pass --allow-local-output if this path is a volume "
            "mounted at the same path in every pod"
        )


def open_client(context: str | None) -> KubeClient:
    """The client for a kubeconfig context (None: the current one, or in-cluster)."""
    try:
        from controller.backends.kubernetes.common import client  # the optional [kube] extra
    except ImportError as e:
        raise SweepError(
            f"--backend kubernetes needs the Kubernetes client ({e}): "
            "pip install 'esd-sweep[kube]'"
        ) from e
    with sweep_errors():
        return client.load_client(context)


def with_template_image(settings: SweepSettings, job_settings: JobSettings,
                        kube: KubeClient | None) -> tuple[ClusterSettings, JobSettings]:
    """The cluster and Job settings with --worker-template's image in place of --image (both
    unchanged without the flag). The image is read when the run starts, not baked into the
    controller's arguments: kustomize's `images:` rewrites the PodTemplate in whichever
    kustomization names it (the base's or a user's overlay), and the controller's own args
    are out of its reach. A dry run has no client (kube None): it opens one for this one
    read and closes it, because the Jobs it prints should be the ones the run would create,
    image included, and a read changes nothing on the cluster; without a cluster, give
    --image instead."""
    cluster = settings.cluster
    name = cluster.worker_template
    if name is None:
        return cluster, job_settings
    if kube is None:
        with open_client(cluster.kube_context) as reader, sweep_errors():
            template = reader.read_pod_template(cluster.namespace, name)
    else:
        with sweep_errors():
            template = kube.read_pod_template(cluster.namespace, name)
    where = f"PodTemplate {name} in namespace {cluster.namespace} (--worker-template)"
    if template is None:
        raise SweepError(f"PodTemplate {name} not found in namespace {cluster.namespace} "
                         "(--worker-template): apply the manifests, or give --image")
    image = template_image(template)
    if image is None:
        raise SweepError(f"{where} has no image (a container named worker, or its only "
                         "container, with an image): fix the manifests, or give --image")
    log.info("worker image %s (from %s)", image, where)
    return replace(cluster, image=image), replace(job_settings, image=image)


def template_image(template: Mapping[str, Any]) -> str | None:
    """The image of a PodTemplate's container named `worker`, else of its only container."""
    spec = ((template.get("template") or {}).get("spec") or {})
    containers = [c for c in spec.get("containers") or () if isinstance(c, dict)]
    chosen = [c for c in containers if c.get("name") == "worker"] or (
        containers if len(containers) == 1 else [])
    image = chosen[0].get("image") if chosen else None
    return image.strip() or None if isinstance(image, str) else None


def check_server(kube: KubeClient) -> None:
    """Refuse an API server older than jobs.MIN_KUBERNETES, in one line (both modes: the
    Jobs use podFailurePolicy, and shards backoffLimitPerIndex)."""
    with sweep_errors():
        too_old = server_too_old(kube.server_version())
    if too_old:
        raise SweepError(too_old)


def server_too_old(git_version: str) -> str | None:
    """Why an API server of `git_version` (its /version gitVersion, e.g. v1.28.3-eks-abc)
    cannot run the sweep's Jobs, in one line; None when it can or the version does not parse
    (an odd build string must not block a run the server may well accept)."""
    match = _VERSION.match(git_version.strip()) if isinstance(git_version, str) else None
    if match is None:
        return None
    found = (int(match[1]), int(match[2]))
    if found >= MIN_KUBERNETES:
        return None
    shown = re.sub(r"[^\x21-\x7e]", "?", git_version.strip())[:64]
    return (f"Kubernetes {shown} is too old: esd-sweep needs Kubernetes "
            f"{min_kubernetes()} or newer (podFailurePolicy, Indexed Jobs with "
            "backoffLimitPerIndex); upgrade the cluster")
