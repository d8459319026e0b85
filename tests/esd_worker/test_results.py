"""Tests of esd_worker.core.store.results.summarize_layers: one model's numbers across its
layers."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import (
    SUMMARY_FIELDS,
    layers_from_csv,
    layers_to_csv,
    summarize_layers,
)


def make_layer(alpha: float, status: str = "ok", **metrics: float) -> dict[str, Any]:
    """A layers.csv row with the columns the summary reads (norms default to 1.0)."""
    row: dict[str, Any] = {"layer": f"l{alpha}", "alpha": alpha, "status": status}
    for col in ("stable_rank", "log_spectral_norm", "log_norm", "entropy"):
        row[col] = metrics.get(col, 1.0)
    row["alpha_weighted"] = metrics.get("alpha_weighted", alpha)
    row["log_alpha_norm"] = metrics.get("log_alpha_norm", 2 * alpha)
    return row


def test_fields_and_hand_computed_values() -> None:
    """ok alphas 1.5, 2, 6, 7: mean 4.125, median 4, population std sqrt(5.796875),
    share in [2, 6] = 2/4 (both bounds included); the too_small row (NaN norms) is counted
    in `layers` only; the fit_failed row's finite norms count, its alpha does not."""
    rows = [
        make_layer(1.5), make_layer(2.0), make_layer(6.0), make_layer(7.0, stable_rank=5.0),
        make_layer(math.nan, "fit_failed", stable_rank=9.0, alpha_weighted=math.nan,
                   log_alpha_norm=math.nan),
        make_layer(math.nan, "too_small", stable_rank=math.nan, log_spectral_norm=math.nan,
                   log_norm=math.nan, entropy=math.nan, alpha_weighted=math.nan,
                   log_alpha_norm=math.nan),
    ]
    summary = summarize_layers(rows)
    assert tuple(summary) == SUMMARY_FIELDS
    assert (summary["layers"], summary["layers_ok"]) == (6, 4)
    assert summary["alpha_mean"] == pytest.approx(4.125)
    assert summary["alpha_median"] == pytest.approx(4.0)
    assert summary["alpha_std"] == pytest.approx(math.sqrt(5.796875))
    assert summary["alpha_in_2_6_share"] == pytest.approx(0.5)
    assert summary["stable_rank_mean"] == pytest.approx((1 + 1 + 1 + 5 + 9) / 5)
    assert summary["entropy_mean"] == pytest.approx(1.0)
    assert summary["alpha_weighted_mean"] == pytest.approx(4.125)
    assert summary["log_alpha_norm_mean"] == pytest.approx(8.25)


def test_csv_strings_give_the_same_summary() -> None:
    """The controller summarises layers.csv as read back: strings, 'nan', empty cells."""
    rows = [make_layer(2.5), make_layer(3.5, entropy=0.5),
            make_layer(math.nan, "fit_failed", alpha_weighted=math.nan)]
    from_csv = layers_from_csv(layers_to_csv(rows))
    assert all(isinstance(v, str) for v in from_csv[0].values())
    assert summarize_layers(from_csv) == pytest.approx(summarize_layers(rows))


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param([], id="no-layers"),
        pytest.param([make_layer(math.nan, "fit_failed")], id="no-fit"),
        pytest.param([{"status": "too_small", "alpha": "", "entropy": ""}], id="empty-cells"),
    ],
)
def test_nothing_to_average_is_null_not_nan(rows: list[dict[str, Any]]) -> None:
    summary = summarize_layers(rows)
    assert summary["layers_ok"] == 0
    for field in ("alpha_mean", "alpha_median", "alpha_std", "alpha_in_2_6_share",
                  "alpha_weighted_mean", "log_alpha_norm_mean"):
        assert summary[field] is None, field
    text = Marker(model="m", model_key="m", summary=summary).to_json().decode()
    assert "NaN" not in text
    assert json.loads(text)["summary"] == summary


def test_single_ok_layer_has_zero_std() -> None:
    summary = summarize_layers([make_layer(3.0)])
    assert (summary["alpha_mean"], summary["alpha_median"], summary["alpha_std"]) == (
        3.0, 3.0, 0.0
    )
