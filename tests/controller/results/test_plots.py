"""Tests of controller.results.plots: which layers an ESD plot shows, and plots of odd tables.

The plots of real models (sizes, one per model) are tested through the report of the example
store in test_report; here, hand-made results (tests.support.results.make_result).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from controller.results import plots
from controller.results.plots import RelationAlphas
from esd_worker.core.store.marker import BaseModelRef
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


def test_relation_alphas_gather_ok_fits_by_relation() -> None:
    """Layer α of ok fits only (NaN and fit_failed left out); one mean per model with any:
    base (2 + 4) / 2 = 3; the adapter's relation comes from its marker's adapter field."""
    stats = RelationAlphas()
    stats.add(make_result([2.0, 4.0, math.nan], ["ok", "ok", "fit_failed"], relation="base"))
    stats.add(make_result([math.nan], ["fit_failed"], adapter={"r": 8},
                          base_model=BaseModelRef("org/m")))
    assert stats.layers == {"base": [2.0, 4.0], "adapter": []}
    assert stats.means == {"base": [3.0]}
    assert stats.models == {"base": 1, "adapter": 1}
    width, height = png_size(plots.plot_alpha_by_relation(stats))
    assert width >= 600 and height >= 400


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
