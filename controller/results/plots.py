"""The report's PNG plots: α per layer, the ESD of chosen layers, adapter vs base, and a
metric's distribution by group (from the report's histograms).

Owns how a model's numbers are drawn (matplotlib on the Agg canvas, no pyplot state). Each
*_figure function takes ModelResults and a Fit (controller.results.reportfit) and returns
the Figure, each plot_* its PNG bytes (the figure's title also in the PNG's Title text);
where they are written is the report's business (controller.results.report). Every plot of
α or of a metric fitted from the power law says its fit in its title; WeightWatcher's 2-6
band of α is drawn only where the Fit says it applies. matplotlib is imported only when a
plot is drawn (controller.results.extras), so importing this module costs nothing.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

import numpy as np

from controller.results.aggregates import GroupedHistograms
from controller.results.extras import require
from controller.results.reader import ModelResult, number
from controller.results.reportfit import BAND_METRICS, Fit
from esd_worker.core.command.presets import WW_ALPHA_BAND
from esd_worker.core.echo import echo

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DEFAULT_ESD_LAYERS = 6

# Far above WeightWatcher's band the ESD has no heavy tail and the exact α says little.
# Plots clip there so the interesting range stays readable.
ALPHA_CLIP = 12.0
BAND_GID = "ww-alpha-band"  # the band's artist, found by the tests without pixels


def _figure(
    width: float, height: float, *, layout: Literal["constrained"] | None = "constrained"
) -> Figure:
    """A Figure on the Agg canvas: no display, no pyplot global state."""
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def title_of(fig: Figure) -> str:
    """The figure's title: its suptitle, else its first axes' title."""
    return fig.get_suptitle() or (fig.axes[0].get_title() if fig.axes else "")


def has_band(fig: Figure) -> bool:
    """Whether WeightWatcher's band is drawn on the figure."""
    return any(artist.get_gid() == BAND_GID for ax in fig.axes for artist in ax.patches)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Title": title_of(fig)})
    return buf.getvalue()


def _kind(layer: str) -> str:
    """The module kind of a layer name: its last component (q_proj, c_attn, query, …)."""
    return layer.rsplit(".", 1)[-1]


def _alpha_limits(alphas: Iterable[float]) -> float:
    finite = [a for a in alphas if math.isfinite(a)]
    top = max(finite, default=WW_ALPHA_BAND[1])
    return min(max(top * 1.08, WW_ALPHA_BAND[1] + 1.0), ALPHA_CLIP)


def _band(ax: Axes, fit: Fit, *, vertical: bool = False) -> None:
    """WeightWatcher's band, where the fit is the one it was calibrated on."""
    if not fit.band:
        return
    span = ax.axvspan if vertical else ax.axhspan
    span(*WW_ALPHA_BAND, color="tab:green", alpha=0.10, lw=0, gid=BAND_GID,
         label=f"WeightWatcher {WW_ALPHA_BAND[0]:g} ≤ α ≤ {WW_ALPHA_BAND[1]:g}")


def plot_alpha(result: ModelResult, *, fit: Fit) -> bytes:
    return _png(alpha_figure(result, fit=fit))


def alpha_figure(result: ModelResult, *, fit: Fit) -> Figure:
    """α per layer in model order: the 2–6 band shaded where it applies, points coloured
    by module kind, fit_failed layers marked with a red x and other unanalysed layers with
    a grey bar at the bottom, α above the plot's top (ALPHA_CLIP) drawn as triangles at the
    edge; the fit under the title."""
    rows = result.rows
    n = len(rows)
    fig = _figure(min(14.0, max(7.0, 0.12 * n + 4.0)), 4.2)
    ax = fig.subplots()
    ok = [(i, number(r.get("alpha")), _kind(r.get("layer", ""))) for i, r in enumerate(rows)
          if r.get("status") == "ok" and math.isfinite(number(r.get("alpha")))]
    top = _alpha_limits(a for _, a, _ in ok)
    _band(ax, fit)
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
    ax.set_title(f"{result.name}: α per layer ({len(ok)} of {n} fitted)\n{fit.label}",
                 fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def plot_distribution(grouped: GroupedHistograms, title: str, *, fit: Fit | None = None) -> bytes:
    return _png(distribution_figure(grouped, title, fit=fit))


def distribution_figure(grouped: GroupedHistograms, title: str, *,
                        fit: Fit | None = None) -> Figure:
    """One metric's distribution by group as overlaid step histograms (fraction of each
    group's models per bin, so small groups stay visible); at most 13 groups, largest first.
    fit: of a metric fitted from the power law (None for the others): under the title, and
    the band on α's own scale where it applies."""
    fig = _figure(7.5, 4.0)
    ax = fig.subplots()
    if fit is not None and grouped.metric in BAND_METRICS:
        _band(ax, fit, vertical=True)
    drawn = False
    for name, hist in grouped.ordered()[:13]:
        if not hist.count:
            continue
        edges = hist.edges
        share = hist.counts / hist.count
        # a family is a config.json's architecture: untrusted text (esd_worker.core.echo)
        ax.stairs(share, edges, lw=2.2 if name == "all" else 1.2,
                  color="black" if name == "all" else None,
                  label=f"{echo(name, limit=60)} ({hist.count})")
        drawn = True
    if grouped.groups and next(iter(grouped.groups.values())).log:
        ax.set_xscale("log")
    ax.set_xlabel(grouped.metric)
    ax.set_ylabel("share of the group per bin")
    ax.set_title(title if fit is None else f"{title}\n{fit.label}", fontsize=11)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    return fig


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
    fit: Fit,
    count: int = DEFAULT_ESD_LAYERS,
    evals_thresh: float | None = None,
) -> bytes | None:
    fig = esd_figure(result, eigs, fit=fit, count=count, evals_thresh=evals_thresh)
    return None if fig is None else _png(fig)


