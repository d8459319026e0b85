"""The report's page, index.html, and the names of the files in a report folder it links to.

Owns the page (what it covers, a table of models with their summary numbers and plot links,
then the plots) and the report folder's file names. Holds no data of its own: the numbers are
summary.csv's rows, the plots are controller.results.plots'. Plain HTML, relative links, no
JavaScript.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from controller.results.reader import ModelResult, number, short_name, table_name
from esd_worker.core.store.layout import SUMMARY_KEY

INDEX_NAME = "index.html"
SUMMARY_NAME = SUMMARY_KEY  # the report's own summary.csv: of the table reported on
PARQUET_NAME = "layers.parquet"
RELATION_PLOT = "alpha_by_relation.png"
MODELS_FOLDER = "models/"  # models/<model_key>/ holds one model's plots
ALPHA_PLOT = "alpha.png"
ESD_PLOT = "esd.png"
VS_BASE_PLOT = "vs_base.png"
INDEX_TABLE_MAX = 2000  # rows of the index's model table; summary.csv has every model


def _fmt(value: Any, digits: int = 3) -> str:
    """A table cell: `digits` decimals (counts, digits=0, as integers); missing or NaN a dash."""
    f = number(value)
    if value is None or value == "" or not math.isfinite(f):
        return "–"
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 and digits == 0 else f"{f:.{digits}f}"


def index_html(
    results: Sequence[ModelResult],
    summaries: Sequence[Mapping[str, Any]],
    bases: Mapping[str, str],
    plots: Mapping[str, Mapping[str, str]],
    *,
    source: str,
    tag: str | None,
    max_model_plots: int,
    layers: int,
) -> str:
    """The report page: what it covers, a table of models with their summary numbers and
    links to their plots, the across-model plot, then each plotted model's images. Links are
    relative (the report folder can be copied or served as is); no JavaScript."""
    e = html.escape
    by_key = {r.key: r for r in results}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    table = table_name(tag)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ESD report: {e(source)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
        "table{border-collapse:collapse;font-size:13px}"
        "th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}"
        "th{background:#f0f0f0}td.l{text-align:left}img{max-width:100%;border:1px solid #ddd}"
        ".note{background:#fff6d5;padding:6px 10px;border:1px solid #e6d28a}</style>",
        "</head><body>",
        "<h1>ESD report</h1>",
        f"<p>Results: <code>{e(source)}</code>; table <code>{e(table)}</code>; "
        f"{len(results)} model(s), {layers} layers; generated {e(now)}.</p>",
        f'<p>Files: <a href="{SUMMARY_NAME}">{SUMMARY_NAME}</a> (one row per model), '
        f'<a href="{PARQUET_NAME}">{PARQUET_NAME}</a> (one row per layer of every model).</p>',
    ]
    plotted = sum(1 for r in results if r.key in plots)
    if plotted < len(results):
        out.append(
            f'<p class="note">Per-model plots for the first {plotted} of {len(results)} '
            f"models in the table's order (--max-model-plots {max_model_plots}); every model "
            f"is in the table, {SUMMARY_NAME} and {PARQUET_NAME}.</p>"
        )
    shown = results[:INDEX_TABLE_MAX]
    shown_keys = {r.key for r in shown}
    if len(shown) < len(results):
        out.append(f'<p class="note">The table lists the first {len(shown)} of '
                   f"{len(results)} models; {SUMMARY_NAME} has them all.</p>")
    cols = ["#", "model", "relation", "base", "layers", "ok", "α mean", "α median",
            "α in [2, 6]", "stable rank", "log10 λmax", "log10 ‖W‖²", "plots"]
    out.append("<h2>Models</h2><table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>")
    for n, (r, s) in enumerate(zip(shown, summaries, strict=False), start=1):
        base_key = bases.get(r.key, "")
        if base_key in shown_keys:
            base = f'<a href="#row-{e(base_key)}">{e(by_key[base_key].name)}</a>'
        else:
            base = e(short_name(r.base_ref)) if r.base_ref else ""
        name = (f'<a href="#{e(r.key)}" title="{e(r.model_id)}">{e(r.name)}</a>'
                if r.key in plots else f'<span title="{e(r.model_id)}">{e(r.name)}</span>')
        links = " ".join(f'<a href="{e(path)}">{e(label)}</a>'
                         for label, path in plots.get(r.key, {}).items())
        cells = [
            str(n),
            name, e(r.relation), base,
            _fmt(s.get("layers"), 0), _fmt(s.get("layers_ok"), 0),
            _fmt(s.get("alpha_mean")), _fmt(s.get("alpha_median")),
            _fmt(s.get("alpha_in_2_6_share"), 2), _fmt(s.get("stable_rank_mean"), 2),
            _fmt(s.get("log_spectral_norm_mean")), _fmt(s.get("log_norm_mean")), links,
        ]
        left = {1, 2, 3, 12}
        out.append(f'<tr id="row-{e(r.key)}">' + "".join(
            f'<td class="l">{c}</td>' if i in left else f"<td>{c}</td>"
            for i, c in enumerate(cells)) + "</tr>")
    out.append("</table>")
    out.append(f'<h2>Across models</h2><p><img src="{RELATION_PLOT}" '
               'alt="distribution of alpha by relation"></p>')
    out.append("<h2>Per model</h2>")
    for r in results:
        mine = plots.get(r.key)
        if not mine:
            continue
        out.append(f'<h3 id="{e(r.key)}">{e(r.name)} <small>({e(r.relation)}, '
                   f"<code>{e(r.key)}</code>)</small></h3>")
        out.append(f"<p><small>{e(r.model_id)}</small></p>")
        for label, path in mine.items():
            out.append(f'<p><img src="{e(path)}" alt="{e(label)}: {e(r.name)}" '
                       'loading="lazy"></p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"
