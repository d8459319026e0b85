"""What both Kubernetes modes build from the sweep's settings before they run anything.

Owns the wiring from SweepSettings to a Kubernetes backend's parts: every Job's settings
(sweep_job_settings, after checking the pods can reach the output), the model sizer
(sweep_sizer), the GPU rule's per-model counts (sweep_gpu_counts), and the API client a
backend uses and whether it owns it (client_for, open_client: the only place that imports
common.client, so the optional `kubernetes` package is needed only once a client is
opened). Does not run anything: the per_model and sharded backends do, each in its own way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.errors import sweep_errors
from controller.backends.kubernetes.common.jobs import JobSettings
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.errors import SweepError
from controller.gpu.counts import GpuCounts
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import ShapeFinder

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.settings import SweepSettings


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
