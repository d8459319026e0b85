"""The report's per-model pages (models/<model_key>/index.html) and their plots, made only
for the models the index links to.

Owns: which plots a model gets (α per layer, ESD when eigs.npz is there, vs base for an
adapter whose base is also selected) and its page of summary numbers, its fit first (the
plots carry it too; WeightWatcher's band only where it applies, else one line why), then its
coverage (what the checkpoint holds, analysed and skipped by which rule: the models row's
copy of the marker's) and the quantization schemes its layer rows were dequantized from, if
any. The layer rows
come from one filtered pass over the layers table (tables.layer_rows), not a read per
model; the eigenvalues from <key>/eigs.npz. Not owned: drawing (plots.py), the index.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from controller.results.html import (
    ALPHA_PLOT,
    ESD_PLOT,
    MODELS_FOLDER,
    PAGE_NAME,
    VS_BASE_PLOT,
    e,
    fit_lines,
    fmt,
    head,
    shown,
)
from controller.results.plots import plot_alpha, plot_esd, plot_vs_base
from controller.results.reader import ModelResult, read_eigs, warn_damaged
from controller.results.reportfit import Fit, both
from esd_worker.core.echo import echo
from esd_worker.core.store.marker import DamagedResult
from esd_worker.core.store.results import number
from esd_worker.core.store.stores import Store

# The summary numbers shown on a model's page, from its models row.
PAGE_FIELDS = ("model_id", "revision", "relation", "base_model", "architecture", "family",
               "num_params", "layers", "layers_ok", "alpha_mean", "alpha_median",
               "alpha_weighted_mean", "stable_rank_mean", "log_spectral_norm_mean",
               "entropy_mean", "device", "total_s", "finished_at", "parameters")
NOT_RECORDED = "not recorded (written before coverage)"
# Skip rules (or quantization schemes) a page lists at most: a marker is a worker's text,
# and the worker has eight rules; a hostile one is cut.
MAX_KINDS = 50


def with_rows(shell: ModelResult, rows: list[dict[str, Any]]) -> ModelResult:
    """A shell (no rows) with its layer rows, as the plots read them (strings)."""
    text = [{k: ("" if v is None else str(v)) for k, v in row.items()} for row in rows]
    return replace(shell, rows=text)


def model_page(result: ModelResult, row: Mapping[str, Any], plots: Mapping[str, str], *,
               fit: Fit) -> str:
    """A model's page: its fit, its summary numbers, then its plots (paths relative to the
    page)."""
    out = [
        *head(f"ESD: {echo(result.model_id)}"),
        '<p><a href="../../index.html">← report</a></p>',
        f"<h1>{shown(result.name)}</h1><p><code>{shown(result.key)}</code></p>",
        *fit_lines(fit),
        "<table>",
    ]
    for name in PAGE_FIELDS:
        value = row.get(name)
        # the texts are a worker's (ids, a config.json's architecture): shown as untrusted
        cell = fmt(value) if isinstance(value, float) else shown("" if value is None else value)
        out.append(f'<tr><th>{e(name)}</th><td class="l">{cell}</td></tr>')
    out.append("</table>")
    out += coverage_lines(row.get("coverage"), row.get("params_analysed_share"))
    out += quantization_lines(result.rows)
    out += expert_lines(result.rows)
    for label, path in plots.items():
        out.append(f'<h2>{e(label)}</h2><p><img src="{e(path)}" alt="{e(label)}"></p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _count(value: object) -> str:
    """A count from a marker: an int as such, anything else as untrusted text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "–" if value is None else shown(value, limit=100)


def coverage_lines(coverage: str | None, share: float | None) -> list[str]:
    """The page's Coverage block from the models row's `coverage` (the marker's, as JSON):
    what the checkpoint holds, what its rows analysed (with the share of its parameters)
    and what each rule skipped, with one example key (docs/results.md says what each rule
    is). Every text is the worker's: shown as untrusted."""
    out = ["<h2>Coverage</h2>"]
    if coverage is None:
        return [*out, f"<p>{e(NOT_RECORDED)}</p>"]
    try:
        held = json.loads(coverage)
    except ValueError:
        held = None
    if not isinstance(held, dict):
        return [*out, "<p>not readable</p>"]
    analysed = held.get("analysed")
    analysed = analysed if isinstance(analysed, dict) else {}
    parameters = _count(analysed.get("parameters"))
    if share is not None:
        parameters += f" ({fmt(share * 100, 1)} % of the parameters)"
    out += ['<table class="coverage">',
            f"<tr><th>tensors held</th><td>{_count(held.get('tensors'))}</td></tr>",
            f"<tr><th>parameters held</th><td>{_count(held.get('parameters'))}</td></tr>",
            f"<tr><th>analysed tensors</th><td>{_count(analysed.get('tensors'))}</td></tr>",
            f"<tr><th>analysed matrices</th><td>{_count(analysed.get('matrices'))}</td></tr>",
            f"<tr><th>analysed parameters</th><td>{parameters}</td></tr>", "</table>"]
    if held.get("warning"):
        out.append(f'<p class="note">{shown(held["warning"])}</p>')
    skipped = held.get("skipped")
    skipped = skipped if isinstance(skipped, dict) else {}
    if not skipped:
        return [*out, "<p>No tensor skipped.</p>"]
    out.append('<table class="skipped"><tr><th>skipped by rule</th><th>tensors</th>'
               "<th>parameters</th><th>example</th></tr>")
    for rule, entry in list(skipped.items())[:MAX_KINDS]:
        entry = entry if isinstance(entry, dict) else {}
        example = entry.get("example")
        out.append(f'<tr><td class="l">{shown(rule, limit=100)}</td>'
                   f"<td>{_count(entry.get('tensors'))}</td>"
                   f"<td>{_count(entry.get('parameters'))}</td>"
                   f'<td class="l"><code>{shown("" if example is None else example)}</code>'
                   "</td></tr>")
    out.append("</table>")
    if len(skipped) > MAX_KINDS:
        out.append(f"<p>… and {len(skipped) - MAX_KINDS} more rules.</p>")
    return out


