"""Refit: the power-law fits recomputed from stored eigenvalues with other settings (no model).

Owns `<model_key>/layers.<tag>.csv`, `summary.<tag>.csv` and `refits/<tag>.json`; reads the
worker's eigs.npz, layers.csv and result.json and never changes them. No model is loaded and
nothing here imports torch: the metrics come from esd_worker.core.powerlaw.layer_metrics, the
function the worker uses, so a refit with a model's own settings reproduces its layers.csv
byte for byte.

What a refit does with each row of layers.csv:
- a layer the worker fitted (status ok or fit_failed) whose eigenvalues are in eigs.npz:
  every metric recomputed; fix_fingers and status are the refit's;
- such a layer without stored eigenvalues: the original row kept as is (its numbers and its
  fix_fingers say which settings made them) with status `no_eigs`, so summaries leave it out;
- --min-evals larger than the original: layers whose smaller side is below it become
  `too_small` with the worker's empty metrics. A smaller --min-evals cannot bring back
  layers the worker left out as too_small: they have no stored eigenvalues and stay
  too_small, as do the other unanalysed statuses (unsupported_dtype, nonfinite_weights, …);
  their fix_fingers is the refit's (their metrics do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from controller.errors import ResultsError
from controller.output.lease import add_wait_lock_flag, output_lease
from controller.output.tenure import Tenure
from controller.results.reader import (
    ModelResult,
    check_tag,
    iter_results,
    no_table_error,
    number,
    open_results,
    read_eigs,
    read_model_markers,
    table_name,
    warn_damaged,
)
from controller.results.summary import summary_rows, summary_to_csv
from esd_worker.core.command.flags import (
    MAX_THREADS,
    MIN_EVALS,
    add_fit_flags,
    add_flag,
    fit_from_args,
    int_in,
)
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.errors import UsageError
from esd_worker.core.powerlaw import (
    METRIC_COLUMNS,
    STATUS_FIT_FAILED,
    STATUS_OK,
    layer_metrics,
)
from esd_worker.core.store.layout import model_file_key, refit_record_key, summary_key
from esd_worker.core.store.marker import DamagedResult
from esd_worker.core.store.results import layers_from_csv, layers_to_csv, summarize_layers

log = logging.getLogger(__name__)

STATUS_NO_EIGS = "no_eigs"
STATUS_TOO_SMALL = "too_small"
_FITTED = frozenset({STATUS_OK, STATUS_FIT_FAILED})


def refit_tag(
    fix_fingers: str, evals_thresh: float, bins: int, min_evals: int | None = None
) -> str:
    """The default tag of a refit, naming its settings: `refit-DKS-1e-05-100[-min20]`."""
    tag = f"refit-{fix_fingers}-{float(evals_thresh)!r}-{bins}"
    return tag if min_evals is None else f"{tag}-min{min_evals}"


def summary_name(tag: str) -> str:
    """summary.<tag>.csv; a bad tag is a ResultsError (tags come from flags)."""
    return summary_key(check_tag(tag))


@dataclass(frozen=True)
class RefitSettings:
    """One refit of a results location.

    results: the results location (directory, file:// or s3://), written in place.
    fix_fingers, evals_thresh, bins: the fit (docs/metrics.md); defaults are the worker's.
    min_evals: None keeps each model's too_small layers as they are; a larger value than
        the original marks more layers too_small (see the module docstring).
    tag: name of the new tables; None = refit_tag(fix_fingers, evals_thresh, bins, min_evals).
    keys: only these model_keys (default: every model with eigs.npz).
    threads: layers fitted at once (0 = one per CPU); numpy's KS scan releases the GIL.
    """

    results: str
    fix_fingers: str = "xmin_mid"
    evals_thresh: float = 1e-5
    bins: int = 100
    min_evals: int | None = None
    tag: str | None = None
    keys: tuple[str, ...] = ()
    threads: int = 0

    @property
    def resolved_tag(self) -> str:
        return self.tag or refit_tag(self.fix_fingers, self.evals_thresh, self.bins,
                                     self.min_evals)

    def validate(self) -> None:
        """One ResultsError naming every bad setting."""
        problems: list[str] = []
        try:
            AnalysisSettings(
                fix_fingers=self.fix_fingers, evals_thresh=self.evals_thresh, bins=self.bins,
                min_evals=10 if self.min_evals is None else self.min_evals,
            ).validate()
        except UsageError as e:
            problems.append(str(e))
        try:
            check_tag(self.resolved_tag)
        except ResultsError as e:
            problems.append(str(e))
        if self.threads < 0:
            problems.append(f"threads: must be >= 0, got {self.threads}")
        if problems:
            raise ResultsError("; ".join(problems))

    def parameters(self) -> dict[str, Any]:
        return {"fix_fingers": self.fix_fingers, "evals_thresh": self.evals_thresh,
                "bins": self.bins, "min_evals": self.min_evals}


def _empty_metrics() -> dict[str, Any]:
    """The metrics the worker writes for a layer it does not analyse."""
    return {col: math.nan for col in METRIC_COLUMNS} | {
        "num_evals": 0, "num_pl_spikes": 0, "matrix_rank": 0}


def _int(value: Any) -> int:
    f = number(value)
    return int(f) if math.isfinite(f) else 0


@dataclass(frozen=True)
class RefitCounts:
    """Rows of one table by what the refit did with them."""

    refit: int = 0
    no_eigs: int = 0
    too_small: int = 0
    kept: int = 0

    def __add__(self, other: RefitCounts) -> RefitCounts:
        return RefitCounts(self.refit + other.refit, self.no_eigs + other.no_eigs,
                           self.too_small + other.too_small, self.kept + other.kept)


def refit_rows(
    rows: Sequence[Mapping[str, str]],
    eigs: Mapping[str, np.ndarray],
    *,
    fix_fingers: str,
    evals_thresh: float,
    bins: int,
    min_evals: int | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[list[dict[str, Any]], RefitCounts]:
    """The rows of a refit layer table, in the same order, and what was done (module docstring).

    rows: layers.csv rows as read (strings); eigs: eigs.npz by layer name.
    """
    def fit(evals: np.ndarray, max_dim: int) -> dict[str, float | int | str]:
        return layer_metrics(evals, max_dim=max_dim, fix_fingers=fix_fingers,
                             evals_thresh=evals_thresh, bins=bins)

    out: list[dict[str, Any] | None] = []
    jobs: dict[int, Future[dict[str, float | int | str]] | dict[str, float | int | str]] = {}
    refit = no_eigs = too_small = kept = 0
    for i, row in enumerate(rows):
        status = row.get("status", "")
        M, N = _int(row.get("M")), _int(row.get("N"))
        if status in _FITTED and min_evals is not None and min(M, N) < min_evals:
            out.append(dict(row) | _empty_metrics() | {
                "fix_fingers": fix_fingers, "status": STATUS_TOO_SMALL})
            too_small += 1
        elif status in _FITTED and row.get("layer") in eigs:
            out.append(None)
            evals, max_dim = eigs[row["layer"]], max(M, N, 1)
            jobs[i] = pool.submit(fit, evals, max_dim) if pool else fit(evals, max_dim)
            refit += 1
        elif status in _FITTED:
            out.append(dict(row) | {"status": STATUS_NO_EIGS})
            no_eigs += 1
        else:
            out.append(dict(row) | {"fix_fingers": fix_fingers})
            kept += 1
    for i, job in jobs.items():
        metrics = job.result() if isinstance(job, Future) else job
        out[i] = dict(rows[i]) | metrics | {"fix_fingers": fix_fingers}
    return [r for r in out if r is not None], RefitCounts(refit, no_eigs, too_small, kept)


@dataclass(frozen=True)
class RefitResult:
    """What a refit wrote: the tag, the models refit and left out, row counts, seconds."""

    tag: str
    models: tuple[str, ...]
    skipped: tuple[str, ...]
    counts: RefitCounts
    seconds: float
    # Per refit model: short name, layers, alpha_mean of the original table and of the refit.
    alpha_means: tuple[tuple[str, int, float | None, float | None], ...] = ()


def refit_store(settings: RefitSettings, *, tenure: Tenure | None = None) -> RefitResult:
    """Refit every model (or settings.keys) with eigs.npz; write its layers.<tag>.csv, then
    summary.<tag>.csv and refits/<tag>.json. Models without eigs.npz are left out (logged);
    none with eigs.npz at all is a ResultsError. tenure: the output's lease; once it is lost
    nothing more is written (LeaseLostError, exit 3)."""
    settings.validate()
    t0 = time.perf_counter()
    started = datetime.now(UTC)
    tag = settings.resolved_tag
    store = open_results(settings.results)
    markers = read_model_markers(store, keys=settings.keys or None)
    threads = settings.threads or os.cpu_count() or 1
    refit_keys: list[str] = []
    summaries: list[dict[str, Any]] = []
    means: list[tuple[str, int, float | None, float | None]] = []
    skipped: list[str] = []
    damaged: list[str] = []  # left out with a line each (reader.warn_damaged)
    counts = RefitCounts()
    # One model in memory at a time (its table and eigenvalues); its layers fitted in the pool.
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for result in iter_results(store, markers, list(markers), threads=16, chunk=16):
            try:
                eigs = read_eigs(store, result)
            except DamagedResult as e:
                warn_damaged(result.key, e)
                damaged.append(result.key)
                continue
            if eigs is None:
                skipped.append(result.key)
                continue
            rows, n = refit_rows(
                result.rows, eigs, fix_fingers=settings.fix_fingers,
                evals_thresh=settings.evals_thresh, bins=settings.bins,
                min_evals=settings.min_evals, pool=pool if threads > 1 else None,
            )
            if tenure is not None:
                tenure.check()
            store.put_bytes(model_file_key(result.key, table_name(tag)), layers_to_csv(rows))
            counts += n
            new = ModelResult(result.key, result.marker, layers_from_rows(rows))
            summaries.extend(summary_rows([new], store, recompute=True))
            means.append((new.name, len(rows), summarize_layers(result.rows)["alpha_mean"],
                          summaries[-1].get("alpha_mean")))
            refit_keys.append(result.key)
    if not refit_keys:
        if damaged and not skipped:
            raise ResultsError(f"nothing to refit in {store.url}: the eigenvalues of all "
                               f"{len(damaged)} model(s) are damaged (named above)")
        if not skipped:
            raise no_table_error(store, None)
        raise ResultsError(
            f"no eigs.npz in {store.url} for the {len(skipped)} model(s) there: refit needs "
            "the eigenvalues the worker stores (sweeps run with --no-eigs have none)"
        )
    if skipped:
        log.warning("%d model(s) without eigs.npz not refit: %s", len(skipped),
                    ", ".join(skipped[:5]))
    if tenure is not None:
        tenure.check()
    store.put_bytes(summary_name(tag), summary_to_csv(summaries))
    seconds = time.perf_counter() - t0
    record = {
        "tag": tag,
        "parameters": settings.parameters(),
        "table": table_name(tag),
        "models": refit_keys,
        "skipped_no_eigs": skipped,
        "skipped_damaged": damaged,
        "rows": counts.__dict__,
        "started_at": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
    }
    store.put_bytes(refit_record_key(tag), (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    log.info("refit %s: %d model(s), %d layers refit, %d without eigenvalues, in %.2fs",
             tag, len(refit_keys), counts.refit, counts.no_eigs, seconds)
    return RefitResult(tag, tuple(refit_keys), tuple(skipped), counts, seconds, tuple(means))


def layers_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Rows with values as layers.csv would read back (strings), via the CSV encoding."""
    return layers_from_csv(layers_to_csv(rows))


def add_refit_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--output-dir", "--output", "--results", required=True, metavar="URL",
             help="results location with eigs.npz: a directory, file:// URL or s3://…; the "
             "refit tables are written next to the originals")
    add_fit_flags(parser)
    add_flag(parser, "--min-evals", type=MIN_EVALS, default=None, metavar="N",
             help="mark layers whose smaller side is below N too_small (default: as analysed; "
             "layers analysed as too_small have no eigenvalues and stay so)")
    add_flag(parser, "--tag", metavar="TAG",
             help="name of the new tables layers.<TAG>.csv and summary.<TAG>.csv (default "
             "from the settings, e.g. refit-DKS-1e-05-100)")
    add_flag(parser, "--model-key", action="append", default=[], metavar="KEY",
             help="refit only this model (repeatable; default: every model with eigs.npz)")
    add_flag(parser, "--threads", type=int_in(0, MAX_THREADS), default=0, metavar="N",
             help="layers fitted at once (default: one per CPU)")
    add_wait_lock_flag(parser)


