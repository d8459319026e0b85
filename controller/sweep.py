"""One sweep end to end: model list → plan → local workers → records, summary and run report."""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from controller.backends.kubernetes.client import KubeClient

from controller.backends.kubernetes.backend import ClusterBackend, sweep_instance
from controller.backends.local import (
    LocalBackend,
    LogDirError,
    Outcome,
    Task,
    read_commands,
)
from controller.errors import (  # noqa: F401  (re-exported until the CLI moves)
    EXIT_ALL_DONE,
    EXIT_INFRA,
    EXIT_INTERRUPTED,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    InfrastructureError,
    SweepError,
)
from controller.gpus import GpuTracker, open_nvml
from controller.modellist import ModelList, ModelRow, make_single, read_model_list
from controller.plan import Plan, plan_run
from controller.progress import Progress
from controller.records import FailureRecord, clear_failure, redact, write_failure
from controller.results.summary import write_summary
from controller.runs import new_run_id, write_run_report
from controller.settings import SweepSettings
from esd_worker.flags import analysis_argv
from esd_worker.store import MARKER_NAME, Store, open_store

log = logging.getLogger(__name__)

@dataclass
class SweepResult:
    """What a sweep did; `exit_code` follows the EXIT_* contract."""

    run_id: str
    exit_code: int
    report: dict[str, Any]


def load_models(settings: SweepSettings) -> ModelList:
    """The model list (or the single model), with bad rows reported one line each."""
    if settings.single_model:
        models = make_single(
            settings.single_model,
            relation=settings.single_relation,
            source_model=settings.single_source,
        )
    elif settings.model_list is not None:
        models = read_model_list(settings.model_list, limit=settings.limit)
    else:
        raise SweepError("give --model-list FILE or --single-model ID")
    for problem in models.problems:
        log.error("%s", problem)
    if models.problems and settings.strict:
        raise SweepError(
            f"{len(models.problems)} bad row(s) in the model list and --strict is set: "
            "nothing was started"
        )
    if models.duplicates:
        log.info("%d duplicate row(s) ignored (same id and revision)", models.duplicates)
    return models


def worker_argv(
    row: ModelRow, settings: SweepSettings, store_url: str, device: str
) -> tuple[str, ...]:
    """The worker's argv for one model: a list, never a shell string (ids are not trusted)."""
    argv = [
        *settings.worker_cmd,
        "--model", row.ref,
        "--output", store_url,
        "--model-key", row.key,
        "--device", device,
        "--log-format", settings.worker_log_format,
    ]
    if row.relation:
        argv += ["--relation", row.relation]
    if row.source_model:
        argv += ["--base-model", row.source_model]
    return tuple(argv + worker_flags(settings))


def worker_flags(settings: SweepSettings) -> list[str]:
    """The worker flags that do not depend on the model (analysis, eigenvalues, code)."""
    argv = analysis_argv(settings.analysis)
    if not settings.save_eigs:
        argv.append("--no-eigs")
    if settings.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def _open_tracker(settings: SweepSettings) -> GpuTracker | None:
    """A GPU tracker, or None for CPU mode (asked for, or no GPU visible)."""
    if settings.device == "cpu":
        log.info("device=cpu: running %d CPU worker(s) at a time", settings.local.cpu_workers)
        return None
    nvml = open_nvml()
    if nvml is None:
        if settings.device == "cuda":
            raise InfrastructureError(
                "--device cuda asked for, but NVML finds no GPU (driver missing?): "
                "use --device cpu to run on the CPU"
            )
        log.info(
            "no GPU found: running on the CPU with %d worker(s) at a time (--cpu-workers)",
            settings.local.cpu_workers,
        )
        return None
    try:
        tracker = GpuTracker(nvml, settings.gpu)
    except ValueError as e:
        nvml.close()
        raise SweepError(str(e)) from e
    log.info(
        "GPUs %s managed: free after %d checks under %g MiB, %d per job",
        ",".join(map(str, tracker.gpus)), settings.gpu.max_checks, settings.gpu.threshold_mib,
        settings.gpu.gpus_per_job,
    )
    return tracker


