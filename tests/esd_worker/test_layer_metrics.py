"""Tests of esd_worker.core.powerlaw.layer_metrics: the per-layer columns of docs/metrics.md."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from esd_worker.core import powerlaw
from esd_worker.core.powerlaw import (
    METRIC_COLUMNS,
    alpha_ks_all,
    fit_power_law,
    layer_metrics,
)
from tests.support.spectra import (
    BRUTE_CASES,
    brute_best,
    make_gaussian_evals,
    make_pareto,
)

# --- layer metrics ------------------------------------------------------------------------


def test_layer_metrics_hand_computed() -> None:
    """λ = 1, 4, 9, 16 (σ = 1, 2, 3, 4), worked out by hand.

    norm = 30, spectral_norm = xmax = 16, stable_rank = 30/16 = 1.875, log_norm = log10 30.
    matrix_rank: tolerance 4·4·eps32 ≈ 1.9e-6 < every σ, so 4.
    entropy: p = (1, 4, 9, 16)/30, −Σ p ln p = ln 30 − (4 ln 4 + 9 ln 9 + 16 ln 16)/30 ≈ 1.0785;
    over ln 4 (R = 4): ≈ 0.7780.
    xmin_mid: i = 2, tail (9, 16): α = 1 + 2/ln(16/9); (16/9)^(1−α) = e^-2, so
    D = |1 − e^-2 − 1/2| = 1/2 − e^-2; num_pl_spikes = 2 (9 and 16).
    """
    m = layer_metrics(np.array([16.0, 1.0, 9.0, 4.0]), max_dim=4)
    alpha = 1 + 2 / math.log(16 / 9)
    entropy = (math.log(30) - (4 * math.log(4) + 9 * math.log(9) + 16 * math.log(16)) / 30) / (
        math.log(4)
    )
    assert list(m) == [*METRIC_COLUMNS, "status"]
    assert m == {
        "num_evals": 4,
        "alpha": pytest.approx(alpha, rel=1e-14),
        "D": pytest.approx(0.5 - math.exp(-2), abs=1e-14),
        "xmin": 9.0,
        "xmax": 16.0,
        "num_pl_spikes": 2,
        "alpha_weighted": pytest.approx(alpha * math.log10(16), rel=1e-14),
        "log_alpha_norm": pytest.approx(math.log10(1 + 4**alpha + 9**alpha + 16**alpha), rel=1e-14),
        "spectral_norm": 16.0,
        "log_spectral_norm": pytest.approx(math.log10(16), rel=1e-15),
        "norm": 30.0,
        "log_norm": pytest.approx(math.log10(30), rel=1e-15),
        "stable_rank": 1.875,
        "entropy": pytest.approx(entropy, rel=1e-14),
        "matrix_rank": 4,
        "status": "ok",
    }
    assert m["entropy"] == pytest.approx(0.7780, abs=1e-4)  # the hand value, to 4 places


@pytest.mark.parametrize(
    "evals",
    [
        pytest.param([0.0, 0.0, 1.0, 3.0], id="zeros"),
        pytest.param([0.0, 1e-20, 1.0, 3.0], id="a-nonzero-below-tolerance"),
    ],
)
def test_entropy_of_a_rank_deficient_layer_is_over_ln_of_its_rank(evals: list[float]) -> None:
    """Four eigenvalues, rank 2: the entropy is normalised by ln R, R = matrix_rank, not by
    ln of the number of eigenvalues (docs/metrics.md), worked out by hand.

    σ = 1e-10 is below the tolerance √3·4·eps32 ≈ 8e-7, so R = 2 either way; the norm is 4
    (1e-20 is lost in it). p = (1/4, 3/4) (a p of 2.5e-21 adds ~1e-19), so
    −Σ p ln p = ln 4 − (3/4) ln 3 ≈ 0.5623 and the entropy is that over ln 2 ≈ 0.8113; over
    ln 4 (the number of eigenvalues) it would be half that, over ln 3 (the nonzero ones)
    ≈ 0.5118."""
    m = layer_metrics(np.array(evals), max_dim=4)
    assert m["matrix_rank"] == 2
    assert m["entropy"] == pytest.approx((math.log(4) - 0.75 * math.log(3)) / math.log(2),
                                         rel=1e-14)
    assert m["entropy"] == pytest.approx(0.8113, abs=1e-4)  # the hand value, to 4 places


@pytest.mark.parametrize(
    ("evals", "max_dim", "rank"),
    [
        ([0.0, 1e-20, 1.0, 4.0], 10, 2),  # σ = 1e-10 < 2·10·eps32 ≈ 2.4e-6: below tolerance
        ([1e-10, 1.0, 4.0], 10, 3),  # σ = 1e-5 > 2.4e-6: counts
        ([1e-10, 1.0, 4.0], 1000, 2),  # tolerance grows with max_dim: 2.4e-4 > 1e-5
        ([5.0], 1, 1),
    ],
    ids=["tiny-dropped", "small-kept", "max-dim-scales", "single"],
)
def test_matrix_rank_tolerance(evals: list[float], max_dim: int, rank: int) -> None:
    """matrix_rank counts σ > σ_max · max_dim · eps(float32), as numpy's matrix_rank does."""
    assert layer_metrics(np.array(evals), max_dim=max_dim)["matrix_rank"] == rank


