"""Eigenvalue samples with known answers (Pareto tails, Gaussian matrices, a histogram peak) and
brute-force fits to check esd_worker.core.powerlaw against."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np


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


NAN = math.nan




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
