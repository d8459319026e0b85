"""Everything `esd-sweep run` and `status` were asked to do (built by controller.cli).

Holds each backend's own settings beside the ones every backend shares; validation of each
part lives with the part (GpuSettings.validate, LocalSettings.validate,
ClusterSettings.problems), and controller.cli reports every problem at once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.local.settings import LocalSettings
from controller.gpu.gpurule import GpuRule
from controller.gpu.gpus import GpuSettings
from controller.output.lease import LEASE_TTL_S
from esd_worker.core.command.flags import PREFETCH
from esd_worker.core.command.settings import AnalysisSettings


@dataclass(frozen=True)
class SweepSettings:
    """Everything `esd-sweep run` was asked to do (built in controller.cli from flags + env).

    output: result store URL (directory, file://, s3://bucket/prefix).
    model_list / single_model: where the models come from (exactly one is set), or
    commands: a file of command lines (custom mode: run them under the same GPU management).
    device: auto (GPUs when NVML sees any, else CPU), cpu, or cuda (GPUs required).
    reanalyse: analyse results whose parameters differ only in the fit (by default they are
    refitted in place from their eigenvalues: controller.run.refitrun).
    worker_cmd: how to start one worker; argv list, the model flags are appended.
    backend: "local" (workers on this machine; `local`, `gpu`) or "kubernetes" (Jobs;
    `cluster`). dry_run: print what would be started (commands or Jobs), start nothing.
    prefetch / cache_budget / cache_dir: the long-lived workers' read-ahead (models, bytes)
    and their own download directory (esd-worker --prefetch, --cache-budget, --cache-dir).
    model_timeout: the floor of a model's no-progress limit in a long-lived worker, seconds
    (--model-timeout; None: esd_worker.core.watchdog's default).
    summary: rebuild summary.csv at the end (it reads every done model's marker: a list of
    millions may leave it to a later `esd-sweep report`).
    wait_lock_s: when another sweep holds the output (controller.output.lease), seconds to wait for
    it (math.inf: as long as it takes); None: exit 2 at once. lease_ttl_s: seconds an S3
    lease lives unrenewed (renewed every third of it); not a flag: every sweep on one output
    must agree on it.
    parallel_gpu: a worker with several GPUs spreads one model's layers over them (False:
    --no-parallel-gpu, one GPU used whatever it is given). host_eigensolvers: each GPU
    worker's host eigensolver threads (--host-eigensolvers; None: the worker's default).
    gpu_rule: GPUs per model (controller.gpu.gpurule: --gpus-per-job N|auto,
    --multi-gpu-minutes, --max-gpus-per-job); backends apply `applied_gpu_rule`, its
    `parallel` being parallel_gpu. gpu.gpus_per_job is its explicit N, or 1 with auto (what
    the tracker checks against and custom commands get).
    metrics_port / metrics_address: where the run serves its Prometheus metrics while it
    runs (controller.metrics; port 0: not served).
    """

    output: str
    model_list: str | Path | None = None
    single_model: str | None = None
    single_relation: str = ""
    single_source: str | None = None
    commands: Path | None = None
    limit: int | None = None
    strict: bool = False
    overwrite: bool = False
    reanalyse: bool = False
    skip_failed: bool = False
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)
    device: str = "auto"
    gpu: GpuSettings = field(default_factory=GpuSettings)
    local: LocalSettings = field(default_factory=LocalSettings)
    log_dir: Path | None = None
    save_eigs: bool = True
    trust_remote_code: bool = False
    worker_log_format: str = "text"
    worker_cmd: tuple[str, ...] = field(
        default_factory=lambda: (sys.executable, "-m", "esd_worker.cli")
    )
    backend: str = "local"
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    dry_run: bool = False
    prefetch: int = PREFETCH
    cache_budget: int | None = None
    cache_dir: str | None = None
    model_timeout: float | None = None
    summary: bool = True
    wait_lock_s: float | None = None
    lease_ttl_s: float = LEASE_TTL_S
    parallel_gpu: bool = True
    host_eigensolvers: int | None = None
    gpu_rule: GpuRule = field(default_factory=GpuRule)
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"

    @property
    def applied_gpu_rule(self) -> GpuRule:
        """gpu_rule as the backends apply it: --no-parallel-gpu makes auto give 1."""
        return replace(self.gpu_rule, parallel=self.parallel_gpu)
