"""The report's index page and the names of the files in a report folder it links to.

Owns the page: what it covers (store, counts, fit settings and the fit's label near the
top, or "mixed fits: …"), the distributions of the headline metrics by family / relation /
size (a PNG and a quantile table each; the share in WeightWatcher's 2-6 band only where the
band applies, else one line why), the layer alpha by family, top / bottom / outlier lists
linking to per-model pages (with the share of each model's parameters analysed), the
failures by cause, and how to open the full tables. Its size is fixed by groups and N, not
by models. Holds no data of its own (overview.py,
failures.py compute it). Plain HTML, relative links, no JavaScript. Every text that came
from a model or a worker (a model id, a family from a config.json) is shown through `shown`:
esd_worker.core.echo's redaction and control-character escaping, then HTML escaping.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from datetime import UTC, datetime

from controller.results.aggregates import QUANTILES, GroupedHistograms
from controller.results.failures import FailureGroups
from controller.results.overview import GROUPINGS, HEADLINE, Overview
from controller.results.reportfit import BAND_METRICS, Fit
from esd_worker.core.command.presets import WW_ALPHA_BAND
from esd_worker.core.echo import echo
from esd_worker.core.store.layout import SUMMARY_KEY, TABLES_PREFIX

INDEX_NAME = "index.html"
MODELS_FOLDER = "models/"  # models/<model_key>/ holds one model's page and plots
PAGE_NAME = "index.html"
ALPHA_PLOT = "alpha.png"
ESD_PLOT = "esd.png"
VS_BASE_PLOT = "vs_base.png"
PLOTS_FOLDER = "plots/"
STYLE = ("<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
         "table{border-collapse:collapse;font-size:13px;margin-bottom:1em}"
         "th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}"
         "th{background:#f0f0f0}td.l{text-align:left}img{max-width:100%;border:1px solid #ddd}"
         ".note{background:#fff6d5;padding:6px 10px;border:1px solid #e6d28a}</style>")

e = html.escape
# The model lists' column of summary.csv's params_analysed_share (of the models rows).
SHARE_HEADER = "params analysed"
# An untrusted text a page shows: a long local path or a page's parameters fit whole; a
# kilobyte of garbage is cut (echo says how much).
TEXT_CHARS = 1000


def shown(value: object, *, limit: int = TEXT_CHARS) -> str:
    """Untrusted text (a model id, a text a worker read from a model's files) as page text:
    secrets redacted and control characters escaped (esd_worker.core.echo), bounded, then
    HTML-escaped. For text this tool wrote itself `e` is enough."""
    return e(echo(value, limit=limit))


def fmt(value: float | int | None, digits: int = 3) -> str:
    """A cell: `digits` decimals; missing or NaN a dash."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def plot_name(metric: str, grouping: str) -> str:
    return f"{PLOTS_FOLDER}{metric}_by_{grouping}.png"


def model_link(key: str) -> str:
    return f"{MODELS_FOLDER}{key}/{PAGE_NAME}"


def head(title: str) -> list[str]:
    return ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{e(title)}</title>", STYLE, "</head><body>"]


def fit_lines(fit: Fit) -> list[str]:
    """What a page says first of how its numbers were fitted: the label, and when the band
    does not apply, one line why it is not shown."""
    out = [f'<p class="fit">Fit: <b>{e(fit.label)}</b></p>']
    if fit.note:
        out.append(f'<p class="note">{e(fit.note)}</p>')
    return out


def _quantile_table(grouped: GroupedHistograms, alpha: bool) -> str:
    """alpha: with the share in WeightWatcher's band (only where it applies)."""
    cols = ["group", "count", *(f"p{round(q * 100)}" for q in QUANTILES)]
    if alpha:
        cols.append(f"α in [{WW_ALPHA_BAND[0]:g}, {WW_ALPHA_BAND[1]:g}]")
    out = ["<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"]
    for name, hist in grouped.ordered():
        # a family is a config.json's architecture, lower-cased
        cells = [f'<td class="l">{shown(name)}</td>', f"<td>{hist.count}</td>"]
        cells += [f"<td>{fmt(q)}</td>" for q in hist.quantiles()]
        if alpha:
            cells.append(f"<td>{fmt(hist.band_share(), 2)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "".join(out) + "</table>"


def _model_list(title: str, rows: list[tuple[str, float]], names: Mapping[str, str],
                linked: set[str], value: str,
                shares: Mapping[str, float | None]) -> list[str]:
    """A list of models: rank, name (linked to its page), the metric's value and the share
    of its checkpoint's parameters its rows analysed (– where coverage was not recorded)."""
    out = [f"<h4>{e(title)}</h4>", f"<table><tr><th>#</th><th>model</th><th>{e(value)}</th>"
           f"<th>{e(SHARE_HEADER)}</th></tr>"]
    for n, (key, v) in enumerate(rows, start=1):
        name = shown(names.get(key, key))
        cell = f'<a href="{e(model_link(key))}">{name}</a>' if key in linked else name
        out.append(f'<tr><td>{n}</td><td class="l">{cell}</td><td>{fmt(v)}</td>'
                   f"<td>{fmt(shares.get(key))}</td></tr>")
    return [*out, "</table>"]


def index_html(view: Overview, failures: FailureGroups, *, source: str, tag: str | None,
               parts: int, names: Mapping[str, str], linked: set[str],
               plots: set[str], fit: Fit,
               shares: Mapping[str, float | None] | None = None) -> str:
    """The index page. names: model_key → model id of the listed models; linked: the keys
    with a per-model page; plots: the distribution PNGs written (relative paths); fit: of
    every model shown (reportfit.fit_of_models); shares: model_key → the share of its
    checkpoint's parameters analysed (params_analysed_share; None: not recorded)."""
    shares = shares or {}
    now = datetime.now(UTC).isoformat(timespec="seconds")
    params, others = view.common_parameters
    table = f"layers.{tag}.csv (refit, read from per-model files)" if tag else "results tables"
    out = [
        *head(f"ESD report: {source}"),
        "<h1>ESD report</h1>",
        f"<p>Results: <code>{e(source)}</code>; from the {e(table)}; generated {e(now)}.</p>",
        *fit_lines(fit),
        f"<p>{view.models} models, {view.layers} layers, "
        f"{sum(1 for f in view.families)} families, {parts} parts.</p>",
        f"<p>Fit settings: <code>{e(params) or '–'}</code>"
        + (f"; {others} model(s) use other settings" if others else "") + ".</p>",
        "<h2>Full tables</h2>",
        f'<p>Every model: <code>{e(TABLES_PREFIX)}models/</code>, every layer: '
        f"<code>{e(TABLES_PREFIX)}layers/</code> (hive-partitioned Parquet, by "
        f"architecture), and <code>{e(SUMMARY_KEY)}</code>, in the results store.</p>",
        "<pre>import pyarrow.dataset as ds\n"
        f"models = ds.dataset(\"{e(source.rstrip('/'))}/{e(TABLES_PREFIX)}models\", "
        "partitioning=\"hive\").to_table().to_pandas()</pre>",
    ]
    out.append("<h2>Distributions</h2>")
    for metric in HEADLINE:
        out.append(f"<h3>{e(metric)}</h3>")
        for grouping in GROUPINGS:
            path = plot_name(metric, grouping)
            out.append(f"<h4>by {e(grouping)}</h4>")
            if path in plots:
                out.append(f'<p><img src="{e(path)}" alt="{e(metric)} by {e(grouping)}" '
                           'loading="lazy"></p>')
            out.append(_quantile_table(view.hists[metric][grouping],
                                       fit.band and metric in BAND_METRICS))
    out.append("<h3>Layer α (fit ok) by family</h3>")
    if plot_name("layer_alpha", "family") in plots:
        out.append(f'<p><img src="{plot_name("layer_alpha", "family")}" '
                   'alt="layer alpha by family" loading="lazy"></p>')
    out.append(_quantile_table(view.layer_alpha, fit.band))
    out.append("<h2>Top, bottom and outliers</h2>")
    for metric in HEADLINE:
        out.append(f"<h3>{e(metric)}</h3>")
        out += _model_list(f"Top {view.top[metric].n}", view.top[metric].rows(), names,
                           linked, metric, shares)
        out += _model_list(f"Bottom {view.bottom[metric].n}", view.bottom[metric].rows(),
                           names, linked, metric, shares)
        if metric in view.outliers and view.outliers[metric].rows():
            out += _model_list("Outliers (|robust z| > 5)", view.outliers[metric].rows(),
                               names, linked, "|z|", shares)
    out += failures_html(failures)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def failures_html(groups: FailureGroups) -> list[str]:
    out = [f"<h2>Failures</h2><p>{groups.listed} failure record(s) in the store.</p>"]
    if groups.not_read:
        out.append(f'<p class="note">{groups.read + groups.unreadable} records read; the '
                   f"other {groups.not_read} are counted from the listing only.</p>")
    if groups.unreadable:
        out.append(f"<p>{groups.unreadable} record(s) could not be read.</p>")
    if not groups.counts:
        return out
    out.append("<table><tr><th>error</th><th>retryable</th><th>models</th>"
               "<th>examples</th></tr>")
    for error, retryable, count, examples in groups.rows():
        out.append(f'<tr><td class="l">{e(error)}</td><td>{"yes" if retryable else "no"}</td>'
                   f'<td>{count}</td><td class="l">{e(", ".join(examples))}</td></tr>')
    return [*out, "</table>"]
