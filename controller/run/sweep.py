"""One sweep end to end: model list → plan → backend → records, summary.csv and the run report.

Owns the order of a run and its exit status. Knows no backend: `open_backend` picks one by
name and every backend takes the same Tasks and gives the same Outcomes
(controller.backends.base). Custom-commands mode (`run_commands`) runs a file of commands
under the local backend's GPU management instead of the model list.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from controller import __version__
from controller.backends import open_backend
from controller.backends.base import Backend, Task, Work, WorkerSpec
from controller.errors import (
    EXIT_ALL_DONE,
    EXIT_INFRA,
    EXIT_INTERRUPTED,
    EXIT_SOME_FAILED,
    InfrastructureError,
    SweepError,
)
from controller.metrics.runmetrics import RunMetrics
from controller.metrics.server import run_endpoint
from controller.output.lease import output_lease
from controller.output.tenure import Tenure
from controller.progress import Progress
from controller.results.failurelist import FailureList
from controller.results.summary import KnownMarkers, write_summary
from controller.run.commands import read_commands
from controller.run.plan import ListPlan
from controller.run.recorder import Recorder
from controller.run.refitrun import RefitTally, fit_only, refit_planned
from controller.run.runs import last_bad_nodes, new_run_id, run_report, write_run_report
from controller.settings import SweepSettings
from esd_worker.core.errors import StorePathError, UsageError
from esd_worker.core.models.modellist import (
    FolderWarnings,
    ListFile,
    ModelRow,
    RowProblem,
    bad_rows_log,
    make_single,
)
from esd_worker.core.store.layout import SUMMARY_KEY, run_report_key
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.records import FailureRecord, utc_now
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

BackendOpener = Callable[[SweepSettings, WorkerSpec], Backend]


@dataclass
class SweepResult:
    """What a sweep did; `exit_code` follows controller.errors' EXIT_* contract."""

    run_id: str
    exit_code: int
    report: dict[str, Any]


def run_sweep(
    settings: SweepSettings,
    *,
    on_plan: Callable[[ListPlan], None] | None = None,
    opener: BackendOpener = open_backend,
    out: TextIO | None = None,
) -> SweepResult:
    """Run the sweep as configured; never raises for a single model's failure.

    opener: builds the backend (tests inject one). out: where --dry-run prints (stdout).
    """
    started = _Started()
    with _metrics(settings, started.run_id) as metrics:  # bound first: in use → exit 2
        store = _open_store(settings.output, writing=True)
        with output_lease(store, command="esd-sweep run", run_id=started.run_id,
                          wait_s=settings.wait_lock_s, take=not settings.dry_run,
                          ttl_s=settings.lease_ttl_s) as tenure:
            started.restart()
            return _sweep(settings, store, started, tenure, on_plan=on_plan, opener=opener,
                          out=out, metrics=metrics)


def _metrics(settings: SweepSettings, run_id: str) -> AbstractContextManager[RunMetrics | None]:
    """The run's metrics endpoint (--metrics-port; none for a dry run, which runs nothing)."""
    return run_endpoint(run_id=run_id, backend=settings.backend, version=__version__,
                        port=0 if settings.dry_run else settings.metrics_port,
                        address=settings.metrics_address)


