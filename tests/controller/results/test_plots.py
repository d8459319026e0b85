"""Tests of controller.results.plots: which layers an ESD plot shows, and plots of odd tables.

The plots of real models (sizes, one per model) are tested through the report of the example
store in test_report; here, hand-made results (tests.support.results.make_result).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

from controller.results import plots
from controller.results.aggregates import GroupedHistograms
from controller.results.reportfit import Fit, fit_of
from esd_worker.core.command.presets import PRESETS
from esd_worker.core.command.settings import AnalysisSettings
from tests.support.results import make_result, png_size, png_title

if TYPE_CHECKING:
    from matplotlib.figure import Figure

XMIN_MID = fit_of(AnalysisSettings().as_dict())
DKS = fit_of(AnalysisSettings(fix_fingers="DKS").as_dict())
WW = fit_of(AnalysisSettings(**PRESETS["ww"]).as_dict())


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        pytest.param(0, [0, 1, 2, 3, 4, 5], id="0-means-all"),
        pytest.param(10, [0, 1, 2, 3, 4, 5], id="more-than-there-are"),
        pytest.param(2, [1, 3], id="lowest-and-highest-alpha"),
        pytest.param(3, [1, 3, 5], id="lowest-median-highest"),
    ],
)
def test_esd_layers_are_picked_at_alpha_quantiles(count: int, expected: list[int]) -> None:
    """α by row: 3.0, 1.5 (lowest), 2.0, 9.0 (highest), NaN (failed), 2.5. Sorted fitted
    layers: rows 1, 2, 5, 0, 3; two picks are the ends (rows 1, 3), three add the median
    (row 5). Picks come back in model order."""
    result = make_result([3.0, 1.5, 2.0, 9.0, float("nan"), 2.5],
                         ["ok", "ok", "ok", "ok", "fit_failed", "ok"])
    eigs = {f"l{i}": np.ones(3) for i in range(6)}
    assert plots.pick_esd_layers(result, eigs, count) == expected


def test_plot_alpha_marks_failed_and_clipped_layers() -> None:
    """A table with a failed fit, a too_small layer and an α far above the clip still plots."""
    result = make_result([2.5, 40.0, float("nan"), float("nan")],
                         ["ok", "ok", "fit_failed", "too_small"])
    width, height = png_size(plots.plot_alpha(result, fit=XMIN_MID))
    assert width >= 600 and height >= 400


@pytest.mark.parametrize("metric", ["alpha_mean", "stable_rank_mean"])
def test_plot_distribution_draws_each_group(metric: str) -> None:
    """A metric by group (linear or log bins) is a real PNG of the figure's size (750 x 400);
    an empty grouping still draws its axes."""
    grouped = GroupedHistograms(metric, bins=50)
    grouped.add(np.array([3.0, 4.0, 5.0, 30.0]), np.array(["a", "a", "b", "b"], dtype=object))
    width, height = png_size(plots.plot_distribution(grouped, metric, fit=DKS))
    assert (width, height) == (750, 400)
    assert png_size(plots.plot_distribution(GroupedHistograms(metric), metric)) == (750, 400)


@pytest.mark.parametrize(
    ("rows_b", "drawn"),
    [
        pytest.param(["l0", "l1"], True, id="matching-layers"),
        pytest.param([], False, id="no-layer-in-common"),
    ],
)
def test_plot_vs_base_needs_matching_layers(rows_b: list[str], drawn: bool) -> None:
    """Layers are matched by name: none in common, nothing to draw (None)."""
    adapter = make_result([2.5, 3.5])
    base = make_result([2.0] * len(rows_b))
    png = plots.plot_vs_base(adapter, base, fit=XMIN_MID)
    assert (png is not None) == drawn
    if png is not None:
        assert png_size(png)[0] >= 1000


def test_plot_esd_without_eigenvalues_is_none() -> None:
    assert plots.plot_esd(make_result([2.5]), {}, fit=XMIN_MID) is None


# --- the fit in every title; WeightWatcher's band only on α fitted as it was calibrated ----


def _figures(fit: Fit) -> dict[str, Figure | None]:
    """Each plot of α or a fitted metric, as a Figure (no PNG drawn); all but the ESD (of
    eigenvalues) draw α where the band could be."""
    result = make_result([2.5, 3.5, 7.0], base_model=None)
    grouped = GroupedHistograms("alpha_mean", bins=20)
    grouped.add(np.array([2.5, 4.0]), np.array(["a", "b"], dtype=object))
    layer = GroupedHistograms("alpha", bins=20)
    layer.add(np.array([2.5, 4.0]), np.array(["a", "b"], dtype=object))
    eigs = {"l0": np.linspace(0.1, 5.0, 40)}
    return {
        "alpha": plots.alpha_figure(result, fit=fit),
        "esd": plots.esd_figure(result, eigs, fit=fit, count=1),
        "vs_base": plots.vs_base_figure(result, make_result([2.0, 3.0, 4.0]), fit=fit),
        "alpha_mean": plots.distribution_figure(grouped, "alpha_mean by family", fit=fit),
        "layer_alpha": plots.distribution_figure(layer, "layer α by family", fit=fit),
    }


@pytest.mark.parametrize(
    ("fit", "label", "band"),
    [
        pytest.param(DKS, "fit DKS, float32", True, id="DKS"),
        pytest.param(WW, "preset ww (DKS, float64, embeddings)", True, id="preset-ww"),
        pytest.param(XMIN_MID, "fit xmin_mid, float32", False, id="xmin_mid"),
        pytest.param(Fit("mixed fits: 3 xmin_mid, 2 DKS", ("xmin_mid", "DKS")),
                     "mixed fits: 3 xmin_mid, 2 DKS", False, id="mixed"),
    ],
)
def test_plots_say_their_fit_and_band_only_where_it_applies(fit: Fit, label: str,
                                                            band: bool) -> None:
    """Every plot of α says its fit under its title; the 2–6 band is drawn only on α that
    were all fitted with DKS (read from the Figure, not its pixels)."""
    for name, fig in _figures(fit).items():
        assert fig is not None, name
        title = plots.title_of(fig)
        assert title.endswith("\n" + label), (name, title)
        assert plots.has_band(fig) == (band and name != "esd"), name


def test_metrics_not_fitted_have_no_fit_and_no_band() -> None:
    """stable rank is not fitted from the power law: no label, no band."""
    grouped = GroupedHistograms("stable_rank_mean", bins=20)
    fig = plots.distribution_figure(grouped, "stable_rank_mean by family")
    assert plots.title_of(fig) == "stable_rank_mean by family"
    assert not plots.has_band(fig)


def test_png_carries_the_title() -> None:
    """The PNG's Title text is the figure's title, fit included (α is not Latin-1: iTXt)."""
    png = plots.plot_alpha(make_result([2.5]), fit=DKS)
    assert png_title(png) == "org/m: α per layer (1 of 1 fitted)\nfit DKS, float32"
