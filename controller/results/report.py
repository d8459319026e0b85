"""`esd-sweep report`: a results store for people, at any number of models.

Owns the command (its settings and flags) and the order of the work: the overview of all
models in streaming passes over the results tables (overview.py; for a refit --tag, over
the per-model files a chunk at a time: taggedtables.py), the failures by cause
(failures.py), the distribution plots, the pages of the models the index lists (one
filtered pass over the layers table for their rows: pages.py), then index.html (html.py).
What they say of the fit comes from the parameters the overview's first pass counts, a
refit's fix_fingers from its record refits/<tag>.json (reportfit.py).
Memory is bounded by bins, groups and the listed models, not by the store's size.
matplotlib and pyarrow (the `[report]` extra) are imported only when a report is written.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import ResultsError
from controller.results.extras import require
from controller.results.failures import group_failures
from controller.results.html import INDEX_NAME, index_html, plot_name
from controller.results.overview import GROUPINGS, HEADLINE, Overview, build_overview
from controller.results.pages import with_rows, write_model_page
from controller.results.plots import DEFAULT_ESD_LAYERS, plot_distribution
from controller.results.reader import (
    ModelResult,
    base_keys,
    no_table_error,
    open_results,
    read_refit_record,
)
from controller.results.reportfit import fit_of, fit_of_models, fitted
from controller.results.tables import SHELL_COLUMNS, Tables, rows_of
from controller.results.taggedtables import TaggedTables
from esd_worker.core.command.flags import MAX_ROWS, MAX_THREADS, add_flag, int_in
from esd_worker.core.store.layout import REPORT_PREFIX, is_tag
from esd_worker.core.store.marker import BaseModelRef, Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import LAYERS_TABLE, MODELS_TABLE

log = logging.getLogger(__name__)

# Every model the index lists (6 metrics x top, bottom, outliers of 20) gets a page.
DEFAULT_MAX_MODEL_PLOTS = 400
MAX_ESD_LAYERS = 10**6  # --esd-layers: more than any model has (0: all)
TOP_N = 20


@dataclass(frozen=True)
class ReportSettings:
    """What `esd-sweep report` writes and where.

    results: the results location (directory, file:// or s3://).
    out: where the report goes; None = `<results>/report/`.
    tag: report on layers.<tag>.csv (a refit) instead of the results tables.
    max_model_plots: pages (with plots) for at most this many of the models the index
        lists (default 400: all of them); 0 = none, and no links.
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


@dataclass(frozen=True)
class _Refit:
    """What a refit's record says of its fit: the fix_fingers ("?" when the record does not
    say: the tables' parameters are the analysis', not the refit's) and evals_thresh (for
    the ESD plots). Both None for the results tables."""

    fix_fingers: str | None = None
    evals_thresh: float | None = None


def _refit(store: Store, tag: str | None) -> _Refit:
    if not tag:
        return _Refit()
    record = read_refit_record(store, tag) or {}
    params = record.get("parameters")
    params = params if isinstance(params, Mapping) else {}
    thresh = params.get("evals_thresh")
    return _Refit(str(params.get("fix_fingers") or "?"),
                  None if thresh is None else float(thresh))


def _listed(view: Overview) -> list[str]:
    """The keys the index lists, in page order (top, bottom, outliers per metric), once."""
    keys: dict[str, None] = {}
    for metric in HEADLINE:
        for lists in (view.top, view.bottom, view.outliers):
            if metric in lists:
                keys.update((key, None) for key, _ in lists[metric].rows())
    return list(keys)


def write_report(settings: ReportSettings) -> Report:
    """Read the results and write the distribution plots, the listed models' pages and
    index.html (see the module's docstring for the passes)."""
    settings.validate()
    t0 = time.perf_counter()
    store = open_results(settings.results)
    require("matplotlib")  # fail before any work when the [report] extra is missing
    tables: Tables | TaggedTables = (
        TaggedTables(store, settings.tag, threads=settings.threads) if settings.tag
        else Tables(store, threads=min(settings.threads, 8)))
    view = build_overview(tables, n=TOP_N)  # type: ignore[arg-type]
    if not view.models:
        if settings.tag:
            raise no_table_error(store, settings.tag)
        raise ResultsError(f"no results in {store.url}: no <model_key>/result.json found")
    if settings.out:
        target, where = _Prefixed(open_store(settings.out), ""), settings.out
    else:
        target = _Prefixed(store, REPORT_PREFIX)
        where = store.url.rstrip("/") + "/" + REPORT_PREFIX.rstrip("/")
    refit = _refit(store, settings.tag)
    fit = fit_of_models(view.parameters, fix_fingers=refit.fix_fingers)
    plots: set[str] = set()
    for metric in HEADLINE:
        for grouping in GROUPINGS:
            path = plot_name(metric, grouping)
            target.put(path, plot_distribution(view.hists[metric][grouping],
                                               f"{metric} by {grouping}",
                                               fit=fit if fitted(metric) else None))
            plots.add(path)
    path = plot_name("layer_alpha", "family")
    target.put(path, plot_distribution(view.layer_alpha, "layer α (fit ok) by family",
                                       fit=fit))
    plots.add(path)
    listed = _listed(view)
    rows = _model_rows(tables, set(listed))
    linked = _pages(store, tables, listed[:settings.max_model_plots], rows, settings, refit,
                    target.put)
    failures = group_failures(store, threads=settings.threads)
    parts = (len(tables.parts(MODELS_TABLE)) + len(tables.parts(LAYERS_TABLE))
             if isinstance(tables, Tables) else 0)
    names = {key: str(row.get("model_id") or key) for key, row in rows.items()}
    shares = {key: row.get("params_analysed_share") for key, row in rows.items()}
    page = index_html(view, failures, source=store.url, tag=settings.tag, parts=parts,
                      names=names, linked=linked, plots=plots, fit=fit, shares=shares)
    target.put(INDEX_NAME, page.encode("utf-8"))
    log.info("report of %d model(s), %d layers, pages for %d, in %s (%.1fs)", view.models,
             view.layers, len(linked), where, time.perf_counter() - t0)
    return Report(where, tuple(target.files), view.models, view.layers, len(linked))


def _model_rows(tables: Tables | TaggedTables, keys: set[str]) -> dict[str, dict[str, Any]]:
    """The models rows of `keys` (one pass over the models table)."""
    found: dict[str, dict[str, Any]] = {}
    if keys:
        for batch in tables.models():
            for row in rows_of(batch, keys).to_pylist():
                found[row["model_key"]] = row
    return found


def _shell(row: Mapping[str, Any]) -> ModelResult:
    base = row.get("base_model")
    marker = Marker(model=row.get("model") or row["model_key"], model_key=row["model_key"],
                    model_id=row.get("model_id"), revision=row.get("revision"),
                    relation=row.get("relation") or "",
                    base_model=BaseModelRef(base) if base else None)
    return ModelResult(row["model_key"], marker, [])


def _pages(store: Store, tables: Tables | TaggedTables, keys: list[str],
           rows: Mapping[str, Mapping[str, Any]], settings: ReportSettings, refit: _Refit,
           put: Any) -> set[str]:
    """Pages of `keys` (and their adapters' bases among them for vs-base plots); one
    filtered pass over the layers table for their layer rows."""
    if not keys:
        return set()
    shells = [_shell({k: rows[key].get(k) for k in SHELL_COLUMNS}) for key in keys
              if key in rows]
    bases = base_keys(shells)
    wanted = {s.key for s in shells}
    layers: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for batch in tables.layers():
        for row in rows_of(batch, wanted).to_pylist():
            layers.setdefault(row["model_key"], []).append((row["layer_index"], row))
    full = {s.key: with_rows(s, [r for _, r in sorted(layers.get(s.key, []),
                                                         key=lambda item: item[0])])
            for s in shells}
    fits = {key: fit_of(rows[key].get("parameters"), fix_fingers=refit.fix_fingers)
            for key in full}
    for key, result in full.items():
        base = bases.get(key, "")
        write_model_page(store, result, rows[key], full.get(base), fit=fits[key],
                         base_fit=fits.get(base), esd_layers=settings.esd_layers,
                         evals_thresh=refit.evals_thresh, put=put)
    return set(full)


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
             metavar="N",
             help="pages with plots for at most N of the models the index lists (default "
             f"{DEFAULT_MAX_MODEL_PLOTS}: all; 0: none); the tables hold every model")
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
    print(f"report: {report.models} model(s), {report.layers} layers, per-model pages for "
          f"{report.plotted_models}; {len(report.files)} files in {report.where}")
    print(f"open {index}")
    return 0