def esd_figure(
    result: ModelResult,
    eigs: Mapping[str, np.ndarray],
    *,
    fit: Fit,
    count: int = DEFAULT_ESD_LAYERS,
    evals_thresh: float | None = None,
) -> Figure | None:
    """The ESD of chosen layers on log-log axes, as WeightWatcher draws it: a density
    histogram of λ (log-spaced bins, λ > evals_thresh), the fitted power law
    p(λ) ∝ λ^-α from xmin (scaled to the tail's share of the eigenvalues so it lies on the
    histogram), and a vertical line at xmin; the fit under the title. None when no layer
    has eigenvalues.

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
    width, height = 4.3 * cols, 3.3 * nrows + 0.7
    # Fixed margins in inches instead of a layout engine: the grid is regular, and the
    # constrained layout's extra draw passes nearly double the time of a many-panel figure.
    fig = _figure(width, height, layout=None)
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - 0.8 / height, wspace=0.95 / 3.4, hspace=0.8 / 2.3)
    axes = np.atleast_1d(fig.subplots(nrows, cols, squeeze=False)).ravel()
    for ax, i in zip(axes, picks, strict=False):
        row = result.rows[i]
        lam = np.asarray(eigs[row["layer"]], dtype=np.float64)
        lam = lam[lam > thresh]
        draw_esd(ax, lam, row)
    for ax in axes[len(picks):]:
        ax.set_visible(False)
    how = "all layers" if len(picks) == sum(1 for r in result.rows if r.get("layer") in eigs) \
        else "layers at α quantiles"
    fig.suptitle(f"{result.name}: ESD, {len(picks)} of {len(result.rows)} layers ({how})"
                 f"\n{fit.label}", fontsize=11, y=1 - 0.1 / height, va="top")
    return fig


def draw_esd(ax: Axes, lam: np.ndarray, row: Mapping[str, str]) -> None:
    """One layer's ESD on `ax`: log-log density and, for a fitted layer (row: its layers.csv
    cells), the power law above xmin. The report's figures and esd_sweep.plot_esd draw so."""
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


def plot_vs_base(adapter: ModelResult, base: ModelResult, *, fit: Fit) -> bytes | None:
    fig = vs_base_figure(adapter, base, fit=fit)
    return None if fig is None else _png(fig)


def vs_base_figure(adapter: ModelResult, base: ModelResult, *, fit: Fit) -> Figure | None:
    """Adapter vs its base, layers matched by name. Left: α per layer (base order) of both.
    Right: α_adapter against α_base with the diagonal; layers whose spectrum the adapter
    changed (λ_max differs) in colour, untouched layers grey. fit: of both (reportfit.both):
    under the title, the band where it applies. None when no layer matches."""
    by_name = {r.get("layer"): r for r in adapter.rows}
    pairs = [(i, b, by_name[b["layer"]]) for i, b in enumerate(base.rows)
             if b.get("layer") in by_name]
    if not pairs:
        return None
    fig = _figure(13.0, 4.6)
    left, right = fig.subplots(1, 2, width_ratios=[1.7, 1.0])
    alphas = [number(r.get("alpha")) for _, b, a in pairs for r in (a, b)]
    top = _alpha_limits(alphas)
    _band(left, fit)
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
    fig.suptitle(f"{adapter.name} vs its base {base.name}\n{fit.label}", fontsize=11)
    return fig