def _sweep(settings: SweepSettings, store: Store, started: _Started, tenure: Tenure, *,
           on_plan: Callable[[ListPlan], None] | None, opener: BackendOpener,
           out: TextIO | None, metrics: RunMetrics | None) -> SweepResult:
    """run_sweep once the output is this sweep's (controller.output.lease), until it is not."""
    source = model_source(settings)
    try:
        known = KnownMarkers()  # the done markers the plan reads: summary.csv reuses them
        plan = plan_models(settings, store, source.items, on_done=known.add)
        counts = plan.counts
        log.info("%d model(s): %d done already, %d to run (%d with other parameters, %d "
                 "damaged; %d of them to refit from their eigenvalues), %d skipped for a "
                 "permanent failure record, %d bad row(s)",
                 counts.models, counts.done, counts.todo, counts.stale, counts.damaged,
                 counts.refit, counts.skipped_failed, counts.bad_rows)
        if on_plan is not None:
            on_plan(plan)
        refits = RefitTally() if settings.dry_run else refit_planned(
            store, plan, settings.analysis.as_dict(), tenure=tenure)
        backend = opener(settings, worker_spec(settings, started.run_id, store.url))
        work = PlannedWork(plan)
        if settings.dry_run:
            return _dry_run(backend, work, plan, started.run_id, store.url, out or sys.stdout)
        recorder = Recorder(store, started.run_id)
        interrupted = execute(backend, work, recorder, tenure, metrics)
        summary_rows = 0 if not settings.summary or tenure.lost else write_summary(
            store, plan.rows(), parameters=settings.analysis.as_dict(), known=known)
    finally:
        source.close()
    result = _finish(settings, store, started, backend, recorder,
                     _counts(plan) | {"refitted": refits.refitted,
                                      "refit_analysed": refits.analysed},
                     mode="esd", summary_rows=summary_rows, interrupted=interrupted,
                     tenure=tenure)
    log.info("run %s: %d done, %d failed, %d cancelled, %d already done, %d refitted; report "
             "%s%s", started.run_id, recorder.done_count, recorder.failed_count,
             len(recorder.cancelled), counts.done, refits.refitted,
             run_report_key(started.run_id),
             f", {SUMMARY_KEY} ({summary_rows} models)" if summary_rows else "")
    return result


def run_commands(settings: SweepSettings) -> SweepResult:
    """Custom-commands mode: each line of settings.commands under the local GPU management.

    No model list, no plan and no summary: the commands' outcomes go in the run report.
    """
    assert settings.commands is not None
    started = _Started()
    with _metrics(settings, started.run_id) as metrics:
        store = _open_store(settings.output, writing=True)
        with output_lease(store, command="esd-sweep run", run_id=started.run_id,
                          wait_s=settings.wait_lock_s, ttl_s=settings.lease_ttl_s) as tenure:
            started.restart()
            return _run_commands(settings, store, started, tenure, metrics)


def _run_commands(settings: SweepSettings, store: Store, started: _Started,
                  tenure: Tenure, metrics: RunMetrics | None) -> SweepResult:
    """run_commands once the output is this sweep's (controller.output.lease)."""
    assert settings.commands is not None
    try:
        tasks = read_commands(settings.commands)
    except (OSError, ValueError) as e:
        raise SweepError(f"--commands {settings.commands}: {e}") from e
    log.info("custom mode: %d command(s) from %s", len(tasks), settings.commands)
    backend = open_backend(settings, worker_spec(settings, started.run_id, store.url))
    recorder = Recorder(store, started.run_id)
    interrupted = execute(backend, tasks, recorder, tenure, metrics)
    counts = {"models": len(tasks), "bad_rows": 0, "already_done": 0, "skipped_failed": 0}
    return _finish(settings, store, started, backend, recorder, counts, mode="custom",
                   summary_rows=0, interrupted=interrupted, tenure=tenure)


def worker_spec(settings: SweepSettings, run_id: str, store_url: str) -> WorkerSpec:
    """What every worker of this run computes and where it writes."""
    return WorkerSpec(
        run_id=run_id, store_url=store_url, analysis=settings.analysis,
        save_eigs=settings.save_eigs, trust_remote_code=settings.trust_remote_code,
        log_format=settings.worker_log_format, device=settings.device,
        gpus_per_job=settings.gpu.gpus_per_job, max_retries=settings.local.max_retries,
        overwrite=settings.overwrite, prefetch=settings.prefetch,
        cache_budget=settings.cache_budget, cache_dir=settings.cache_dir,
        parallel_gpu=settings.parallel_gpu, model_timeout=settings.model_timeout,
        host_eigensolvers=settings.host_eigensolvers,
    )


class PlannedWork:
    """The plan's models to analyse as the backends' Work: counted once, read again from
    the list each time it is iterated."""

    def __init__(self, plan: ListPlan) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return self.plan.counts.to_analyse

    def __iter__(self) -> Iterator[Task]:
        return (Task.for_model(row) for row in self.plan.todo())


class _Single:
    """--single-model as a model source (one row, or the problem with it)."""

    def __init__(self, settings: SweepSettings) -> None:
        self.models = make_single(str(settings.single_model),
                                  relation=settings.single_relation,
                                  source_model=settings.single_source)

    def items(self) -> Iterator[ModelRow | RowProblem]:
        return iter([*self.models.problems, *self.models.rows])

    def close(self) -> None:
        pass