class _Stoppable(Protocol):
    def request_stop(self) -> None: ...


class _Interrupts:
    """SIGINT/SIGTERM while running: first stop dispatching, second terminate the workers."""

    def __init__(self, backend: _Stoppable, *, cluster: bool = False) -> None:
        self.backend = backend
        self.cluster = cluster
        self.count = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only (tests run sweeps in threads)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.cluster:
            print("\nstopping: no new Jobs; submitted Jobs keep running on the cluster "
                  "(the next run adopts them)", file=sys.stderr)
        elif self.count == 1:
            print(
                "\nstopping: no new models start; running workers finish "
                "(press Ctrl+C again to terminate them)",
                file=sys.stderr,
            )
        else:
            print("\nterminating running workers", file=sys.stderr)
        self.backend.request_stop()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class _Recorder:
    """Turns worker outcomes into store records as they arrive (the run loop's callback)."""

    def __init__(self, store: Store, run_id: str, rows: dict[str, ModelRow]) -> None:
        self.store = store
        self.run_id = run_id
        self.rows = rows
        self.durations: dict[str, float] = {}
        self.failed: dict[str, FailureRecord] = {}
        self.done: list[str] = []
        self.cancelled: list[str] = []
        self.waits: list[float] = []

    def __call__(self, outcome: Outcome) -> None:
        key = outcome.task.key
        row = self.rows.get(key)
        label = row.ref if row is not None else outcome.task.label
        self.waits.append(outcome.wait_s)
        if outcome.status == "cancelled":
            self.cancelled.append(key)
            log.info("model=%s key=%s cancelled (no result; the next run does it)", label, key)
            return
        error, retryable = outcome.error, outcome.retryable
        if outcome.status == "done" and row is not None and not self.store.exists(
            f"{key}/{MARKER_NAME}"
        ):
            # The worker said yes but the store disagrees: never count it done.
            error, retryable = "MarkerMissing: worker exited 0 but wrote no result.json", True
        elif outcome.status == "done":
            self.done.append(key)
            self.durations[key] = round(outcome.duration_s, 3)
            if row is not None:
                clear_failure(self.store, key)
            where = ",".join(map(str, outcome.gpus)) or "cpu"
            if outcome.log_path and outcome.log_path.startswith(("pod/", "job/")):
                where = outcome.log_path  # a Kubernetes Job
            log.info("model=%s key=%s done in %.1fs on %s", label, key, outcome.duration_s,
                     where)
            return
        record = FailureRecord(
            model=label,
            model_key=key,
            error=error,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            retryable=retryable,
            attempts=outcome.attempts,
            stderr_tail=tuple(outcome.stderr_tail),
            run_id=self.run_id,
            time=_now(),
        )
        self.failed[key] = record
        self.durations[key] = round(outcome.duration_s, 3)
        if row is not None:
            write_failure(self.store, record)
        tail = (line for line in reversed(outcome.stderr_tail) if line.strip())
        last = redact(next(tail, ""))  # records are redacted; this log line must be too
        log.error("model=%s key=%s failed after %d attempt(s): %s%s", label, key,
                  outcome.attempts, error, f" | {last}" if last else "")


def _tasks_for(plan: Plan, settings: SweepSettings, store_url: str, device: str) -> list[Task]:
    return [
        Task(key=row.key, argv=worker_argv(row, settings, store_url, device), label=row.ref)
        for row in plan.todo
    ]


def _check_cluster_output(settings: SweepSettings) -> None:
    """The pods must reach the store: object storage, or a shared volume when allowed."""
    url = settings.output
    remote = "://" in url and not url.startswith("file://")
    if not remote and not settings.cluster.allow_local_output:
        raise SweepError(
            f"--output-dir {url}: the kubernetes backend needs a store the pods can reach "
            "(s3://bucket/prefix); pass --allow-local-output if this path is a volume "
            "mounted at the same path in every pod"
        )


