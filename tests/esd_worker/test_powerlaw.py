"""Tests of esd_worker.core.powerlaw against docs/metrics.md: fit formulas, xmin choice, metrics."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from decimal import localcontext

import numpy as np
import pytest

from esd_worker.core import powerlaw
from esd_worker.core.powerlaw import (
    FIX_FINGERS,
    PowerLawFit,
    alpha_ks_all,
    fit_power_law,
    layer_metrics,
)
from tests.support.spectra import (
    BRUTE_CASES,
    _lognormal,
    brute_alpha_ks,
    brute_best,
    make_gaussian_evals,
    make_pareto,
    make_peak_case,
    peak_of,
)


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


def test_xmin_peak_window_ends_at_one_and_a_half_times_the_peak() -> None:
    """The window's upper bound is 1.5·p, inclusive: the pick below is the one only that
    bound gives.

    λ = 1, 1.5, 2, 2.5, 3, 4, 6 with one bin: the fullest bin is the only one, its left
    edge log10 λ_min = 0, so p = 1 exactly and the candidates are λ_i in [0.95, 1.5]:
    i = 0 (λ = 1) and i = 1 (λ = 1.5, on the bound). By the spec's formulas (docs/metrics.md),
    - α_1 = 1 + 6 / Σ_{j≥1} ln(λ_j / 1.5) = 1 + 6 / ln(540 / 1.5⁶) ≈ 2.5549, and
      D_1 = |1 − (2.5/1.5)^(1−α_1) − 2/6| ≈ 0.2148 (k = 2 is the largest of the six terms);
    - D_0 ≈ 0.2518 (α_0 ≈ 2.1126): larger, so the fit is λ = 1.5, α_1;
    - D_2 ≈ 0.1693 at λ = 2 is smaller than both: a bound above 2 would pick it, and a bound
      below 1.5 (or one that leaves out λ = 1.5·p itself) would pick λ = 1.
    α_1 is the closed form above; D_1 is the 40-digit brute force (tests/support/spectra.py).
    """
    lam = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0]
    alpha = 1 + 6 / math.log(540 / 1.5**6)
    fit = fit_power_law(lam, fix_fingers="xmin_peak", bins=1)
    assert (fit.status, fit.xmin) == ("ok", 1.5)
    assert fit.alpha == pytest.approx(alpha, rel=1e-12)
    distance = fit.D
    assert distance == pytest.approx(brute_alpha_ks(lam, range(1, 2))[1][1], rel=1e-12)
    assert distance == pytest.approx(0.2148, abs=1e-4)  # the hand value, to 4 places


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

