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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from controller.backends import open_backend
from controller.backends.base import Backend, Task, WorkerSpec
from controller.backends.local import LocalBackend
from controller.commands import read_commands
from controller.errors import (
    EXIT_ALL_DONE,
    EXIT_INTERRUPTED,
    EXIT_SOME_FAILED,
    InfrastructureError,
    SweepError,
)
from controller.plan import Plan, plan_run
from controller.progress import Progress
from controller.recorder import Recorder
from controller.results.summary import write_summary
from controller.runs import new_run_id, run_report, write_run_report
from controller.settings import SweepSettings
from esd_worker.layout import SUMMARY_KEY, run_report_key
from esd_worker.modellist import ModelList, base_first, make_single, read_model_list
from esd_worker.records import utc_now
from esd_worker.store import Store, open_store

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
    on_plan: Callable[[Plan], None] | None = None,
    opener: BackendOpener = open_backend,
    out: TextIO | None = None,
) -> SweepResult:
    """Run the sweep as configured; never raises for a single model's failure.

    opener: builds the backend (tests inject one). out: where --dry-run prints (stdout).
    """
    started = _Started()
    store = _open_store(settings.output)
    models = load_models(settings)
    params = settings.analysis.as_dict()
    plan = plan_run(models.rows, store, params, overwrite=settings.overwrite,
                    skip_failed=settings.skip_failed)
    log.info("%d model(s): %d done already, %d to run (%d with other parameters), %d skipped "
             "for a permanent failure record, %d bad row(s)", len(models.rows), len(plan.done),
             len(plan.todo), len(plan.stale), len(plan.skipped_failed), len(models.problems))
    if on_plan is not None:
        on_plan(plan)
    backend = opener(settings, worker_spec(settings, started.run_id, store.url))
    # An adapter right after its base: a worker downloads the base once for both.
    tasks = [Task.for_model(row) for row in base_first(plan.todo)]
    if settings.dry_run:
        return _dry_run(backend, tasks, plan, started.run_id, store.url, out or sys.stdout)
    recorder = Recorder(store, started.run_id)
    interrupted = execute(backend, tasks, recorder)
    summary_rows = write_summary(store, list(models.rows), parameters=params)
    counts = {"models": len(models.rows), "bad_rows": len(models.problems),
              "already_done": len(plan.done), "skipped_failed": len(plan.skipped_failed)}
    result = _finish(settings, store, started, backend, recorder, counts, mode="esd",
                     summary_rows=summary_rows, interrupted=interrupted)
    log.info("run %s: %d done, %d failed, %d cancelled, %d already done; report %s%s",
             started.run_id, len(recorder.done), len(recorder.failed), len(recorder.cancelled),
             len(plan.done), run_report_key(started.run_id),
             f", {SUMMARY_KEY} ({summary_rows} models)" if summary_rows else "")
    return result


def run_commands(settings: SweepSettings) -> SweepResult:
    """Custom-commands mode: each line of settings.commands under the local GPU management.

    No model list, no plan and no summary: the commands' outcomes go in the run report.
    """
    assert settings.commands is not None
    started = _Started()
    store = _open_store(settings.output)
    try:
        tasks = read_commands(settings.commands)
    except (OSError, ValueError) as e:
        raise SweepError(f"--commands {settings.commands}: {e}") from e
    log.info("custom mode: %d command(s) from %s", len(tasks), settings.commands)
    backend = LocalBackend.from_settings(settings, worker_spec(settings, started.run_id,
                                                               store.url))
    recorder = Recorder(store, started.run_id)
    interrupted = execute(backend, tasks, recorder)
    counts = {"models": len(tasks), "bad_rows": 0, "already_done": 0, "skipped_failed": 0}
    return _finish(settings, store, started, backend, recorder, counts, mode="custom",
                   summary_rows=0, interrupted=interrupted)


def worker_spec(settings: SweepSettings, run_id: str, store_url: str) -> WorkerSpec:
    """What every worker of this run computes and where it writes."""
    return WorkerSpec(
        run_id=run_id, store_url=store_url, analysis=settings.analysis,
        save_eigs=settings.save_eigs, trust_remote_code=settings.trust_remote_code,
        log_format=settings.worker_log_format, device=settings.device,
        gpus_per_job=settings.gpu.gpus_per_job, max_retries=settings.local.max_retries,
        overwrite=settings.overwrite, prefetch=settings.prefetch,
        cache_budget=settings.cache_budget, cache_dir=settings.cache_dir,
    )


def load_models(settings: SweepSettings) -> ModelList:
    """The model list (or the single model), with bad rows reported one line each."""
    if settings.single_model:
        models = make_single(settings.single_model, relation=settings.single_relation,
                             source_model=settings.single_source)
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


def models_status(settings: SweepSettings) -> dict[str, Any]:
    """What `esd-sweep status` prints: done / to do / failed for the list against the store."""
    store = _open_store(settings.output)
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


def execute(backend: Backend, tasks: Sequence[Task], recorder: Recorder) -> bool:
    """Run the tasks on the backend under Ctrl+C handling; True when interrupted."""
    progress = Progress(len(tasks))
    try:
        with _Interrupts(backend) as interrupts:
            backend.run(tasks, recorder, progress)
        return interrupts.count > 0
    finally:
        progress.close()
        backend.close()


class _Started:
    """When and as what run the sweep started."""

    def __init__(self) -> None:
        self.clock = time.perf_counter()
        self.at = utc_now()
        self.run_id = new_run_id()


def _open_store(url: str) -> Store:
    try:
        return open_store(url)
    except Exception as e:  # the store's own errors are already clear; keep them one line
        raise InfrastructureError(f"cannot open the result store {url}: {e}") from e


def _finish(
    settings: SweepSettings, store: Store, started: _Started, backend: Backend,
    recorder: Recorder, counts: dict[str, int], *, mode: str, summary_rows: int,
    interrupted: bool,
) -> SweepResult:
    """Write the run report and decide the exit status."""
    report = run_report(
        run_id=started.run_id, started_at=started.at, finished_at=utc_now(), output=store.url,
        mode=mode, backend=backend.name, backend_report=backend.report(),
        parameters=settings.analysis.as_dict(), counts=counts, tally=recorder,
        summary_rows=summary_rows, runtime_s=time.perf_counter() - started.clock,
        interrupted=interrupted,
    )
    write_run_report(store, started.run_id, report)
    if interrupted:
        code = EXIT_INTERRUPTED
    elif recorder.failed or counts["bad_rows"]:
        code = EXIT_SOME_FAILED
    else:
        code = EXIT_ALL_DONE
    return SweepResult(run_id=started.run_id, exit_code=code, report=report)


def _dry_run(backend: Backend, tasks: Sequence[Task], plan: Plan, run_id: str, store_url: str,
             out: TextIO) -> SweepResult:
    """Print what the backend would start (commands or Jobs); start and write nothing."""
    try:
        started = backend.dry_run(tasks, out)
    finally:
        backend.close()
    log.info("--dry-run: %d printed, nothing started (%d already done)", started,
             len(plan.done))
    report = {
        "run_id": run_id, "output": store_url, "backend": backend.name, "dry_run": True,
        "counts": {"models": len(plan.todo) + len(plan.done) + len(plan.skipped_failed),
                   "already_done": len(plan.done), "jobs": started, "done": 0,
                   "failed": 0, "bad_rows": 0},
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