def _cluster_job_settings(settings: SweepSettings, run_id: str, store_url: str) -> Any:
    gpus = 0 if settings.device == "cpu" else settings.gpu.gpus_per_job
    return settings.cluster.job_settings(
        run_id=run_id, instance=sweep_instance(store_url), gpus_per_job=gpus,
        worker_args=worker_flags(settings), log_format=settings.worker_log_format,
    )


def _open_kube(settings: SweepSettings) -> KubeClient:
    try:
        from controller.backends.kubernetes import client as kube
    except ImportError as e:
        raise SweepError(
            f"--backend kubernetes needs the Kubernetes client ({e}): "
            "pip install 'esd-sweep[kube]'"
        ) from e
    try:
        return kube.load_client(settings.cluster.kube_context)
    except kube.KubeConfigError as e:
        raise SweepError(f"kubernetes: {e}") from e


def _cluster_error(e: Exception) -> SweepError | None:
    """A controller.backends.kubernetes.client error as the sweep error that says what to do (None: not one)."""
    try:
        from controller.backends.kubernetes import client as kube
    except ImportError:
        return None
    if isinstance(e, kube.KubePermissionError):
        return InfrastructureError(f"kubernetes: {e}")
    if isinstance(e, kube.KubeUnavailableError):
        return InfrastructureError(f"kubernetes API unreachable: {e}")
    if isinstance(e, kube.KubeConfigError):
        return SweepError(f"kubernetes: {e}")
    if isinstance(e, kube.KubeNotFoundError):
        return SweepError(f"kubernetes: {e} (does the namespace exist? --namespace)")
    if isinstance(e, kube.KubeInvalidError):
        return SweepError(f"kubernetes rejected a Job: {e}")
    if isinstance(e, kube.KubeError):
        return InfrastructureError(f"kubernetes: {e}")
    return None


