"""`esd-sweep report`: a results store for people: summary.csv, layers.parquet, plots, index.html.

Owns the command (its settings and flags) and the order of the work: read the markers, then
stream the layer tables a chunk at a time through the summary, the Parquet file and the
plots, then write the page. Computes no metrics (the numbers are the worker's or a refit's)
and draws nothing itself: reading is controller.results.reader, rows summary, the Parquet
file parquet, pictures plots, the page and the folder's file names html. matplotlib and
pyarrow (the `[report]` extra) are imported only when a report is written.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import ResultsError
from controller.results.extras import require
from controller.results.html import (
    ALPHA_PLOT,
    ESD_PLOT,
    INDEX_NAME,
    MODELS_FOLDER,
    PARQUET_NAME,
    RELATION_PLOT,
    SUMMARY_NAME,
    VS_BASE_PLOT,
    index_html,
)
from controller.results.parquet import LayersParquet, layers_table
from controller.results.plots import (
    DEFAULT_ESD_LAYERS,
    RelationAlphas,
    plot_alpha,
    plot_alpha_by_relation,
    plot_esd,
    plot_vs_base,
)
from controller.results.reader import (
    ModelResult,
    base_keys,
    iter_results,
    no_table_error,
    open_results,
    read_eigs,
    read_model_markers,
    read_refit_record,
    relation_order,
    warn_damaged,
)
from controller.results.summary import summary_rows, summary_to_csv
from esd_worker.core.command.flags import MAX_ROWS, MAX_THREADS, add_flag, int_in
from esd_worker.core.store.layout import REPORT_PREFIX, is_tag
from esd_worker.core.store.marker import DamagedResult
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_PLOTS = 50
MAX_ESD_LAYERS = 10**6  # --esd-layers: more than any model has (0: all)


@dataclass(frozen=True)
class ReportSettings:
    """What `esd-sweep report` writes and where.

    results: the results location (directory, file:// or s3://).
    out: where the report goes; None = `<results>/report/`.
    tag: report on layers.<tag>.csv (a refit) instead of layers.csv.
    max_model_plots: per-model plots (α, ESD, vs base) for at most this many models, the
        first in the index's order (default 50); 0 = none.
    esd_layers: layers per ESD plot, at α quantiles (default 6); 0 = all layers.
    threads: concurrent reads from the store (default 16).
    """

    results: str
    out: str | None = None
    tag: str | None = None
    max_model_plots: int = DEFAULT_MAX_MODEL_PLOTS
    esd_layers: int = DEFAULT_ESD_LAYERS
    threads: int = 16

    def validate(self) -> None:
        """One ResultsError naming every bad setting by its flag."""
        problems = []
        if self.max_model_plots < 0:
            problems.append(f"--max-model-plots: must be >= 0, got {self.max_model_plots}")
        if self.esd_layers < 0:
            problems.append(f"--esd-layers: must be >= 0, got {self.esd_layers}")
        if self.threads < 1:
            problems.append(f"--threads: must be >= 1, got {self.threads}")
        if self.tag is not None and not is_tag(self.tag):
            problems.append(f"--tag: invalid tag {self.tag!r}")
        if problems:
            raise ResultsError("; ".join(problems))


@dataclass(frozen=True)
class Report:
    """What write_report wrote: keys relative to `where` (a store URL), model counts."""

    where: str
    files: tuple[str, ...]
    models: int
    layers: int
    plotted_models: int


class _Prefixed:
    """Writes under a prefix of a store, and remembers the keys written (without it)."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix
        self.files: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        self.store.put_bytes(self.prefix + key, data)
        self.files.append(key)


def _order(results: Sequence[ModelResult], bases: Mapping[str, str]) -> list[ModelResult]:
    """Index order: base models each followed by their adapters, then the rest, by name."""
    by_key = {r.key: r for r in results}
    adapters: dict[str, list[ModelResult]] = {}
    for r in results:
        if r.key in bases:
            adapters.setdefault(bases[r.key], []).append(r)
    ordered: list[ModelResult] = []
    for r in sorted(results, key=lambda r: (relation_order(r.relation), r.name, r.key)):
        if r.key in bases and bases[r.key] in by_key:
            continue  # placed after its base
        ordered.append(r)
        ordered.extend(sorted(adapters.get(r.key, []), key=lambda a: (a.name, a.key)))
    return ordered


def _refit_thresh(store: Store, tag: str | None) -> float | None:
    """The evals_thresh a refit table was fitted with (its record's), for the ESD plots."""
    if not tag:
        return None
    record = read_refit_record(store, tag) or {}
    params = record.get("parameters")
    if isinstance(params, Mapping) and params.get("evals_thresh") is not None:
        return float(params["evals_thresh"])
    return None


def write_report(settings: ReportSettings) -> Report:
    """Read the results and write summary.csv, layers.parquet, the plots and index.html.

    Markers are read first (they decide the order and the adapters' bases); layer tables
    then stream through a chunk at a time into the Parquet file, the summary and the
    across-model statistics, so memory does not grow with every layer of a large store.
    """
    settings.validate()
    t0 = time.perf_counter()
    store = open_results(settings.results)
    markers = read_model_markers(store, threads=settings.threads)
    # Fail before any work when matplotlib or pyarrow is missing.
    require("matplotlib")
    parquet = LayersParquet()
    if settings.out:
        target, where = _Prefixed(open_store(settings.out), ""), settings.out
    else:
        target = _Prefixed(store, REPORT_PREFIX)
        where = store.url.rstrip("/") + "/" + REPORT_PREFIX.rstrip("/")
    shells = [ModelResult(k, m, []) for k, m in markers.items()]
    bases = base_keys(shells)
    wanted_bases = set(bases.values())
    order = [r.key for r in _order(shells, bases)]
    thresh = _refit_thresh(store, settings.tag)

    included: list[ModelResult] = []
    summaries: list[dict[str, Any]] = []
    relations = RelationAlphas()
    plots: dict[str, dict[str, str]] = {}
    seen_bases: dict[str, ModelResult] = {}  # bases of adapters still to plot
    layers = 0
    for r in iter_results(store, markers, order, tag=settings.tag, threads=settings.threads):
        included.append(ModelResult(r.key, r.marker, []))
        summaries.extend(summary_rows([r], store, recompute=bool(settings.tag)))
        relations.add(r)
        table = layers_table([r], bases)
        layers += table.num_rows
        parquet.add(table)
        if len(plots) < settings.max_model_plots:
            if r.key in wanted_bases:
                seen_bases[r.key] = r
            plots[r.key] = _model_plots(store, r, seen_bases.get(bases.get(r.key, "")),
                                        settings.esd_layers, thresh, target.put)
    if not included:
        raise no_table_error(store, settings.tag)
    target.put(SUMMARY_NAME, summary_to_csv(summaries))
    target.put(PARQUET_NAME, parquet.finish())
    target.put(RELATION_PLOT, plot_alpha_by_relation(relations))
    page = index_html(
        included, summaries, bases, plots, source=store.url, tag=settings.tag,
        max_model_plots=settings.max_model_plots, layers=layers,
    )
    target.put(INDEX_NAME, page.encode("utf-8"))
    log.info("report of %d model(s), %d layers, plots for %d, in %s (%.1fs)", len(included),
             layers, len(plots), where, time.perf_counter() - t0)
    return Report(where, tuple(target.files), len(included), layers, len(plots))


def _model_plots(
    store: Store,
    result: ModelResult,
    base: ModelResult | None,
    esd_layers: int,
    evals_thresh: float | None,
    put: Callable[[str, bytes], None],
) -> dict[str, str]:
    """Write one model's plots under models/<key>/; label → path of those written."""
    mine: dict[str, str] = {}
    folder = f"{MODELS_FOLDER}{result.key}/"
    put(folder + ALPHA_PLOT, plot_alpha(result))
    mine["α per layer"] = folder + ALPHA_PLOT
    try:
        eigs = read_eigs(store, result)
    except DamagedResult as e:  # the table is whole (read_table checked it): plot without
        warn_damaged(result.key, e)
        eigs = None
    esd = plot_esd(result, eigs, count=esd_layers, evals_thresh=evals_thresh) if eigs else None
    if esd is not None:
        put(folder + ESD_PLOT, esd)
        mine["ESD"] = folder + ESD_PLOT
    vs = plot_vs_base(result, base) if base is not None else None
    if vs is not None:
        put(folder + VS_BASE_PLOT, vs)
        mine["vs base"] = folder + VS_BASE_PLOT
    return mine


# --------------------------------------------------------------------------- the command


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--output-dir", "--output", "--results", required=True, metavar="URL",
             help="results location: a directory, file:// URL or s3://bucket/prefix")
    add_flag(parser, "--out", metavar="DIR|URL",
             help="write the report here instead of <results>/report/")
    add_flag(parser, "--tag", metavar="TAG",
             help="report on the refit tables layers.<TAG>.csv instead of layers.csv")
    add_flag(parser, "--max-model-plots", type=int_in(0, MAX_ROWS),
             default=DEFAULT_MAX_MODEL_PLOTS,
             metavar="N", help="per-model plots for at most N models (default "
             f"{DEFAULT_MAX_MODEL_PLOTS}; 0: none); the tables always hold every model")
    add_flag(parser, "--esd-layers", type=int_in(0, MAX_ESD_LAYERS),
             default=DEFAULT_ESD_LAYERS, metavar="N",
             help=f"layers per ESD plot, chosen at α quantiles (default {DEFAULT_ESD_LAYERS}; "
             "0: all)")
    add_flag(parser, "--threads", type=int_in(1, MAX_THREADS), default=16, metavar="N",
             help="concurrent reads from the store (default 16)")


def run_report(args: argparse.Namespace) -> int:
    """`esd-sweep report`: errors are raised (ResultsError: exit 2; StoreError: exit 3)."""
    report = write_report(ReportSettings(
        results=args.output_dir, out=args.out, tag=args.tag,
        max_model_plots=args.max_model_plots, esd_layers=args.esd_layers, threads=args.threads,
    ))
    index = f"{report.where.rstrip('/')}/{INDEX_NAME}"
    if "://" not in report.where:
        index = str(Path(index))
    print(f"report: {report.models} model(s), {report.layers} layers, per-model plots for "
          f"{report.plotted_models}; {len(report.files)} files in {report.where}")
    print(f"open {index}")
    return 0
