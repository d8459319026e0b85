"""Tests of controller.results.plots: which layers an ESD plot shows, and plots of odd tables.

The plots of real models (sizes, one per model) are tested through the report of the example
store in test_report; here, hand-made results (tests.support.results.make_result).
"""

from __future__ import annotations

import numpy as np
import pytest

from controller.results import plots
from controller.results.aggregates import GroupedHistograms
from tests.support.results import make_result, png_size


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
    width, height = png_size(plots.plot_alpha(result))
    assert width >= 600 and height >= 400


@pytest.mark.parametrize("metric", ["alpha_mean", "stable_rank_mean"])
def test_plot_distribution_draws_each_group(metric: str) -> None:
    """A metric by group (linear or log bins) is a real PNG of the figure's size (750 x 400);
    an empty grouping still draws its axes."""
    grouped = GroupedHistograms(metric, bins=50)
    grouped.add(np.array([3.0, 4.0, 5.0, 30.0]), np.array(["a", "a", "b", "b"], dtype=object))
    width, height = png_size(plots.plot_distribution(grouped, metric))
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
    png = plots.plot_vs_base(adapter, base)
    assert (png is not None) == drawn
    if png is not None:
        assert png_size(png)[0] >= 1000


def test_plot_esd_without_eigenvalues_is_none() -> None:
    assert plots.plot_esd(make_result([2.5]), {}) is None
