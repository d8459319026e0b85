"""The report of a results store for people: summary.csv, layers.parquet, PNG plots, index.html.

Also owns reading a results store as a whole (every model's marker and layer table, an
adapter's base), which `refit` and `compare` share. Computes no metrics: the numbers are the
worker's (or a refit's). matplotlib and pyarrow (the `[report]` extra) are imported only
when a report is written, so refit and compare work without them.
"""

from __future__ import annotations

import argparse
import html
import importlib
import io
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from controller.errors import ResultsError
from controller.modellist import ModelRow
from controller.plan import list_markers, read_markers
from controller.results.summary import summary_row, summary_to_csv
from esd_worker.flags import add_flag
from esd_worker.naming import model_key, split_model_ref
from esd_worker.results import eigs_from_npz, layers_from_csv, summarize_layers
from esd_worker.store import EIGS_NAME, LAYERS_NAME, LocalStore, Store, open_store

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

REPORT_PREFIX = "report/"
REFITS_PREFIX = "refits/"
INDEX_NAME = "index.html"
SUMMARY_NAME = "summary.csv"
PARQUET_NAME = "layers.parquet"
RELATION_PLOT = "alpha_by_relation.png"
ALPHA_PLOT = "alpha.png"
ESD_PLOT = "esd.png"
VS_BASE_PLOT = "vs_base.png"
DEFAULT_MAX_MODEL_PLOTS = 50
DEFAULT_ESD_LAYERS = 6
PARQUET_ROW_GROUP = 100_000  # rows per Parquet row group (whole models: at least one)
INDEX_TABLE_MAX = 2000  # rows of the index's model table; summary.csv has every model
UNLABELLED = "unlabelled"  # models listed without a base_model_relation

# α of a trained layer is typically 2..6 (HT-SR); far above, the ESD has no heavy tail and
# the exact value says little. Plots clip there so the interesting range stays readable.
ALPHA_BAND = (2.0, 6.0)
ALPHA_CLIP = 12.0

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
_INT_COLUMNS = frozenset(
    {"M", "N", "num_params", "num_evals", "num_pl_spikes", "matrix_rank"}
)
_TEXT_COLUMNS = frozenset({"model_id", "revision", "layer", "layer_type", "fix_fingers", "status"})


# --------------------------------------------------------------------------- reading a store


def check_tag(tag: str) -> str:
    """`tag` when it is a valid table tag (letters, digits, . _ + -), else ResultsError."""
    if not _TAG.fullmatch(tag):
        raise ResultsError(
            f"invalid tag {tag!r}: use 1-100 letters, digits, '.', '_', '+' or '-', "
            "starting with a letter or digit"
        )
    return tag


def layers_name(tag: str | None = None) -> str:
    """File name of a model's layer table: layers.csv, or layers.<tag>.csv for a refit."""
    return LAYERS_NAME if not tag else f"layers.{check_tag(tag)}.csv"


def refit_record_key(tag: str) -> str:
    """Where a refit records its settings and counts: refits/<tag>.json."""
    return f"{REFITS_PREFIX}{check_tag(tag)}.json"