def model_source(settings: SweepSettings) -> ListFile | _Single:
    """Where the models come from: the list (read as a stream) or --single-model."""
    if settings.single_model:
        return _Single(settings)
    if settings.model_list is None:
        raise SweepError("give --model-list FILE or --single-model ID")
    return ListFile(settings.model_list)


def plan_models(settings: SweepSettings, store: Store,
                items: Callable[[], Iterable[ModelRow | RowProblem]], *,
                skip_failed: bool | None = None,
                on_done: Callable[[Marker], None] | None = None,
                on_problem: Callable[[RowProblem], None] | None = None,
                on_failure: Callable[[str, FailureRecord], None] | None = None) -> ListPlan:
    """The plan of the listed models against the store. Bad rows: each given to
    on_problem; by default the first few logged one line each, then one line that
    counts the rest (esd_worker.core.models.modellist.bad_rows_log); hub ids that are also
    folders here are warned of the same way (modellist.FolderWarnings).
    on_done: given each marker the plan read and found done; on_failure: each record of a
    listed model not done, with skip_failed (ListPlan)."""
    shown = bad_rows_log(lambda line: log.error("%s", line))
    folders = FolderWarnings(lambda line: log.warning("%s", line))
    parameters = settings.analysis.as_dict()
    plan = ListPlan(
        items, store, parameters, overwrite=settings.overwrite,
        skip_failed=settings.skip_failed if skip_failed is None else skip_failed,
        limit=settings.limit, on_problem=on_problem or shown, on_done=on_done,
        on_row=folders, on_failure=on_failure,
        refittable=None if settings.reanalyse else fit_only(parameters)).scan()
    shown.close()
    folders.close()
    if plan.counts.bad_rows and settings.strict:
        raise SweepError(
            f"{plan.counts.bad_rows} bad row(s) in the model list and --strict is set: "
            "nothing was started"
        )
    if plan.counts.duplicates:
        log.info("%d duplicate row(s) ignored (same id and revision)", plan.counts.duplicates)
    return plan


def models_status(settings: SweepSettings, *,
                  on_problem: Callable[[RowProblem], None] | None = None,
                  failures: FailureList | None = None) -> dict[str, Any]:
    """What `esd-sweep status` prints: done / to do / failed for the list against the store.
    on_problem: given every bad row (`status --bad-rows`) instead of the capped log.
    failures: given the record of every listed model that is not done (read as the plan
    reads them, a batch at a time), to list them."""
    store = _open_store(settings.output, writing=False)
    source = model_source(settings)
    try:
        counts = plan_models(settings, store, source.items, skip_failed=True,
                             on_problem=on_problem,
                             on_failure=failures.add if failures is not None else None).counts
    finally:
        source.close()
    status: dict[str, Any] = {
        "models": counts.models,
        "bad_rows": counts.bad_rows,
        "done": counts.done,
        "todo": counts.todo,
        "stale": counts.stale,
        "damaged": counts.damaged,
        "failed_permanent": counts.skipped_failed,
    }
    if counts.refit:  # of stale: only fit settings differ, `run` refits them in place
        status["refittable"] = counts.refit
    bad_nodes = last_bad_nodes(store)
    if bad_nodes is not None:  # the latest run met broken GPUs: quarantine them
        status["bad_nodes"] = bad_nodes
    return status


def _counts(plan: ListPlan) -> dict[str, int]:
    c = plan.counts
    return {"models": c.models, "bad_rows": c.bad_rows, "already_done": c.done,
            "skipped_failed": c.skipped_failed}


def execute(backend: Backend, tasks: Work, recorder: Recorder,
            tenure: Tenure | None = None, metrics: RunMetrics | None = None) -> bool:
    """Run the tasks on the backend under Ctrl+C handling; True when interrupted.

    tenure: when the output's lease is lost, the recorder stops writing and the backend
    gets a stop request (no task starts; those running finish, as after one Ctrl+C); the
    backend checks it as it starts each task (Backend.guard), so none starts after the loss
    is known.
    metrics: follows the progress and the recorder's verdicts (--metrics-port)."""
    progress = Progress(len(tasks))
    if metrics is not None:
        metrics.plan(len(tasks))
        progress.observe(metrics)
        recorder.on_end = metrics.ended
    if tenure is not None:
        tenure.when_lost(lambda: _lease_lost(backend, recorder))
        backend.guard(tenure)
    try:
        with _Interrupts(backend) as interrupts:
            backend.run(tasks, recorder, progress)
        return interrupts.count > 0
    finally:
        progress.close()
        backend.close()