def run_sweep(
    settings: SweepSettings,
    *,
    on_plan: Callable[[Plan], None] | None = None,
    kube: KubeClient | None = None,
    out: TextIO | None = None,
) -> SweepResult:
    """Run the sweep as configured; never raises for a single model's failure.

    kube: the Kubernetes client for backend "kubernetes" (default: from the kubeconfig
    context or the pod's service account). out: where --dry-run prints its YAML (stdout).
    """
    started = time.perf_counter()
    started_at = _now()
    run_id = new_run_id()
    cluster = settings.backend == "kubernetes"
    if cluster:
        if settings.commands is not None:
            raise SweepError("--mode custom runs on the local backend only")
        if not settings.dry_run:
            _check_cluster_output(settings)
    try:
        store = open_store(settings.output)
    except Exception as e:  # the store's own errors are already clear; keep them one line
        raise InfrastructureError(f"cannot open the result store {settings.output}: {e}") from e

    custom = settings.commands is not None
    if custom:
        assert settings.commands is not None
        try:
            tasks = read_commands(settings.commands)
        except (OSError, ValueError) as e:
            raise SweepError(f"--commands {settings.commands}: {e}") from e
        rows: dict[str, ModelRow] = {}
        plan = None
        problems = 0
        log.info("custom mode: %d command(s) from %s", len(tasks), settings.commands)
    else:
        models = load_models(settings)
        problems = len(models.problems)
        plan = plan_run(
            models.rows, store, settings.analysis.as_dict(),
            overwrite=settings.overwrite, skip_failed=settings.skip_failed,
        )
        rows = {row.key: row for row in models.rows}
        log.info(
            "%d model(s): %d done already, %d to run (%d with other parameters), "
            "%d skipped for a permanent failure record, %d bad row(s)",
            len(models.rows), len(plan.done), len(plan.todo), len(plan.stale),
            len(plan.skipped_failed), problems,
        )
        if on_plan is not None:
            on_plan(plan)
        tasks = []

    if cluster and settings.dry_run:
        assert plan is not None
        return _dry_run(settings, plan, store.url, run_id, out or sys.stdout)

    tracker = None
    if not cluster:
        tracker = _open_tracker(settings) if (custom or (plan and plan.todo)) else None
    device = "cpu" if tracker is None else "cuda"
    if cluster:
        device = "cpu" if settings.device == "cpu" or settings.gpu.gpus_per_job < 1 else "cuda"
    if plan is not None and not cluster:
        tasks = _tasks_for(plan, settings, store.url, device)

    recorder = _Recorder(store, run_id, rows)
    todo = len(plan.todo) if (cluster and plan is not None) else len(tasks)
    progress = Progress(todo)
    backend: LocalBackend | ClusterBackend
    own_kube = False
    interrupted = False
    try:
        if cluster:
            if kube is None:
                kube = _open_kube(settings)
                own_kube = True
            backend = ClusterBackend(
                settings.cluster, kube,
                job_settings=_cluster_job_settings(settings, run_id, store.url),
                output_url=store.url, gpus_per_job=0 if device == "cpu"
                else settings.gpu.gpus_per_job,
                max_retries=settings.local.max_retries,
                adopt_complete=not settings.overwrite,
                threshold_mib=settings.gpu.threshold_mib, max_checks=settings.gpu.max_checks,
                poll_interval_s=settings.gpu.poll_interval_s,
                on_outcome=recorder, progress=progress,
            )
        else:
            try:
                backend = LocalBackend(
                    settings.local, tracker, gpus_per_job=settings.gpu.gpus_per_job,
                    on_outcome=recorder, progress=progress,
                )
            except ValueError as e:  # e.g. --gpus-per-job larger than the usable GPUs
                raise SweepError(str(e)) from e
        with _Interrupts(backend, cluster=cluster) as interrupts:
            if isinstance(backend, ClusterBackend):
                assert plan is not None
                backend.run(plan.todo)
            else:
                backend.run(tasks)
            interrupted = interrupts.count > 0
    except LogDirError as e:
        raise SweepError(f"{e} (--log-dir)") from e
    except Exception as e:
        mapped = _cluster_error(e) if cluster else None
        if mapped is not None:
            raise mapped from e
        raise
    finally:
        progress.close()
        if tracker is not None:
            tracker.nvml.close()
        if own_kube and kube is not None:
            kube.close()

    summary_rows = 0
    if not custom:
        summary_rows = write_summary(
            store, list(rows.values()), parameters=settings.analysis.as_dict()
        )
    runtime = time.perf_counter() - started
    attempted = len(recorder.done) + len(recorder.failed)
    report: dict[str, Any] = {
        "run_id": run_id,
        "started_at": started_at,
        "finished_at": _now(),
        "output": store.url,
        "mode": "custom" if custom else "esd",
        "backend": settings.backend,
        "device": device,
        "gpus": list(tracker.gpus) if tracker is not None else [],
        "parameters": settings.analysis.as_dict(),
        "counts": {
            "models": len(rows) if not custom else len(tasks),
            "bad_rows": problems,
            "already_done": len(plan.done) if plan else 0,
            "skipped_failed": len(plan.skipped_failed) if plan else 0,
            "attempted": attempted,
            "done": len(recorder.done),
            "failed": len(recorder.failed),
            "cancelled": len(recorder.cancelled),
        },
        "success_rate": round(len(recorder.done) / attempted, 4) if attempted else None,
        "avg_wait_s": round(sum(recorder.waits) / len(recorder.waits), 3)
        if recorder.waits else None,
        "durations_s": recorder.durations,
        "failures": {
            key: {"model": r.model, "error": r.error, "exit_code": r.exit_code,
                  "retryable": r.retryable, "attempts": r.attempts}
            for key, r in recorder.failed.items()
        },
        "summary": "summary.csv" if summary_rows else None,
        "summary_rows": summary_rows,
        "total_runtime_s": round(runtime, 3),
        "interrupted": interrupted,
        "host": platform.node(),
        "pid": os.getpid(),
    }
    if isinstance(backend, ClusterBackend):
        report["counts"]["running"] = len(backend.left_running)
        report["kubernetes"] = {
            "namespace": settings.cluster.namespace,
            "instance": backend.instance,
            "image": settings.cluster.image,
            "placement": backend.placement,
            "jobs_created": backend.created,
            "jobs_adopted": backend.adopted,
            "jobs_left_running": backend.left_running,
            "pending": dict(backend.pending),
            "api_requests": backend.kube.requests,
            "waited": settings.cluster.wait,
        }
    write_run_report(store, run_id, report)
    if interrupted:
        code = EXIT_INTERRUPTED
    elif recorder.failed or problems:
        code = EXIT_SOME_FAILED
    else:
        code = EXIT_ALL_DONE
    log.info(
        "run %s: %d done, %d failed, %d cancelled, %d already done; report runs/%s.json%s",
        run_id, len(recorder.done), len(recorder.failed), len(recorder.cancelled),
        len(plan.done) if plan else 0, run_id,
        f", summary.csv ({summary_rows} models)" if summary_rows else "",
    )
    return SweepResult(run_id=run_id, exit_code=code, report=report)