def read_refit_record(store: Store, tag: str) -> dict[str, Any] | None:
    """The record of refit `tag` (None when missing or unreadable)."""
    data = store.get_bytes(refit_record_key(tag))
    if data is None:
        return None
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def open_results(url: str) -> Store:
    """The store at `url`, which must exist: a missing local directory is a ResultsError.

    Remote stores are not contacted here; their errors come with the first listing
    (StoreError: exit 3).
    """
    store = open_store(url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise ResultsError(f"no results at {url}: no such directory")
    return store


@dataclass(frozen=True)
class ModelResult:
    """One analysed model: its marker (result.json) and the rows of one of its layer tables.

    rows: layers.csv (or layers.<tag>.csv) as strings, in the worker's layer order.
    """

    key: str
    marker: Mapping[str, Any]
    rows: list[dict[str, str]] = field(repr=False)

    @property
    def model_id(self) -> str:
        return str(self.marker.get("model_id") or self.marker.get("model") or self.key)

    @property
    def name(self) -> str:
        """A short name for plots: the last two path segments of the id, @revision kept."""
        rev = self.marker.get("revision")
        return short_name(self.model_id if not rev else f"{self.model_id}@{rev}")

    @property
    def relation(self) -> str:
        """base_model_relation from the marker; adapters without one are "adapter"."""
        relation = str(self.marker.get("relation") or "").lower()
        if not relation and isinstance(self.marker.get("adapter"), Mapping):
            relation = "adapter"
        return relation or UNLABELLED

    @property
    def base_ref(self) -> str | None:
        """The adapter's base as the worker resolved it (marker base_model.model), or None."""
        base = self.marker.get("base_model")
        ref = base.get("model") if isinstance(base, Mapping) else None
        return str(ref) if ref else None

    @property
    def parameters(self) -> Mapping[str, Any]:
        params = self.marker.get("parameters")
        return params if isinstance(params, Mapping) else {}


def short_name(model_id: str, limit: int = 48) -> str:
    """`org/name` of a hub id; the last two segments of a local path; at most `limit` chars."""
    parts = [p for p in re.split(r"[/\\]+", model_id) if p]
    text = "/".join(parts[-2:]) if parts else model_id
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def _fetch_all(store: Store, keys: Sequence[str], threads: int) -> list[bytes | None]:
    if not keys:
        return []
    if threads <= 1 or len(keys) == 1:
        return [store.get_bytes(k) for k in keys]
    with ThreadPoolExecutor(max_workers=min(threads, len(keys))) as pool:
        return list(pool.map(store.get_bytes, keys))


def read_model_markers(
    store: Store, *, keys: Iterable[str] | None = None, threads: int = 16
) -> dict[str, dict[str, Any]]:
    """model_key → marker of every model of the store (or of `keys`), sorted by key.

    No marker at all, or a key in `keys` without one, is a ResultsError; corrupt markers
    are left out (controller.plan logs them).
    """
    present = list_markers(store)
    if not present:
        raise ResultsError(f"no results in {store.url}: no <model_key>/result.json found")
    wanted = sorted(present)
    if keys is not None:
        asked = list(dict.fromkeys(keys))
        missing = [k for k in asked if k not in present]
        if missing:
            raise ResultsError(
                f"no result for model key(s) {', '.join(missing)} in {store.url}"
            )
        wanted = sorted(asked)
    markers = read_markers(store, wanted, threads=threads)
    return {k: m for k in wanted if (m := markers.get(k)) is not None}


def iter_results(
    store: Store,
    markers: Mapping[str, Mapping[str, Any]],
    order: Sequence[str],
    *,
    tag: str | None = None,
    threads: int = 16,
    chunk: int = 256,
) -> Iterator[ModelResult]:
    """The models of `order` with their layer table, read `chunk` at a time (concurrently), so
    that a store of any size is held in memory one chunk at a time. Models without that
    table are left out with one warning at the end."""
    missing: list[str] = []
    for start in range(0, len(order), chunk):
        keys = order[start:start + chunk]
        blobs = _fetch_all(store, [f"{k}/{_table_name(markers[k], tag)}" for k in keys],
                           threads)
        for key, data in zip(keys, blobs, strict=True):
            if data is None:
                missing.append(key)
            else:
                yield ModelResult(key, markers[key], layers_from_csv(data))
    if missing:
        log.warning("%d model(s) without %s left out: %s", len(missing), layers_name(tag),
                    ", ".join(missing[:5]))


def no_table_error(store: Store, tag: str | None) -> ResultsError:
    hint = f": run `esd-sweep refit --tag {tag}` first" if tag else ""
    return ResultsError(f"no {layers_name(tag)} in {store.url}{hint}")


def load_results(
    store: Store,
    *,
    tag: str | None = None,
    keys: Iterable[str] | None = None,
    threads: int = 16,
) -> list[ModelResult]:
    """Every model of the store (or of `keys`) with a marker and the layer table `tag`
    names, sorted by key, all in memory (iter_results reads a chunk at a time).

    A model without that table is left out with a warning; no model at all is a
    ResultsError.
    """
    markers = read_model_markers(store, keys=keys, threads=threads)
    results = list(iter_results(store, markers, list(markers), tag=tag, threads=threads))
    if not results:
        raise no_table_error(store, tag)
    return results


def _table_name(marker: Mapping[str, Any], tag: str | None) -> str:
    if tag:
        return layers_name(tag)
    outputs = marker.get("outputs")
    name = outputs.get("layers") if isinstance(outputs, Mapping) else None
    return str(name or LAYERS_NAME)


def read_eigs(store: Store, result: ModelResult) -> dict[str, np.ndarray] | None:
    """The model's stored eigenvalues by layer name, or None without eigs.npz."""
    outputs = result.marker.get("outputs")
    name = outputs.get("eigs", EIGS_NAME) if isinstance(outputs, Mapping) else EIGS_NAME
    data = store.get_bytes(f"{result.key}/{name or EIGS_NAME}")
    return None if data is None else eigs_from_npz(data)


def find_base_key(
    result: ModelResult, by_model: Mapping[str, str], present: Iterable[str]
) -> str | None:
    """model_key of an adapter's base in the same store, or None (not an adapter, not there).

    by_model: marker "model" (the reference the worker was given) → model_key. The base is
    the model analysed under exactly the reference the adapter's worker resolved; failing
    that, the key that reference would get as a hub id (`org/name@rev`) or a path.
    """
    ref = result.base_ref
    if ref is None:
        return None
    if ref in by_model:
        return by_model[ref]
    keys = set(present)
    for candidate in (model_key(*split_model_ref(ref)), model_key(ref)):
        if candidate in keys:
            return candidate
    return None


def base_keys(results: Sequence[ModelResult]) -> dict[str, str]:
    """Adapter model_key → its base's model_key, for the adapters whose base is in `results`."""
    by_model = {str(r.marker.get("model")): r.key for r in results if r.marker.get("model")}
    present = [r.key for r in results]
    found: dict[str, str] = {}
    for r in results:
        base = find_base_key(r, by_model, present)
        if base is not None and base != r.key:
            found[r.key] = base
    return found


def number(value: Any) -> float:
    """A table cell as float; empty or unparsable cells are NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# --------------------------------------------------------------------------- tables


def summary_rows(
    results: Sequence[ModelResult], store: Store, *, recompute: bool = False
) -> list[dict[str, Any]]:
    """summary.csv rows (controller.results.summary.SUMMARY_COLUMNS), one per result.

    recompute: statistics from the rows held (a refit table) instead of the marker's summary.
    """
    rows = []
    for r in results:
        marker = dict(r.marker)
        if recompute or not isinstance(marker.get("summary"), Mapping):
            marker["summary"] = summarize_layers(r.rows)
        rev = marker.get("revision")
        model = ModelRow(
            model_id=r.model_id,
            revision=str(rev) if rev else None,
            relation=str(marker.get("relation") or ""),
            source_model=None,
        )
        rows.append(summary_row(model, marker, store))
    return rows




def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ResultsError(
            f"the report needs {module.split('.')[0]}: pip install 'esd-sweep[report]'"
        ) from e


def layers_table(results: Sequence[ModelResult], bases: Mapping[str, str]) -> Any:
    """A pyarrow Table of every layer of every model: model_key, model, relation, base_key,
    layer_index, then the layer table's columns typed (ints, floats, strings; NaN kept)."""
    pa = _require("pyarrow")
    from esd_worker.results import LAYER_COLUMNS

    columns: dict[str, list[Any]] = {
        c: [] for c in ("model_key", "model", "relation", "base_key", "layer_index")
    }
    for c in LAYER_COLUMNS:
        columns[c] = []
    for r in results:
        for i, row in enumerate(r.rows):
            columns["model_key"].append(r.key)
            columns["model"].append(str(r.marker.get("model") or r.model_id))
            columns["relation"].append(r.relation)
            columns["base_key"].append(bases.get(r.key))
            columns["layer_index"].append(i)
            for c in LAYER_COLUMNS:
                cell = row.get(c, "")
                if c in _TEXT_COLUMNS:
                    columns[c].append(cell or None)
                elif c in _INT_COLUMNS:
                    f = number(cell)
                    columns[c].append(int(f) if math.isfinite(f) else None)
                else:
                    columns[c].append(number(cell))
    types: dict[str, Any] = {"layer_index": pa.int64()}
    for c in columns:
        if c in types:
            continue
        if c in _INT_COLUMNS:
            types[c] = pa.int64()
        elif c in _TEXT_COLUMNS or c in ("model_key", "model", "relation", "base_key"):
            types[c] = pa.string()
        else:
            types[c] = pa.float64()
    schema = pa.schema([(c, types[c]) for c in columns])
    return pa.table({c: pa.array(v, type=types[c]) for c, v in columns.items()}, schema=schema)


# --------------------------------------------------------------------------- plots


def _figure(
    width: float, height: float, *, layout: Literal["constrained"] | None = "constrained"
) -> Figure:
    """A Figure on the Agg canvas: no display, no pyplot global state."""
    _require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _kind(layer: str) -> str:
    """The module kind of a layer name: its last component (q_proj, c_attn, query, …)."""
    return layer.rsplit(".", 1)[-1]


def _alpha_limits(alphas: Iterable[float]) -> float:
    finite = [a for a in alphas if math.isfinite(a)]
    top = max(finite, default=ALPHA_BAND[1])
    return min(max(top * 1.08, ALPHA_BAND[1] + 1.0), ALPHA_CLIP)


def _band(ax: Axes) -> None:
    ax.axhspan(*ALPHA_BAND, color="tab:green", alpha=0.10, lw=0,
               label=f"{ALPHA_BAND[0]:g} ≤ α ≤ {ALPHA_BAND[1]:g}")


def plot_alpha(result: ModelResult) -> bytes:
    """α per layer in model order: the 2–6 band shaded, points coloured by module kind,
    fit_failed layers marked with a red x and other unanalysed layers with a grey bar at
    the bottom, α above the plot's top (ALPHA_CLIP) drawn as triangles at the edge."""
    rows = result.rows
    n = len(rows)
    fig = _figure(min(14.0, max(7.0, 0.12 * n + 4.0)), 4.2)
    ax = fig.subplots()
    ok = [(i, number(r.get("alpha")), _kind(r.get("layer", ""))) for i, r in enumerate(rows)
          if r.get("status") == "ok" and math.isfinite(number(r.get("alpha")))]
    top = _alpha_limits(a for _, a, _ in ok)
    _band(ax)
    kinds = list(dict.fromkeys(k for _, _, k in ok))
    size = 28 if n <= 80 else 12
    # Colour by module kind when that tells something (2..10 kinds), else one colour.
    series = kinds if 1 < len(kinds) <= 10 else [None]
    for k in series:
        xs = [i for i, a, kk in ok if (k is None or kk == k) and a <= top]
        ys = [a for _, a, kk in ok if (k is None or kk == k) and a <= top]
        if xs:
            ax.scatter(xs, ys, s=size, zorder=3, label=k or "α (fit ok)",
                       color=None if k else "tab:blue")
    over = [i for i, a, _ in ok if a > top]
    if over:
        ax.scatter(over, [top] * len(over), marker="^", s=size + 10, color="black",
                   clip_on=False, zorder=4, label=f"α > {top:.0f} ({len(over)})")
    failed = [i for i, r in enumerate(rows) if r.get("status") == "fit_failed"]
    if failed:
        ax.scatter(failed, [0.4] * len(failed), marker="x", s=size + 12, color="tab:red",
                   zorder=4, label=f"fit failed ({len(failed)})")
    other: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        status = r.get("status", "")
        if status not in ("ok", "fit_failed"):
            other.setdefault(status or "?", []).append(i)
    for status, idx in other.items():
        ax.scatter(idx, [0.4] * len(idx), marker="|", s=size + 40, color="0.45", zorder=4,
                   label=f"{status} ({len(idx)})")
    if ok:
        mean = float(np.mean([a for _, a, _ in ok]))
        ax.axhline(mean, color="0.3", ls="--", lw=1, label=f"mean α = {mean:.2f}")
    ax.set_xlim(-1, max(n, 1))
    ax.set_ylim(0, top)
    ax.set_xlabel("layer index (model order)")
    ax.set_ylabel("α (power-law exponent)")
    fix = rows[0].get("fix_fingers", "") if rows else ""
    ax.set_title(f"{result.name}: α per layer ({len(ok)} of {n} fitted, {fix})", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _png(fig)


@dataclass
class RelationAlphas:
    """Layer α (ok fits) and model mean α by relation, gathered one model at a time."""

    layers: dict[str, list[float]] = field(default_factory=dict)
    means: dict[str, list[float]] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)

    def add(self, result: ModelResult) -> None:
        alphas = [number(row.get("alpha")) for row in result.rows
                  if row.get("status") == "ok"]
        alphas = [a for a in alphas if math.isfinite(a)]
        rel = result.relation
        self.models[rel] = self.models.get(rel, 0) + 1
        self.layers.setdefault(rel, []).extend(alphas)
        if alphas:
            self.means.setdefault(rel, []).append(float(np.mean(alphas)))


def plot_alpha_by_relation(results: Sequence[ModelResult] | RelationAlphas) -> bytes:
    """Distribution of layer α (ok fits) per relation as box plots, with each model's mean α
    as a dot beside its box; the 2–6 band shaded; α above ALPHA_CLIP counted, not drawn."""
    stats = results if isinstance(results, RelationAlphas) else RelationAlphas()
    if not isinstance(results, RelationAlphas):
        for r in results:
            stats.add(r)
    groups, means, models = stats.layers, stats.means, stats.models
    order = sorted(groups, key=_relation_order)
    fig = _figure(max(6.0, 1.6 * len(order) + 3.0), 4.6)
    ax = fig.subplots()
    _band(ax)
    top = _alpha_limits(a for rel in order for a in groups[rel])
    data = [[a for a in groups[rel] if a <= top] for rel in order]
    positions = list(range(1, len(order) + 1))
    if any(data):
        ax.boxplot([d if d else [math.nan] for d in data], positions=positions, widths=0.45,
                   showfliers=True, flierprops={"markersize": 3, "alpha": 0.5},
                   medianprops={"color": "tab:orange", "lw": 2})
    rng = np.random.default_rng(0)  # fixed jitter: the same store gives the same picture
    for pos, rel in zip(positions, order, strict=True):
        m = [min(v, top) for v in means.get(rel, [])]
        if m:
            x = pos + 0.33 + rng.uniform(-0.06, 0.06, len(m))
            ax.scatter(x, m, s=18, color="tab:purple", zorder=3,
                       label="model mean α" if pos == positions[0] else None)
        over = sum(1 for a in groups[rel] if a > top)
        if over:
            ax.annotate(f"+{over} > {top:.0f}", (pos, top), xytext=(0, -12),
                        textcoords="offset points", ha="center", fontsize=8)
    ax.plot([], [], color="tab:orange", lw=2, label="median (box: quartiles)")
    labels = [f"{rel}\n{models[rel]} model(s)\n{len(groups[rel])} layers" for rel in order]
    ax.set_xticks(positions, labels)
    ax.set_xlim(0.4, len(order) + 0.8)
    ax.set_ylim(0, top)
    ax.set_ylabel("α per layer (fit ok)")
    ax.set_title("α across models by relation", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def _relation_order(rel: str) -> tuple[int, str]:
    known = ("base", "finetune", "adapter", "lora", "peft", "quantized", "merge")
    return (known.index(rel) if rel in known else len(known), rel)


def pick_esd_layers(result: ModelResult, eigs: Mapping[str, np.ndarray], count: int) -> list[int]:
    """Row indices of the layers to draw, in model order: all with eigenvalues when count is
    0 or covers them; else layers at evenly spaced α quantiles (lowest, median, highest, …)
    of the fitted layers, topped up with unfitted ones."""
    have = [i for i, r in enumerate(result.rows) if r.get("layer") in eigs]
    if count <= 0 or count >= len(have):
        return have
    fitted = sorted((i for i in have if math.isfinite(number(result.rows[i].get("alpha")))),
                    key=lambda i: number(result.rows[i].get("alpha")))
    picks: list[int] = []
    if fitted:
        for q in np.linspace(0, len(fitted) - 1, min(count, len(fitted))):
            i = fitted[round(float(q))]
            if i not in picks:
                picks.append(i)
    for i in have:
        if len(picks) >= count:
            break
        if i not in picks:
            picks.append(i)
    return sorted(picks)


def _short_layer(name: str, limit: int = 44) -> str:
    """The layer name, its leading components dropped (whole ones) until it fits."""
    parts = name.split(".")
    while len(parts) > 1 and len(".".join(parts)) > limit - 1:
        parts = parts[1:]
    text = ".".join(parts)
    text = text if len(text) <= limit - 1 else text[-(limit - 1):]
    return text if text == name else "…" + text


def plot_esd(
    result: ModelResult,
    eigs: Mapping[str, np.ndarray],
    *,
    count: int = DEFAULT_ESD_LAYERS,
    evals_thresh: float | None = None,
) -> bytes | None:
    """The ESD of chosen layers on log-log axes, as WeightWatcher draws it: a density
    histogram of λ (log-spaced bins, λ > evals_thresh), the fitted power law
    p(λ) ∝ λ^-α from xmin (scaled to the tail's share of the eigenvalues so it lies on the
    histogram), and a vertical line at xmin. None when no layer has eigenvalues.

    evals_thresh: the fit's (default: the marker's parameters; a refit's differ).
    """
    picks = pick_esd_layers(result, eigs, count)
    if not picks:
        return None
    thresh = number(result.parameters.get("evals_thresh", 1e-5)
                    if evals_thresh is None else evals_thresh)
    thresh = thresh if math.isfinite(thresh) else 1e-5
    cols = min(3, len(picks))
    nrows = math.ceil(len(picks) / cols)
    width, height = 4.3 * cols, 3.3 * nrows + 0.5
    # Fixed margins in inches instead of a layout engine: the grid is regular, and the
    # constrained layout's extra draw passes nearly double the time of a many-panel figure.
    fig = _figure(width, height, layout=None)
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - 0.6 / height, wspace=0.95 / 3.4, hspace=0.8 / 2.3)
    axes = np.atleast_1d(fig.subplots(nrows, cols, squeeze=False)).ravel()
    for ax, i in zip(axes, picks, strict=False):
        row = result.rows[i]
        lam = np.asarray(eigs[row["layer"]], dtype=np.float64)
        lam = lam[lam > thresh]
        _draw_esd(ax, lam, row)
    for ax in axes[len(picks):]:
        ax.set_visible(False)
    how = "all layers" if len(picks) == sum(1 for r in result.rows if r.get("layer") in eigs) \
        else "layers at α quantiles"
    fig.suptitle(f"{result.name}: ESD, {len(picks)} of {len(result.rows)} layers ({how})",
                 fontsize=11, y=1 - 0.15 / height, va="top")
    return _png(fig)


def _draw_esd(ax: Axes, lam: np.ndarray, row: Mapping[str, str]) -> None:
    ax.set_title(_short_layer(row.get("layer", "")), fontsize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue λ", fontsize=8)
    ax.set_ylabel("density", fontsize=8)
    ax.tick_params(labelsize=7)
    if lam.size < 2 or lam[0] == lam[-1]:
        ax.text(0.5, 0.5, "too few distinct eigenvalues", transform=ax.transAxes,
                ha="center", fontsize=8)
        return
    bins = np.logspace(math.log10(lam[0]), math.log10(lam[-1]), max(10, min(80, lam.size // 4)))
    density, edges = np.histogram(lam, bins=bins, density=True)
    floor = float(density[density > 0].min()) / 3.0  # empty bins sit here: log(0) is nowhere
    # One stairs artist, not a patch per bin as ax.hist draws: several times faster to render.
    ax.stairs(np.maximum(density, floor), edges, baseline=floor, fill=True, color="tab:blue",
              alpha=0.55, label="ESD (density)")
    alpha, xmin = number(row.get("alpha")), number(row.get("xmin"))
    if row.get("status") == "ok" and math.isfinite(alpha) and math.isfinite(xmin) and xmin > 0:
        share = float(np.count_nonzero(lam >= xmin)) / lam.size
        x = np.logspace(math.log10(xmin), math.log10(lam[-1]), 50)
        y = share * (alpha - 1.0) / xmin * (x / xmin) ** (-alpha)
        D = number(row.get("D"))
        ax.plot(x, y, color="tab:red", lw=2, label=f"power law α={alpha:.2f}, D={D:.3f}")
        ax.axvline(xmin, color="tab:red", ls="--", lw=1, label=f"xmin={xmin:.3g}")
    else:
        ax.text(0.03, 0.05, f"no fit ({row.get('status', '?')})", transform=ax.transAxes,
                fontsize=8, color="tab:red")
    ax.legend(fontsize=7, loc="lower left")
    _sparse_log_ticks(ax)


def _sparse_log_ticks(ax: Axes) -> None:
    """On axes spanning more than 3 decades: a few decade ticks and no minor ticks. Readable,
    and fast: every tick costs milliseconds to draw, and 8 decades have ~70 by default
    (seconds per figure). Narrower axes keep matplotlib's labelled minor ticks, without
    which less than a decade would show no number at all."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        if lo > 0 and hi > lo and math.log10(hi / lo) > 3:
            axis.set_major_locator(LogLocator(numticks=6))
            axis.set_minor_locator(NullLocator())
        else:  # plain numbers (0.02, 0.05, 0.1): 1, 2, 5 per decade on the narrowest axes
            wide = lo > 0 and hi > lo and math.log10(hi / lo) > 2
            axis.set_major_locator(LogLocator(subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
            axis.set_minor_locator(NullLocator())
            axis.set_major_formatter(plain)
    ax.tick_params(which="both", labelsize=7)


def plot_vs_base(adapter: ModelResult, base: ModelResult) -> bytes | None:
    """Adapter vs its base, layers matched by name. Left: α per layer (base order) of both.
    Right: α_adapter against α_base with the diagonal; layers whose spectrum the adapter
    changed (λ_max differs) in colour, untouched layers grey. None when no layer matches."""
    by_name = {r.get("layer"): r for r in adapter.rows}
    pairs = [(i, b, by_name[b["layer"]]) for i, b in enumerate(base.rows)
             if b.get("layer") in by_name]
    if not pairs:
        return None
    fig = _figure(13.0, 4.6)
    left, right = fig.subplots(1, 2, width_ratios=[1.7, 1.0])
    alphas = [number(r.get("alpha")) for _, b, a in pairs for r in (a, b)]
    top = _alpha_limits(alphas)
    _band(left)
    idx = [i for i, _, _ in pairs]
    a_base = np.array([min(number(b.get("alpha")), top) for _, b, _ in pairs])
    a_adap = np.array([min(number(a.get("alpha")), top) for _, _, a in pairs])
    left.vlines(idx, a_base, a_adap, color="tab:blue", alpha=0.35, lw=1.5, zorder=2)
    left.scatter(idx, a_base, s=36, facecolors="none", edgecolors="0.35", label="base", zorder=3)
    left.scatter(idx, a_adap, s=14, color="tab:blue", label="adapter", zorder=4)
    left.set_ylim(0, top)
    left.set_xlabel("layer index (base model order)")
    left.set_ylabel("α (power-law exponent)")
    left.set_title("α per layer", fontsize=10)
    left.grid(True, axis="y", alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    changed = np.array([number(a.get("spectral_norm")) != number(b.get("spectral_norm"))
                        for _, b, a in pairs])
    lims = (0.0, top)
    right.plot(lims, lims, color="0.5", lw=1, ls="--", label="α_adapter = α_base")
    if (~changed).any():
        right.scatter(a_base[~changed], a_adap[~changed], s=16, color="0.6",
                      label=f"unchanged ({int((~changed).sum())})")
    if changed.any():
        right.scatter(a_base[changed], a_adap[changed], s=18, color="tab:blue",
                      label=f"changed by adapter ({int(changed.sum())})")
    right.set_xlim(*lims)
    right.set_ylim(*lims)
    right.set_aspect("equal")
    right.set_xlabel("α base")
    right.set_ylabel("α adapter")
    right.set_title("adapter vs base, per layer", fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    right.grid(True, alpha=0.3)
    fig.suptitle(f"{adapter.name} vs its base {base.name}", fontsize=11)
    return _png(fig)


# --------------------------------------------------------------------------- the report


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
        problems = []
        if self.max_model_plots < 0:
            problems.append(f"--max-model-plots: must be >= 0, got {self.max_model_plots}")
        if self.esd_layers < 0:
            problems.append(f"--esd-layers: must be >= 0, got {self.esd_layers}")
        if self.threads < 1:
            problems.append(f"--threads: must be >= 1, got {self.threads}")
        if self.tag is not None and not _TAG.fullmatch(self.tag):
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
    """Writes under a prefix of a store."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def put(self, key: str, data: bytes) -> None:
        self.store.put_bytes(self.prefix + key, data)


def _order(results: Sequence[ModelResult], bases: Mapping[str, str]) -> list[ModelResult]:
    """Index order: base models each followed by their adapters, then the rest, by name."""
    by_key = {r.key: r for r in results}
    adapters: dict[str, list[ModelResult]] = {}
    for r in results:
        if r.key in bases:
            adapters.setdefault(bases[r.key], []).append(r)
    ordered: list[ModelResult] = []
    for r in sorted(results, key=lambda r: (_relation_order(r.relation), r.name, r.key)):
        if r.key in bases and bases[r.key] in by_key:
            continue  # placed after its base
        ordered.append(r)
        ordered.extend(sorted(adapters.get(r.key, []), key=lambda a: (a.name, a.key)))
    return ordered


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
    _require("matplotlib")
    pq = _require("pyarrow.parquet")
    if settings.out:
        target, where = _Prefixed(open_store(settings.out), ""), settings.out
    else:
        target = _Prefixed(store, REPORT_PREFIX)
        where = store.url.rstrip("/") + "/" + REPORT_PREFIX.rstrip("/")
    shells = [ModelResult(k, m, []) for k, m in markers.items()]
    bases = base_keys(shells)
    wanted_bases = set(bases.values())
    order = [r.key for r in _order(shells, bases)]
    thresh: float | None = None
    if settings.tag:
        record = read_refit_record(store, settings.tag) or {}
        params = record.get("parameters")
        if isinstance(params, Mapping) and params.get("evals_thresh") is not None:
            thresh = float(params["evals_thresh"])
    files: list[str] = []

    def put(key: str, data: bytes) -> None:
        target.put(key, data)
        files.append(key)

    included: list[ModelResult] = []
    summaries: list[dict[str, Any]] = []
    relations = RelationAlphas()
    plots: dict[str, dict[str, str]] = {}
    seen_bases: dict[str, ModelResult] = {}  # bases of adapters still to plot
    parquet = io.BytesIO()
    writer: Any = None
    pending: list[Any] = []  # tables of whole models, written as one row group when enough
    pending_rows = layers = 0
    for r in iter_results(store, markers, order, tag=settings.tag, threads=settings.threads):
        included.append(ModelResult(r.key, r.marker, []))
        summaries.extend(summary_rows([r], store, recompute=bool(settings.tag)))
        relations.add(r)
        table = layers_table([r], bases)
        layers += table.num_rows
        pending.append(table)
        pending_rows += table.num_rows
        if pending_rows >= PARQUET_ROW_GROUP:
            writer = _write_parquet(pq, parquet, writer, pending)
            pending, pending_rows = [], 0
        if len(plots) < settings.max_model_plots:
            if r.key in wanted_bases:
                seen_bases[r.key] = r
            plots[r.key] = _model_plots(store, r, seen_bases.get(bases.get(r.key, "")),
                                        settings.esd_layers, thresh, put)
    if not included:
        raise no_table_error(store, settings.tag)
    _write_parquet(pq, parquet, writer, pending).close()
    put(SUMMARY_NAME, summary_to_csv(summaries))
    put(PARQUET_NAME, parquet.getvalue())
    put(RELATION_PLOT, plot_alpha_by_relation(relations))
    page = index_html(
        included, summaries, bases, plots, source=store.url, tag=settings.tag,
        max_model_plots=settings.max_model_plots, layers=layers,
    )
    put(INDEX_NAME, page.encode("utf-8"))
    log.info("report of %d model(s), %d layers, plots for %d, in %s (%.1fs)", len(included),
             layers, len(plots), where, time.perf_counter() - t0)
    return Report(where, tuple(files), len(included), layers, len(plots))


def _write_parquet(pq: Any, buf: io.BytesIO, writer: Any, tables: list[Any]) -> Any:
    """Write `tables` as one row group (opening the writer on the first); the writer."""
    pa = _require("pyarrow")
    if writer is None:
        writer = pq.ParquetWriter(buf, tables[0].schema)
    if tables:
        writer.write_table(pa.concat_tables(tables))
    return writer


def _model_plots(
    store: Store,
    result: ModelResult,
    base: ModelResult | None,
    esd_layers: int,
    evals_thresh: float | None,
    put: Any,
) -> dict[str, str]:
    """Write one model's plots under models/<key>/; label → path of those written."""
    mine: dict[str, str] = {}
    folder = f"models/{result.key}/"
    put(folder + ALPHA_PLOT, plot_alpha(result))
    mine["α per layer"] = folder + ALPHA_PLOT
    eigs = read_eigs(store, result)
    esd = plot_esd(result, eigs, count=esd_layers, evals_thresh=evals_thresh) if eigs else None
    if esd is not None:
        put(folder + ESD_PLOT, esd)
        mine["ESD"] = folder + ESD_PLOT
    vs = plot_vs_base(result, base) if base is not None else None
    if vs is not None:
        put(folder + VS_BASE_PLOT, vs)
        mine["vs base"] = folder + VS_BASE_PLOT
    return mine


def _fmt(value: Any, digits: int = 3) -> str:
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
    table_name = layers_name(tag)
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
        f"<p>Results: <code>{e(source)}</code>; table <code>{e(table_name)}</code>; "
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


# --------------------------------------------------------------------------- the command


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--output-dir", "--output", "--results", required=True, metavar="URL",
             help="results location: a directory, file:// URL or s3://bucket/prefix")
    add_flag(parser, "--out", metavar="DIR|URL",
             help="write the report here instead of <results>/report/")
    add_flag(parser, "--tag", metavar="TAG",
             help="report on the refit tables layers.<TAG>.csv instead of layers.csv")
    add_flag(parser, "--max-model-plots", type=int, default=DEFAULT_MAX_MODEL_PLOTS,
             metavar="N", help="per-model plots for at most N models (default "
             f"{DEFAULT_MAX_MODEL_PLOTS}; 0: none); the tables always hold every model")
    add_flag(parser, "--esd-layers", type=int, default=DEFAULT_ESD_LAYERS, metavar="N",
             help=f"layers per ESD plot, chosen at α quantiles (default {DEFAULT_ESD_LAYERS}; "
             "0: all)")
    add_flag(parser, "--threads", type=int, default=16, metavar="N",
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
