"""Tests of esd_worker.powerlaw against docs/metrics.md: fit formulas, xmin choice, metrics."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from collections.abc import Iterator
from decimal import Decimal, localcontext

import numpy as np
import pytest

from esd_worker import powerlaw
from esd_worker.powerlaw import (
    FIX_FINGERS,
    METRIC_COLUMNS,
    PowerLawFit,
    alpha_ks_all,
    fit_power_law,
    layer_metrics,
)

NAN = math.nan


@pytest.fixture(autouse=True)
def strict_numerics() -> Iterator[None]:
    """Every warning, and every numpy floating-point error, fails the test that caused it.

    Also sets 40 significant digits for the decimal brute force.
    """
    with warnings.catch_warnings(), np.errstate(all="raise"), localcontext() as ctx:
        warnings.simplefilter("error")
        ctx.prec = 40
        yield


# --- builders -------------------------------------------------------------------------------


def make_pareto(alpha: float, n: int, seed: int, xmin: float = 1.0) -> np.ndarray:
    """n samples of a continuous power law p(λ) ∝ λ^-α on [xmin, ∞), by inverse CDF."""
    u = 1.0 - np.random.default_rng(seed).random(n)  # in (0, 1]: no division by zero
    return xmin * u ** (-1.0 / (alpha - 1.0))


def make_gaussian_evals(rows: int, cols: int, seed: int) -> np.ndarray:
    """Eigenvalues of WᵀW for W with i.i.d. N(0, 1) entries (Marchenko–Pastur, no tail)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols))
    return np.linalg.eigvalsh(w.T @ w)


def brute_alpha_ks(
    lam: list[float], candidates: range | None = None
) -> dict[int, tuple[float, float]]:
    """{i: (α_i, D_i)} straight from the spec's formulas, one candidate at a time.

    candidates defaults to every i = 0..n-2. Worked in 40-digit decimals so the reference is
    exact to float64 rounding: in plain floats, ln(λ_j/λ_i) of close values loses ~1e-11
    (relative) to the division's rounding. A tail of one repeated value has Σ = 0: (NaN, NaN).
    """
    n = len(lam)
    logs = [Decimal(x).ln() for x in lam]  # Decimal(float) is exact
    result: dict[int, tuple[float, float]] = {}
    for i in candidates if candidates is not None else range(n - 1):
        n_i = n - i
        denom = sum((logs[j] - logs[i] for j in range(i, n)), Decimal(0))  # Σ ln(λ_j/λ_i)
        if denom == 0:
            result[i] = (NAN, NAN)
            continue
        a = 1 + n_i / denom
        d = max(
            abs((1 - ((1 - a) * (logs[i + k] - logs[i])).exp()) - Decimal(k) / n_i)
            for k in range(n_i)
        )
        result[i] = (float(a), float(d))
    return result


def brute_best(lam: list[float], candidates: range) -> tuple[float, float, float] | None:
    """(α, D, xmin) of the smallest D over `candidates` with α > 1, first on ties."""
    best: tuple[float, float, float] | None = None
    for i, (a, d) in brute_alpha_ks(lam, candidates).items():
        if math.isfinite(a) and a > 1.0 and (best is None or d < best[1]):
            best = (a, d, lam[i])
    return best


def make_peak_case() -> np.ndarray:
    """Pareto(α=3) from 1 plus a 300-value cluster at ~20 that makes the fullest log bin.

    Below the cluster sit many Pareto values between log10(0.95·p) ≈ 1.27 and 0.95·p ≈ 18.4:
    the buggy window admits them, the linear window does not.
    """
    rng = np.random.default_rng(0)
    tail = (1.0 - rng.random(1500)) ** (-1.0 / 2.0)
    cluster = 20.0 * (1.0 + 0.01 * rng.random(300))
    return np.sort(np.concatenate([tail, cluster]))


def peak_of(lam: np.ndarray, bins: int = 100) -> float:
    """p = 10^(left edge of the fullest bin of the log10 histogram), as the spec defines it."""
    counts, edges = np.histogram(np.log10(lam), bins=bins)
    return float(10.0 ** edges[int(np.argmax(counts))])


# --- recovery of known exponents ------------------------------------------------------------