def _lease_lost(backend: Backend, recorder: Recorder) -> None:
    recorder.stop_writing()
    log.error("stopping: the output is another sweep's now; no task starts, the running ones "
              "finish, and nothing more is recorded (exit 3)")
    backend.request_stop()


class _Started:
    """When and as what run the sweep started."""

    def __init__(self) -> None:
        self.clock = time.perf_counter()
        self.at = utc_now()
        self.run_id = new_run_id()

    def restart(self) -> None:
        """The run starts now, once the output is its own (--wait-lock may have waited);
        its id, in the lease record already, stays."""
        self.clock = time.perf_counter()
        self.at = utc_now()


def _open_store(url: str, *, writing: bool) -> Store:
    """The result store at `url`; when `writing`, checked (Store.check) before any worker
    starts: an output no worker could write to would fail every model, each after its
    download."""
    try:
        store = open_store(url)
    except UsageError as e:  # a URL to fix (2), credentials in it too; never echoes them
        raise SweepError(f"--output-dir: {e}") from e
    except Exception as e:  # the store's own errors are already clear; keep them one line
        raise InfrastructureError(f"cannot open the result store {url}: {e}") from e
    if writing:
        try:
            store.check()
        except StorePathError as e:
            # A local folder that is a file, lies under one or is not ours: the user's to
            # fix (2). A store that fails its check otherwise (S3 unreachable, no such
            # bucket, access denied) stays infrastructure (3, controller.errors).
            raise SweepError(f"--output-dir: {e}") from e
    return store


def _finish(
    settings: SweepSettings, store: Store, started: _Started, backend: Backend,
    recorder: Recorder, counts: dict[str, int], *, mode: str, summary_rows: int,
    interrupted: bool, tenure: Tenure,
) -> SweepResult:
    """Write the run report (its own key: written even once the lease is lost) and decide
    the exit status."""
    report = run_report(
        run_id=started.run_id, started_at=started.at, finished_at=utc_now(), output=store.url,
        mode=mode, backend=backend.name, backend_report=backend.report(),
        parameters=settings.analysis.as_dict(), counts=counts, tally=recorder,
        summary_rows=summary_rows, runtime_s=time.perf_counter() - started.clock,
        interrupted=interrupted,
    )
    if tenure.lost:
        report["lease_lost"] = True
    write_run_report(store, started.run_id, report)
    if tenure.lost:
        code = EXIT_INFRA
    elif interrupted:
        code = EXIT_INTERRUPTED
    elif recorder.failed_count or counts["bad_rows"]:
        code = EXIT_SOME_FAILED
    else:
        code = EXIT_ALL_DONE
    return SweepResult(run_id=started.run_id, exit_code=code, report=report)


def _dry_run(backend: Backend, work: Work, plan: ListPlan, run_id: str, store_url: str,
             out: TextIO) -> SweepResult:
    """Print what the backend would start (commands or Jobs); start and write nothing."""
    try:
        started = backend.dry_run(work, out)
    finally:
        backend.close()
    counts = plan.counts
    log.info("--dry-run: %d printed, nothing started (%d already done); %d model(s) would be "
             "analysed and %d refitted from their stored eigenvalues (only fit settings "
             "changed; --reanalyse analyses them too)", started, counts.done,
             counts.to_analyse, counts.refit)
    report = {
        "run_id": run_id, "output": store_url, "backend": backend.name, "dry_run": True,
        "counts": {"models": counts.todo + counts.done + counts.skipped_failed,
                   "already_done": counts.done, "jobs": started, "done": 0,
                   "failed": 0, "bad_rows": 0, "to_analyse": counts.to_analyse,
                   "to_refit": counts.refit},
        "failures": {}, "summary": None,
    }
    return SweepResult(run_id=run_id, exit_code=EXIT_ALL_DONE, report=report)


class _Interrupts:
    """SIGINT/SIGTERM while running: each one is a stop request to the backend, which says
    what it does (the local backend: first stop dispatching, second terminate)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
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
        print(f"\n{self.backend.stop_notice(self.count)}", file=sys.stderr)
        self.backend.request_stop()
