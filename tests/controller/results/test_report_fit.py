"""What a report says of how its α were fitted: the label (or "mixed fits: …") counted from
the models table's parameters, WeightWatcher's 2–6 band (and its share) only where every α
was fitted with DKS, else one line why. Function-level: the overview of a small store with
results tables and the index page from it, a model page; the plots' titles are in
test_plots, a refit report's in test_refit, the example report's in test_report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.results.failures import FailureGroups
from controller.results.html import index_html
from controller.results.overview import build_overview
from controller.results.pages import model_page
from controller.results.reportfit import Fit, both, fit_of, fit_of_models
from controller.results.tables import Tables
from esd_worker.core.command.presets import PRESETS
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.stores import LocalStore
from esd_worker.core.store.tables import DoneModel, parameters_text, write_parts
from tests.support.results import analysed, make_result

XMIN_MID = AnalysisSettings().as_dict()
XMIN_MID_64 = AnalysisSettings(precision="float64").as_dict()
DKS = AnalysisSettings(fix_fingers="DKS").as_dict()
WW = AnalysisSettings(**PRESETS["ww"]).as_dict()
NOTE = ("the 2–6 band is calibrated for the DKS fit; these α are {}: "
        "see docs/reading-alpha.md")
BAND_COLUMN = "α in [2, 6]"


def _counts(*fits: tuple[dict[str, Any], int]) -> dict[str, int]:
    return {parameters_text(params): n for params, n in fits}


@pytest.mark.parametrize(
    ("counts", "refit", "label", "band", "these"),
    [
        pytest.param(_counts((DKS, 2)), None, "fit DKS, float32", True, None, id="DKS"),
        pytest.param(_counts((WW, 1)), None, "preset ww (DKS, float64, embeddings)", True,
                     None, id="preset-ww"),
        pytest.param(_counts((XMIN_MID, 3)), None, "fit xmin_mid, float32", False,
                     "xmin_mid", id="xmin_mid"),
        pytest.param(_counts((XMIN_MID, 3), (DKS, 2)), None, "mixed fits: 3 xmin_mid, 2 DKS",
                     False, "mixed (xmin_mid, DKS)", id="mixed"),
        pytest.param(_counts((XMIN_MID, 3), (XMIN_MID_64, 2)), None,
                     "mixed fits: 3 × fit xmin_mid, float32; 2 × fit xmin_mid, float64",
                     False, "xmin_mid", id="mixed-precision"),
        pytest.param(_counts((XMIN_MID, 3)), "DKS", "fit DKS, float32", True, None,
                     id="refit-DKS-of-xmin_mid"),
        pytest.param(_counts((DKS, 3)), "xmin_peak", "fit xmin_peak, float32", False,
                     "xmin_peak", id="refit-xmin_peak-of-DKS"),
        pytest.param({"": 1}, None, "fit ?, ?", False, "?", id="no-parameters"),
    ],
)
def test_fit_of_models(counts: dict[str, int], refit: str | None, label: str, band: bool,
                       these: str | None) -> None:
    fit = fit_of_models(counts, fix_fingers=refit)
    assert (fit.label, fit.band) == (label, band)
    assert fit.note == (None if these is None else NOTE.format(these))


@pytest.mark.parametrize(
    ("adapter", "base", "label", "band"),
    [
        pytest.param(DKS, DKS, "fit DKS, float32", True, id="alike"),
        pytest.param(DKS, XMIN_MID, "adapter fit DKS, float32; base fit xmin_mid, float32",
                     False, id="different"),
    ],
)
def test_an_adapter_and_its_base(adapter: dict[str, Any], base: dict[str, Any], label: str,
                                 band: bool) -> None:
    fit = both(fit_of(adapter), fit_of(base))
    assert (fit.label, fit.band) == (label, band)


# --- the index page of a store with results tables -----------------------------------------


def _store(root: Path, fits: list[dict[str, Any]]) -> LocalStore:
    """One model per entry of `fits` (its analysis parameters), in the results tables."""
    store = LocalStore(root)
    write_parts(store, analysed(store, [DoneModel(
        Marker(model=f"org/m{i}", model_key=f"m{i:05d}", model_id=f"org/m{i}",
               architecture="LlamaForCausalLM", finished_at="2026-01-01",
               timings={"total_s": 1}, parameters=params),
        [{"layer": f"h.{j}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": 2.5 + i + j,
          "status": "ok", "fix_fingers": params["fix_fingers"]} for j in range(2)])
        for i, params in enumerate(fits)]))
    return store


@pytest.mark.parametrize(
    ("fits", "label", "band"),
    [
        pytest.param([DKS, DKS], "fit DKS, float32", True, id="DKS"),
        pytest.param([XMIN_MID, XMIN_MID], "fit xmin_mid, float32", False, id="xmin_mid"),
        pytest.param([XMIN_MID, DKS, XMIN_MID, DKS, XMIN_MID],
                     "mixed fits: 3 xmin_mid, 2 DKS", False, id="mixed"),
    ],
)
def test_index_says_the_fit_and_shows_the_band_only_for_dks(
    tmp_path: Path, fits: list[dict[str, Any]], label: str, band: bool
) -> None:
    """The fit near the top (counted by the overview's models pass); the band's share
    column only where every model is DKS; otherwise the one line why, and no share."""
    view = build_overview(Tables(_store(tmp_path, fits)))
    fit = fit_of_models(view.parameters)
    page = index_html(view, FailureGroups(), source=str(tmp_path), tag=None, parts=2,
                      names={}, linked=set(), plots=set(), fit=fit)
    top = page[:page.index("<h2>")]
    assert f"Fit: <b>{label}</b>" in top
    assert ("calibrated for the DKS fit" in top) is not band
    assert (BAND_COLUMN in page) is band


@pytest.mark.parametrize(
    ("fit", "note"),
    [
        pytest.param(fit_of(DKS), False, id="DKS"),
        pytest.param(fit_of(XMIN_MID), True, id="xmin_mid"),
        pytest.param(fit_of(XMIN_MID, fix_fingers="DKS"), False, id="refit-DKS"),
    ],
)
def test_model_page_says_its_fit_first(fit: Fit, note: bool) -> None:
    page = model_page(make_result([2.5]), {"model_id": "org/m"}, {}, fit=fit)
    top = page[:page.index("<table>")]
    assert f"Fit: <b>{fit.label}</b>" in top
    assert ("calibrated for the DKS fit" in top) is note