def test_layer_metrics_norms_use_all_eigenvalues() -> None:
    """Values under evals_thresh leave the fit but still count in norm and num_evals."""
    m = layer_metrics(np.array([1e-6, 1.0, 2.0, 4.0, 8.0]), max_dim=5)
    assert m["num_evals"] == 5
    assert m["norm"] == pytest.approx(15.000001, rel=1e-15)
    assert m["stable_rank"] == pytest.approx(15.000001 / 8.0, rel=1e-15)


DEGENERATE_LAYERS = {
    "empty": [],
    "all-zeros": [0.0] * 8,
    "negative-zeros": [-1e-12, -1e-9, 0.0],
}


@pytest.mark.parametrize("evals", DEGENERATE_LAYERS.values(), ids=DEGENERATE_LAYERS.keys())
def test_layer_metrics_degenerate(evals: list[float]) -> None:
    """A zero (or empty) spectrum: sums are 0, logs and ratios NaN, ranks 0, fit_failed."""
    m = layer_metrics(np.array(evals), max_dim=8)
    assert m["status"] == "fit_failed"
    assert (m["num_evals"], m["spectral_norm"], m["xmax"], m["norm"]) == (len(evals), 0, 0, 0)
    assert (m["matrix_rank"], m["entropy"], m["num_pl_spikes"]) == (0, 0.0, 0)
    for key in ("alpha", "D", "xmin", "alpha_weighted", "log_alpha_norm"):
        assert math.isnan(float(m[key])), key
    for key in ("log_spectral_norm", "log_norm", "stable_rank"):
        assert math.isnan(float(m[key])), key


def test_log_alpha_norm_does_not_overflow() -> None:
    """Σ λ^α with λ ~ 1e8 and α ~ 50 overflows float64; the log is still finite and exact.

    log10 Σ λ^α = α·log10 λ_max + log10 Σ (λ/λ_max)^α.
    """
    lam = np.array([1e8, 1.01e8, 1.02e8, 1.03e8, 1.04e8, 1.05e8])
    m = layer_metrics(lam, max_dim=6, fix_fingers="DKS")
    alpha = float(m["alpha"])
    assert alpha * math.log10(1.05e8) > 308  # λ_max^α alone is beyond float64
    want = alpha * math.log10(1.05e8) + math.log10(math.fsum((x / 1.05e8) ** alpha for x in lam))
    assert m["log_alpha_norm"] == pytest.approx(want, rel=1e-12)


def test_module_does_not_import_torch() -> None:
    """`refit` runs where torch is absent: powerlaw must stay numpy-only."""
    code = "import sys, esd_worker.core.powerlaw; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _full_scan_best(lam: np.ndarray, evals_thresh: float = 1e-5) -> tuple[float, float, float]:
    """(α, D, xmin) of the first smallest D over every candidate: the unpruned DKS scan."""
    tail = np.sort(lam[lam > evals_thresh])
    alphas, ds = alpha_ks_all(tail)
    i = int(np.nanargmin(ds))
    return float(alphas[i]), float(ds[i]), float(tail[i])


PRUNE_CASES = {
    "pareto-2.5": make_pareto(2.5, 3000, seed=11),
    "pareto-4": make_pareto(4.0, 2000, seed=12),
    "marchenko-pastur": make_gaussian_evals(1200, 900, seed=13),
    "mp-plus-spikes": np.concatenate([make_gaussian_evals(800, 700, seed=14),
                                      make_pareto(2.0, 40, seed=15, xmin=3000.0)]),
    "ties": np.repeat(make_pareto(3.0, 400, seed=16), 3),
}


@pytest.mark.parametrize("lam", PRUNE_CASES.values(), ids=PRUNE_CASES.keys())
def test_pruned_dks_equals_the_full_scan(lam: np.ndarray) -> None:
    """Long tails skip candidates whose lower bound on D exceeds the best D found; the
    answer must be the full scan's exactly (same cells, same arithmetic): α, D and xmin
    equal bit for bit, ties resolved to the first candidate."""
    assert lam.size - 1 >= powerlaw._PRUNE_MIN_CANDIDATES
    fit = fit_power_law(lam, fix_fingers="DKS")
    assert (fit.alpha, fit.D, fit.xmin) == _full_scan_best(lam)


@pytest.mark.parametrize("lam", BRUTE_CASES.values(), ids=BRUTE_CASES.keys())
def test_pruned_dks_matches_brute_force_on_small_inputs(
    lam: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pruning forced on every size (and tiny blocks), DKS still picks the brute
    force's candidate: the bound never skips the best one."""
    monkeypatch.setattr(powerlaw, "_PRUNE_MIN_CANDIDATES", 1)
    monkeypatch.setattr(powerlaw, "_PRUNE_HEAD", 2)
    monkeypatch.setattr(powerlaw, "_PRUNE_STRIDE", 3)
    monkeypatch.setattr(powerlaw, "_PRUNE_BLOCK_ROWS", 2)
    fit = fit_power_law(lam, fix_fingers="DKS")
    want = brute_best(lam.tolist(), range(lam.size - 1))
    if want is None:
        assert fit.status == "fit_failed"
    else:
        assert fit.status == "ok"
        assert fit.alpha == pytest.approx(want[0], rel=1e-12)
        assert pytest.approx(want[1], abs=1e-12) == fit.D