def run_refit(args: argparse.Namespace) -> int:
    """`esd-sweep refit`: errors are raised (ResultsError: exit 2; StoreError: exit 3).

    It writes into the output, so it holds the output's lease as a sweep does (exit 2 while
    another holds it, or --wait-lock).
    """
    fit = fit_from_args(args)
    settings = RefitSettings(
        results=args.output_dir, fix_fingers=fit.fix_fingers, evals_thresh=fit.evals_thresh,
        bins=fit.bins, min_evals=args.min_evals, tag=args.tag,
        keys=tuple(args.model_key or ()), threads=args.threads,
    )
    settings.validate()  # a bad flag is said at once, not after waiting for the lease
    with output_lease(open_results(settings.results), command="esd-sweep refit",
                      run_id=None, wait_s=args.wait_lock) as tenure:
        result = refit_store(settings, tenure=tenure)
    print(format_refit(result))
    return 0


def format_refit(result: RefitResult, limit: int = 20) -> str:
    """What a refit did, for people: counts, where the tables are, α mean before → after."""
    c = result.counts
    lines = [
        f"refit {result.tag}: {len(result.models)} model(s), {c.refit} layers refit, "
        f"{c.no_eigs} without stored eigenvalues (kept, status {STATUS_NO_EIGS}), "
        f"{c.too_small + c.kept} not analysed, in {result.seconds:.2f}s",
        f"tables: <model_key>/{table_name(result.tag)}; summary: {summary_name(result.tag)}",
    ]
    if result.skipped:
        lines.append(f"{len(result.skipped)} model(s) without eigs.npz not refit")
    rows = [("model", "layers", "alpha_mean before", "after")]
    for name, layers, before, after in result.alpha_means[:limit]:
        rows.append((name, str(layers), _f(before), _f(after)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    if len(result.alpha_means) > limit:
        lines.append(f"... {len(result.alpha_means) - limit} more in "
                     f"{summary_name(result.tag)}")
    return "\n".join(lines)


def _f(value: Any) -> str:
    f = number(value)
    return "–" if value is None or not math.isfinite(f) else f"{f:.3f}"