def _dry_run(
    settings: SweepSettings, plan: Plan, store_url: str, run_id: str, out: TextIO
) -> SweepResult:
    """Print the Jobs the sweep would create (first attempts) as YAML; create nothing."""
    from controller.backends.kubernetes.jobs import JobSpecError, build_job, jobs_to_yaml

    job_settings = _cluster_job_settings(settings, run_id, store_url)
    jobs = []
    problems = []
    for row in plan.todo:
        try:
            jobs.append(build_job(
                model_ref=row.ref, model_key=row.key, relation=row.relation,
                source_model=row.source_model, output_url=store_url, settings=job_settings,
            ))
        except JobSpecError as e:
            problems.append(f"model={row.ref}: {e}")
    if problems:
        raise SweepError("; ".join(problems))
    if jobs:
        out.write(jobs_to_yaml(jobs))
    out.flush()
    log.info("--dry-run: %d Job(s) printed, nothing created (%d already done)",
             len(jobs), len(plan.done))
    report = {
        "run_id": run_id, "output": store_url, "backend": "kubernetes", "dry_run": True,
        "counts": {"models": len(plan.todo) + len(plan.done) + len(plan.skipped_failed),
                   "already_done": len(plan.done), "jobs": len(jobs), "done": 0,
                   "failed": 0, "bad_rows": 0},
        "failures": {}, "summary": None,
    }
    return SweepResult(run_id=run_id, exit_code=EXIT_ALL_DONE, report=report)


def format_summary_table(store: Store, limit: int = 20) -> str:
    """The first rows of summary.csv as an aligned text table, for people at a terminal."""
    import csv
    import io

    data = store.get_bytes("summary.csv")
    if not data:
        return "(no summary.csv yet)"
    rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
    cols = ["model_id", "relation", "layers", "alpha_mean", "alpha_median",
            "alpha_in_2_6_share", "stable_rank_mean", "log_spectral_norm_mean"]
    table = [cols] + [[_short(r.get(c, "")) for c in cols] for r in rows[:limit]]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
             for line in table]
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in summary.csv")
    return "\n".join(lines)


def _short(value: str) -> str:
    try:
        f = float(value)
    except ValueError:
        return value if len(value) <= 48 else "…" + value[-47:]
    return f"{f:.3f}" if not f.is_integer() else str(int(f))


def models_status(settings: SweepSettings) -> dict[str, Any]:
    """What `esd-sweep status` prints: done / to do / failed for the list against the store."""
    store = open_store(settings.output)
    models = load_models(settings)
    plan = plan_run(models.rows, store, settings.analysis.as_dict(), skip_failed=True)
    return {
        "models": len(models.rows),
        "bad_rows": len(models.problems),
        "done": len(plan.done),
        "todo": len(plan.todo),
        "stale": len(plan.stale),
        "failed_permanent": len(plan.skipped_failed),
    }