@pytest.mark.parametrize("fix_fingers", ["DKS", "xmin_mid"])
@pytest.mark.parametrize("alpha", [2.5, 3.0, 4.0], ids=["a2.5", "a3", "a4"])
def test_pareto_alpha_recovered(alpha: float, fix_fingers: str) -> None:
    """Pareto samples are a power law from their first value, so the MLE gives α back.

    The MLE's standard error is (α−1)/√n_tail: ≈ 0.047 for α = 4 in xmin_mid (n_tail = 4000),
    so 0.05 is about one standard error there. The seed is fixed (0, not searched); with it
    the errors are ≤ 0.02. Other seeds can miss 0.05 (DKS, which may settle on a short tail,
    misses more often): this pins the implementation, not the estimator's spread.
    """
    fit = fit_power_law(make_pareto(alpha, 8000, seed=0), fix_fingers=fix_fingers)
    assert fit.status == "ok"
    assert fit.alpha == pytest.approx(alpha, abs=0.05)
    assert fit.D < 0.02  # a real power law: the KS distance is small


def test_gaussian_matrix_dks_alpha_large() -> None:
    """A Gaussian matrix's ESD is Marchenko–Pastur: bounded, no tail, so DKS finds a steep α.

    DKS picks an xmin near the top edge where the density falls off a cliff: α ≈ 9.6 here
    (7–46 over other shapes and seeds tried), above the spec's "typically > 5".
    """
    fit = fit_power_law(make_gaussian_evals(1000, 500, seed=0), fix_fingers="DKS")
    assert fit.status == "ok"
    assert fit.alpha > 5.0
    assert fit.D > 0.1  # ~20x a real power law's D at this size: the fit is poor


def test_gaussian_matrix_xmin_mid_is_poor_fit_not_large_alpha() -> None:
    """xmin_mid fits the upper half of the MP bulk, which spans a small log range.

    α = 1 + 1/mean(ln λ/λ_med) over that half is ≈ 2.7 for a 1000×500 Gaussian (2.1–3.5
    over shapes tried): the spec's "α > 5" holds for DKS only. What does hold is the large
    KS distance, about 15x that of a Pareto sample of similar size in the same mode.
    """
    fit = fit_power_law(make_gaussian_evals(1000, 500, seed=0), fix_fingers="xmin_mid")
    assert fit.status == "ok"
    assert 2.0 < fit.alpha < 5.0
    assert fit.D > 0.1


# --- formulas against a brute force ---------------------------------------------------------


def _lognormal(n: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).lognormal(0.0, 1.5, n))


def _integers(n: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).integers(1, 6, n).astype(np.float64))


BRUTE_CASES = {
    "n2": np.array([1.0, 2.0]),
    "n3": _lognormal(3, 1),
    "n7": _lognormal(7, 2),
    "n17": _lognormal(17, 3),
    "n60": _lognormal(60, 4),
    "n60-narrow": np.sort(1.0 + 1e-3 * np.random.default_rng(5).random(60)),
    # ln λ ≈ 16 for all: suffix sums of raw logs would cancel ~1e-13 out of denominators
    # ~1e-5; logs taken relative to λ_max keep the error at float64 rounding.
    "n60-narrow-large": np.sort(1e7 * (1.0 + 1e-3 * np.random.default_rng(8).random(60))),
    "ties-ints-20": _integers(20, 6),
    "ties-ints-60": _integers(60, 7),
    "ties-at-top": np.array([0.5, 1.0, 2.0, 3.0, 3.0, 3.0]),
    "ties-at-bottom": np.array([1.0, 1.0, 1.0, 2.0, 5.0, 9.0]),
    "all-equal": np.full(5, 2.0),
}