def quantization_lines(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The schemes the model's layer rows were dequantized from (layers.csv `quantization`),
    each with its count of rows and one layer; nothing when every row was read as stored."""
    schemes: Counter[str] = Counter()
    example: dict[str, str] = {}
    for row in rows:
        scheme = row.get("quantization") or ""
        if scheme:
            schemes[scheme] += 1
            example.setdefault(scheme, row.get("layer") or "")
    if not schemes:
        return []
    stored = len(rows) - sum(schemes.values())
    out = ["<h2>Quantization</h2>",
           f"<p>{len(rows)} layer rows: {stored} read as stored, the others dequantized "
           "from:</p>",
           '<table class="quantization"><tr><th>scheme</th><th>layer rows</th>'
           "<th>example</th></tr>"]
    for scheme, count in schemes.most_common(MAX_KINDS):
        out.append(f'<tr><td class="l">{shown(scheme, limit=100)}</td><td>{count}</td>'
                   f'<td class="l"><code>{shown(example[scheme])}</code></td></tr>')
    return [*out, "</table>"]


# An expert row's index: after its `experts` part (`mlp.experts.3.gate_up_proj`), else last
# (`block_sparse_moe.input_linear.3`, GGUF's `blk.0.ffn_gate_exps.3`): docs/metrics.md.
_EXPERT_PART = re.compile(r"(^|\.)(experts?)\.\d+(?=\.|$)")
_LAST_INDEX = re.compile(r"\.\d+$")
MAX_GROUPS = 500


def expert_group(layer: str) -> str:
    """An expert row's layer with its expert index as `*`: one layer's matrix, every expert."""
    grouped, n = _EXPERT_PART.subn(r"\1\2.*", layer, count=1)
    return grouped if n else _LAST_INDEX.sub(".*", layer)


def expert_lines(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """A mixture of experts' rows grouped per layer and matrix (thousands of rows otherwise):
    each group's experts, how many were fitted, and α's mean, min and max over those;
    nothing for a model without Expert rows."""
    counts: Counter[str] = Counter()
    alphas: dict[str, list[float]] = {}
    for row in rows:
        if row.get("layer_type") != "Expert":
            continue
        group = expert_group(row.get("layer") or "")
        counts[group] += 1
        alpha = number(row.get("alpha"))
        if row.get("status") == "ok" and math.isfinite(alpha):
            alphas.setdefault(group, []).append(alpha)
    if not counts:
        return []
    out = ["<h2>Experts</h2>",
           f"<p>{sum(counts.values())} expert rows in {len(counts)} groups (a layer's matrix "
           "over its experts, the expert index written *); α over each group's fitted "
           "rows.</p>",
           '<table class="experts"><tr><th>layer</th><th>experts</th><th>fitted</th>'
           "<th>α mean</th><th>α min</th><th>α max</th></tr>"]
    for group, count in list(counts.items())[:MAX_GROUPS]:
        got = alphas.get(group, [])
        stats = ([fmt(math.fsum(got) / len(got)), fmt(min(got)), fmt(max(got))] if got
                 else ["–"] * 3)
        out.append(f'<tr><td class="l"><code>{shown(group)}</code></td><td>{count}</td>'
                   f"<td>{len(got)}</td>" + "".join(f"<td>{v}</td>" for v in stats) + "</tr>")
    out.append("</table>")
    if len(counts) > MAX_GROUPS:
        out.append(f"<p>… and {len(counts) - MAX_GROUPS} more groups (layers.csv has them "
                   "all).</p>")
    return out


def write_model_page(store: Store, result: ModelResult, row: Mapping[str, Any],
                     base: ModelResult | None, *, fit: Fit, base_fit: Fit | None,
                     esd_layers: int, evals_thresh: float | None,
                     put: Callable[[str, bytes], None]) -> None:
    """Draw one model's plots and write its page under models/<key>/. fit: the model's,
    base_fit: its base's (for the vs-base plot)."""
    folder = f"{MODELS_FOLDER}{result.key}/"
    plots: dict[str, str] = {}
    put(folder + ALPHA_PLOT, plot_alpha(result, fit=fit))
    plots["α per layer"] = ALPHA_PLOT
    try:
        eigs = read_eigs(store, result)
    except DamagedResult as err:  # the rows are whole: plot without the spectra
        warn_damaged(result.key, err)
        eigs = None
    esd = (plot_esd(result, eigs, fit=fit, count=esd_layers, evals_thresh=evals_thresh)
           if eigs else None)
    if esd is not None:
        put(folder + ESD_PLOT, esd)
        plots["ESD"] = ESD_PLOT
    vs = (plot_vs_base(result, base, fit=both(fit, base_fit or fit))
          if base is not None else None)
    if vs is not None:
        put(folder + VS_BASE_PLOT, vs)
        plots["vs base"] = VS_BASE_PLOT
    put(folder + PAGE_NAME, model_page(result, row, plots, fit=fit).encode("utf-8"))