@pytest.mark.parametrize("lam", BRUTE_CASES.values(), ids=BRUTE_CASES.keys())
def test_alpha_ks_all_matches_brute_force(lam: np.ndarray) -> None:
    """Vectorised suffix sums and blocked KS give the loop-by-loop spec values to 1e-12.

    Candidates whose tail is one repeated value have a zero denominator: NaN in both.
    """
    alphas, ds = alpha_ks_all(lam)
    want = brute_alpha_ks(lam.tolist())
    want_alphas = [want[i][0] for i in range(lam.size - 1)]
    want_ds = [want[i][1] for i in range(lam.size - 1)]
    assert alphas.shape == ds.shape == (lam.size - 1,)
    np.testing.assert_allclose(alphas, want_alphas, rtol=1e-12, atol=0.0)
    np.testing.assert_allclose(ds, want_ds, rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("cells", [1, 7, 50, 600], ids=lambda c: f"block-{c}")
def test_ks_blocks_do_not_change_results(cells: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one row, of a few rows, and ragged last blocks all give the brute-force D.

    With the default block size every small case fits in one block; shrinking it makes the
    n = 60 scan cross many block boundaries with a different tail width in each.
    """
    monkeypatch.setattr(powerlaw, "_CHUNK_ELEMENTS", cells)
    lam = BRUTE_CASES["n60"]
    want = brute_alpha_ks(lam.tolist())
    _, ds = alpha_ks_all(lam)
    np.testing.assert_allclose(ds, [want[i][1] for i in range(lam.size - 1)], atol=1e-12, rtol=0)


@pytest.mark.parametrize("lam", BRUTE_CASES.values(), ids=BRUTE_CASES.keys())
def test_dks_fit_matches_brute_force(lam: np.ndarray) -> None:
    """DKS = the smallest brute-force D over i = 0..n-2 with α > 1; fit_failed when none."""
    fit = fit_power_law(lam, fix_fingers="DKS")
    want = brute_best(lam.tolist(), range(lam.size - 1))
    if want is None:
        assert fit.status == "fit_failed"
        return
    assert fit.status == "ok"
    assert fit.alpha == pytest.approx(want[0], rel=1e-12)
    assert abs(fit.D - want[1]) <= 1e-12
    assert fit.xmin == want[2]


def test_dks_hand_computed() -> None:
    """λ = 1, 2, 4: from i = 0, Σ ln(λ_j/1) = 3 ln 2, so α = 1 + 1/ln 2 and (λ_k)^(1−α) = e^-k.

    D_0 = max(|1 − e^-1 − 1/3|, |1 − e^-2 − 2/3|) = 2/3 − e^-1 ≈ 0.299. From i = 1,
    α = 1 + 2/ln 2 and D_1 = 1/2 − e^-2 ≈ 0.365, so DKS keeps i = 0.
    """
    fit = fit_power_law(np.array([4.0, 1.0, 2.0]), fix_fingers="DKS")
    assert fit == PowerLawFit(
        alpha=pytest.approx(1 + 1 / math.log(2), rel=1e-14),  # type: ignore[arg-type]
        D=pytest.approx(2 / 3 - math.exp(-1), abs=1e-14),  # type: ignore[arg-type]
        xmin=1.0,
        status="ok",
    )


@pytest.mark.parametrize("n", [3, 4, 101, 1000])
def test_xmin_mid_is_median_candidate(n: int) -> None:
    """xmin_mid uses only i = n // 2: its α and D are the DKS table's entries at that i."""
    lam = _lognormal(n, seed=n)
    alphas, ds = alpha_ks_all(lam)
    fit = fit_power_law(lam, fix_fingers="xmin_mid")
    assert fit.xmin == lam[n // 2]
    assert (fit.alpha, fit.D) == (alphas[n // 2], ds[n // 2])


# --- xmin_peak --------------------------------------------------------------------------------


def test_xmin_peak_uses_linear_window() -> None:
    """The spec's window is 0.95·p ≤ λ ≤ 1.5·p in linear space.

    In make_peak_case the buggy lower bound log10(0.95·p) ≈ 1.27 admits ~950 Pareto values
    below the cluster, and the best D among them (xmin ≈ 1.27) lies outside the linear
    window: the two windows choose differently. The fit must match a brute-force search over
    the linear window.
    """
    lam = make_peak_case()
    p = peak_of(lam)
    candidates = lam[:-1]
    linear = np.flatnonzero((candidates >= 0.95 * p) & (candidates <= 1.5 * p))
    buggy = np.flatnonzero((candidates >= math.log10(0.95 * p)) & (candidates <= 1.5 * p))
    assert set(linear) < set(buggy)

    _, ds = alpha_ks_all(lam)
    buggy_pick = buggy[np.nanargmin(ds[buggy])]
    assert lam[buggy_pick] < 0.95 * p  # the bug would fit a different tail

    fit = fit_power_law(lam, fix_fingers="xmin_peak")
    assert fit.status == "ok"
    assert 0.95 * p <= fit.xmin <= 1.5 * p
    want = brute_best(lam.tolist(), range(int(linear[0]), int(linear[-1]) + 1))
    assert want is not None
    assert fit.alpha == pytest.approx(want[0], rel=1e-12)
    assert abs(fit.D - want[1]) <= 1e-12
    assert fit.xmin == want[2]


def test_xmin_peak_empty_window_is_fit_failed() -> None:
    """If the only value in the peak window is the largest one, there is no candidate."""
    lam = np.array([1.0, 1000.0, 1000.0])  # fullest bin holds the two 1000s; 1000 is the top
    fit = fit_power_law(lam, fix_fingers="xmin_peak")
    assert fit.status == "fit_failed"
    assert math.isnan(fit.alpha)


# --- edge cases ---------------------------------------------------------------------------


EDGE_CASES = {
    # name: (eigenvalues, expected status per mode in FIX_FINGERS order)
    "empty": ([], ("fit_failed", "fit_failed", "fit_failed")),
    "one-value": ([3.0], ("fit_failed", "fit_failed", "fit_failed")),
    "all-zeros": ([0.0] * 10, ("fit_failed", "fit_failed", "fit_failed")),
    "all-equal": ([2.0] * 10, ("fit_failed", "fit_failed", "fit_failed")),
    "all-below-thresh": ([1e-7, 5e-6, 1e-5], ("fit_failed", "fit_failed", "fit_failed")),
    # n = 2: the median i = 1 is the top value (tail of one), but i = 0 is a candidate.
    "two-values": ([2.0, 1.0], ("fit_failed", "ok", "ok")),
    "negatives-clamped": ([-1e-9, -3e-12, 0.0, 1.0, 2.0, 4.0, 8.0], ("ok", "ok", "ok")),
}


@pytest.mark.parametrize(("evals", "statuses"), EDGE_CASES.values(), ids=EDGE_CASES.keys())
@pytest.mark.parametrize("mode", FIX_FINGERS)
def test_edge_cases_give_status_without_warnings(
    evals: list[float], statuses: tuple[str, str, str], mode: str
) -> None:
    """Degenerate spectra get a status (no crash, no warning); failed fits are all NaN."""
    fit = fit_power_law(np.array(evals), fix_fingers=mode)
    assert fit.status == statuses[FIX_FINGERS.index(mode)]
    values = (fit.alpha, fit.D, fit.xmin)
    if fit.status == "fit_failed":
        assert all(math.isnan(v) for v in values)
    else:
        assert all(math.isfinite(v) for v in values) and fit.alpha > 1.0


def test_negatives_are_clamped_not_fitted() -> None:
    """Round-off negatives become 0, below evals_thresh: the fit is that of the positives."""
    with_negatives = fit_power_law(np.array([-1e-9, 8.0, 1.0, -3e-12, 2.0, 4.0]))
    positives = fit_power_law(np.array([1.0, 2.0, 4.0, 8.0]))
    assert with_negatives == positives


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fix_fingers": "xmin_median"},
        {"evals_thresh": -1.0},
        {"evals_thresh": math.nan},
        {"bins": 0},
    ],
    ids=["fix-fingers", "thresh-negative", "thresh-nan", "bins-zero"],
)
def test_bad_options_raise(kwargs: dict[str, object]) -> None:
    """Bad options are the caller's bug (settings validate them first): ValueError, named."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        fit_power_law(np.array([1.0, 2.0, 3.0]), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_eigenvalues_raise(bad: float) -> None:
    """NaN or inf means the weights are broken; a silent NaN row would hide that."""
    with pytest.raises(ValueError, match="finite"):
        layer_metrics(np.array([1.0, bad, 2.0]), max_dim=3)


def test_alpha_ks_all_rejects_unsorted() -> None:
    """alpha_ks_all takes the already-filtered ascending tail; anything else is a bug."""
    with pytest.raises(ValueError, match="ascending"):
        alpha_ks_all(np.array([2.0, 1.0]))


def test_dks_runs_on_4096() -> None:
    """A layer-sized spectrum goes through the blocked full scan (several blocks) to a fit."""
    fit = fit_power_law(make_pareto(2.5, 4096, seed=1), fix_fingers="DKS")
    assert fit.status == "ok"
    assert math.isfinite(fit.alpha) and math.isfinite(fit.D)


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
    code = "import sys, esd_worker.powerlaw; sys.exit('torch' in sys.modules)"
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
