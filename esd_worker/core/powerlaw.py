"""Power-law fit and per-layer ESD metrics from eigenvalues (numpy only; no torch, no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FIX_FINGERS: tuple[str, ...] = ("xmin_mid", "xmin_peak", "DKS")
METRIC_COLUMNS: tuple[str, ...] = (
    "num_evals",
    "alpha",
    "D",
    "xmin",
    "xmax",
    "num_pl_spikes",
    "alpha_weighted",
    "log_alpha_norm",
    "spectral_norm",
    "log_spectral_norm",
    "norm",
    "log_norm",
    "stable_rank",
    "entropy",
    "matrix_rank",
)

STATUS_OK = "ok"
STATUS_FIT_FAILED = "fit_failed"

# Cells of one candidates-by-k block in the KS scan. Each cell costs 16 bytes at peak (two
# float64 arrays): 2**21 cells ≈ 32 MB, so the DKS scan stays well under 64 MB for any n.
_CHUNK_ELEMENTS = 2**21

# DKS on long tails skips candidates whose lower bound on D (from the first _PRUNE_HEAD and
# then every _PRUNE_STRIDE-th cell) already exceeds the best D found (see _dks_best).
_PRUNE_MIN_CANDIDATES = 256
_PRUNE_HEAD = 32
_PRUNE_STRIDE = 16
_PRUNE_BLOCK_ROWS = 32

# matrix_rank's tolerance is σ_max·max_dim·eps like numpy.linalg.matrix_rank's, but with
# float32's eps: the fast path computes eigenvalues in float32, so smaller σ are noise.
_EPS_FLOAT32 = float(np.finfo(np.float32).eps)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PowerLawFit:
    """Result of one power-law fit on the upper tail of an ESD.

    alpha: fitted exponent (dimensionless); NaN when the fit failed.
    D: KS distance between the tail and the fitted power law (0..1); NaN when failed.
    xmin: the chosen lower end of the tail (an eigenvalue); NaN when failed.
    status: "ok" or "fit_failed".
    """

    alpha: float
    D: float
    xmin: float
    status: str


_FAILED = PowerLawFit(alpha=math.nan, D=math.nan, xmin=math.nan, status=STATUS_FIT_FAILED)


def fit_power_law(
    evals: npt.ArrayLike,
    *,
    fix_fingers: str = "xmin_mid",
    evals_thresh: float = 1e-5,
    bins: int = 100,
) -> PowerLawFit:
    """Fit α to the eigenvalues above `evals_thresh`, choosing xmin as `fix_fingers` says.

    evals: eigenvalues λ = σ² in any order; negatives (round-off) are clamped to 0.
    """
    _check_options(fix_fingers=fix_fingers, evals_thresh=evals_thresh, bins=bins)
    return _fit_sorted(
        _prepare(evals), fix_fingers=fix_fingers, evals_thresh=evals_thresh, bins=bins
    )


def alpha_ks_all(tail_sorted: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """α_i and D_i for every candidate xmin = λ_i, i = 0..n-2, of ascending positive λ.

    A candidate whose tail is all one value has no fit: its α_i and D_i are NaN.
    """
    lam = np.asarray(tail_sorted, dtype=np.float64).ravel()
    if lam.size and not (np.all(np.isfinite(lam)) and lam[0] > 0):
        raise ValueError("alpha_ks_all needs finite eigenvalues > 0")
    if lam.size > 1 and np.any(np.diff(lam) < 0):
        raise ValueError("alpha_ks_all needs eigenvalues sorted ascending")
    alphas = _alphas(lam)
    return alphas, _ks_distances(lam, 0, alphas.size, alphas)


def layer_metrics(
    evals: npt.ArrayLike,
    *,
    max_dim: int,
    fix_fingers: str = "xmin_mid",
    evals_thresh: float = 1e-5,
    bins: int = 100,
) -> dict[str, float | int | str]:
    """Every METRIC_COLUMNS value plus "status" (the fit's) for one layer's eigenvalues.

    max_dim: max(M, N) of the weight matrix, for the matrix-rank tolerance.
    Norm metrics use all eigenvalues; only the fit applies `evals_thresh`.
    """
    _check_options(fix_fingers=fix_fingers, evals_thresh=evals_thresh, bins=bins)
    if max_dim < 1:
        raise ValueError(f"max_dim must be >= 1, got {max_dim}")
    lam = _prepare(evals)
    fit = _fit_sorted(lam, fix_fingers=fix_fingers, evals_thresh=evals_thresh, bins=bins)

    lam_max = float(lam[-1]) if lam.size else 0.0
    total = float(lam.sum())
    fitted = fit.status == STATUS_OK
    sigma = np.sqrt(lam)
    matrix_rank = int(np.count_nonzero(sigma > math.sqrt(lam_max) * max_dim * _EPS_FLOAT32))
    return {
        "num_evals": int(lam.size),
        "alpha": fit.alpha,
        "D": fit.D,
        "xmin": fit.xmin,
        "xmax": lam_max,
        "num_pl_spikes": int(np.count_nonzero(lam >= fit.xmin)) if fitted else 0,
        "alpha_weighted": fit.alpha * _log10(lam_max) if fitted else math.nan,
        "log_alpha_norm": _log10_power_sum(lam, fit.alpha) if fitted else math.nan,
        "spectral_norm": lam_max,
        "log_spectral_norm": _log10(lam_max),
        "norm": total,
        "log_norm": _log10(total),
        "stable_rank": total / lam_max if lam_max > 0 else math.nan,
        "entropy": _entropy(lam, total, matrix_rank),
        "matrix_rank": matrix_rank,
        "status": fit.status,
    }


def _check_options(*, fix_fingers: str, evals_thresh: float, bins: int) -> None:
    problems: list[str] = []
    if fix_fingers not in FIX_FINGERS:
        problems.append(f"fix_fingers: {fix_fingers!r} is not one of {', '.join(FIX_FINGERS)}")
    if not (math.isfinite(evals_thresh) and evals_thresh >= 0):
        problems.append(f"evals_thresh: must be finite and >= 0, got {evals_thresh}")
    if bins < 1:
        problems.append(f"bins: must be >= 1, got {bins}")
    if problems:
        raise ValueError("; ".join(problems))


def _prepare(evals: npt.ArrayLike) -> FloatArray:
    lam = np.asarray(evals, dtype=np.float64).ravel()
    if not np.all(np.isfinite(lam)):
        # NaN/inf would sort to arbitrary places and poison every metric: refuse, loudly.
        raise ValueError("eigenvalues must be finite (got NaN or inf)")
    return np.sort(np.maximum(lam, 0.0))


def _fit_sorted(
    lam: FloatArray, *, fix_fingers: str, evals_thresh: float, bins: int
) -> PowerLawFit:
    tail = lam[lam > evals_thresh]
    n = tail.size
    if n < 2:
        return _FAILED
    alphas = _alphas(tail)
    if fix_fingers == "DKS" and n - 1 >= _PRUNE_MIN_CANDIDATES:
        found = _dks_best(tail, alphas)
        if found is None:
            return _FAILED
        best, d = found
        return PowerLawFit(
            alpha=float(alphas[best]), D=d, xmin=float(tail[best]), status=STATUS_OK
        )
    if fix_fingers == "xmin_mid":
        lo, hi = n // 2, min(n // 2 + 1, n - 1)  # n = 2: the median is the top, no candidate
    elif fix_fingers == "xmin_peak":
        lo, hi = _peak_window(tail, bins)
    else:  # DKS on a short tail: the full scan is as cheap as pruning
        lo, hi = 0, n - 1
    ds = _ks_distances(tail, lo, hi, alphas[lo:hi])
    if not np.any(np.isfinite(ds)):
        return _FAILED
    pick = int(np.nanargmin(ds))  # the first of equal D, as the spec asks
    best = lo + pick
    return PowerLawFit(
        alpha=float(alphas[best]), D=float(ds[pick]), xmin=float(tail[best]), status=STATUS_OK
    )


def _dks_best(lam: FloatArray, alphas: FloatArray) -> tuple[int, float] | None:
    """The first i with the smallest D_i over the valid candidates, as a full scan finds it.

    D_i is a maximum over k of cells computed cell by cell; the maximum over some of those
    cells (the first _PRUNE_HEAD k, then every _PRUNE_STRIDE-th) is a lower bound
    LB_i ≤ D_i. Exact D_i are computed in increasing order of LB_i, and the search stops
    once the next LB_i exceeds the best D found: no remaining candidate can beat or tie it.
    Every cell is the same arithmetic as in _ks_distances, so D is bit-identical.
    """
    n = lam.size
    valid = np.flatnonzero(np.isfinite(alphas))
    if valid.size == 0:
        return None
    logs = _logs_from_top(lam)
    padded = np.concatenate([logs, np.full(n, np.inf)])
    exponents = 1.0 - alphas
    cols = np.unique(np.concatenate([np.arange(min(_PRUNE_HEAD, n)),
                                     np.arange(0, n, _PRUNE_STRIDE)]))
    step = max(1, _CHUNK_ELEMENTS // cols.size)
    bounds = np.concatenate([
        _ks_cells_max(padded, logs, exponents, valid[i : i + step], cols, n)
        for i in range(0, valid.size, step)
    ])
    order = valid[np.argsort(bounds, kind="stable")]
    bounds = np.sort(bounds, kind="stable")
    best_i, best_d = -1, math.inf
    rows_per_block = max(1, min(_PRUNE_BLOCK_ROWS, _CHUNK_ELEMENTS // n))
    for start in range(0, order.size, rows_per_block):
        if bounds[start] > best_d:
            break
        rows = order[start : start + rows_per_block]
        width = n - int(rows.min())
        ds = _ks_cells_max(padded, logs, exponents, rows, np.arange(width), n)
        for i, d in zip(rows.tolist(), ds.tolist(), strict=True):
            if d < best_d or (d == best_d and i < best_i):
                best_i, best_d = i, d
    return best_i, best_d


def _ks_cells_max(
    padded: FloatArray, logs: FloatArray, exponents: FloatArray, rows: npt.NDArray[np.intp],
    ks: npt.NDArray[np.intp], n: int,
) -> FloatArray:
    """max over k in ks of |(1 − min(k/n_i, 1)) − (λ_{i+k}/λ_i)^{1−α_i}| for each i in rows.

    `padded` is logs followed by +inf (cells past the tail are 0, as in _ks_distances).
    """
    block = padded[rows[:, None] + ks[None, :]] - logs[rows, None]
    block *= exponents[rows, None]
    with np.errstate(under="ignore"):
        np.exp(block, out=block)
    empirical = ks[None, :].astype(np.float64) / (n - rows)[:, None].astype(np.float64)
    np.minimum(empirical, 1.0, out=empirical)
    np.subtract(1.0, empirical, out=empirical)
    empirical -= block
    np.abs(empirical, out=empirical)
    result: FloatArray = empirical.max(axis=1)
    return result


def _alphas(lam: FloatArray) -> FloatArray:
    """α_i = 1 + n_i / (S_i − n_i·ln λ_i) for i = 0..n-2 via suffix sums S_i; NaN if invalid."""
    n = lam.size
    if n < 2:
        return np.empty(0)
    logs = _logs_from_top(lam)
    suffix = np.cumsum(logs[::-1])[::-1]
    tail_len = np.arange(n, 1, -1, dtype=np.float64)
    denom = suffix[:-1] - tail_len * logs[:-1]
    # A tail of identical values is a run of the largest value, whose shifted logs are exactly
    # 0: the denominator is exactly 0, α = inf, and the candidate is dropped as invalid.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        alphas = 1.0 + tail_len / denom
    return np.where(np.isfinite(alphas) & (alphas > 1.0), alphas, np.nan)


def _logs_from_top(lam: FloatArray) -> FloatArray:
    """ln(λ/λ_max) for ascending positive λ, accurate to float64 rounding near the top.

    Denominators are smallest near the top, so the suffix sums need those logs exact: there
    λ − λ_max is exact (Sterbenz) and log1p keeps its relative precision, whatever the scale
    of λ (ln λ − ln λ_max would carry an error of eps·|ln λ|, ~1e-9 relative at λ ~ 1e7 with
    a spread of 1e-4). Further down, ln λ − ln λ_max is fine and, unlike ln(λ/λ_max), cannot
    underflow.
    """
    top = float(lam[-1])
    near = lam >= 0.5 * top
    from_top = np.maximum((lam - top) / top, -0.5)  # clipped where unused: no log1p(-1)
    logs: FloatArray = np.where(near, np.log1p(from_top), np.log(lam) - math.log(top))
    return logs


def _ks_distances(lam: FloatArray, lo: int, hi: int, alphas: FloatArray) -> FloatArray:
    """D_i for the candidates i = lo..hi-1 of ascending λ (alphas[i - lo] = α_i).

    Rows without a fit (α_i NaN) get NaN. Works in blocks, rows = candidates and
    columns = k, of at most _CHUNK_ELEMENTS cells, so memory is bounded for any n.
    """
    n = lam.size
    out = np.full(hi - lo, np.nan)
    if hi <= lo:
        return out
    logs = _logs_from_top(lam)  # only differences matter; these are exact near the top
    # Row i of `windows` reads log λ_i, log λ_{i+1}, … and then +inf past the end of the
    # tail. There (λ_{i+k}/λ_i)^{1−α} = exp(−inf) = 0 and the empirical CDF is clipped to 1,
    # so padding cells contribute |1 − 1 − 0| = 0 to the max: no mask needed.
    padded = np.concatenate([logs, np.full(n - lo, np.inf)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, n - lo)
    valid = np.isfinite(alphas)
    exponents = np.where(valid, 1.0 - alphas, -1.0)  # any α > 1 will do for rows thrown away
    k = np.arange(n - lo, dtype=np.float64)
    start = lo
    while start < hi:
        width = n - start  # the first row of a block has the longest tail
        stop = min(hi, start + max(1, _CHUNK_ELEMENTS // width))
        block = windows[start:stop, :width] - logs[start:stop, None]  # ln(λ_{i+k}/λ_i)
        block *= exponents[start - lo : stop - lo, None]
        with np.errstate(under="ignore"):  # far out in a steep tail the power is ~0: fine
            np.exp(block, out=block)  # (λ_{i+k}/λ_i)^{1−α_i}
        empirical = k[:width] / np.arange(n - start, n - stop, -1, dtype=np.float64)[:, None]
        np.minimum(empirical, 1.0, out=empirical)
        # |(1 − power) − empirical|, computed in the empirical array to save a temporary.
        np.subtract(1.0, empirical, out=empirical)
        empirical -= block
        np.abs(empirical, out=empirical)
        out[start - lo : stop - lo] = empirical.max(axis=1)
        del block, empirical  # free before the next block is built: two blocks live, not four
        start = stop
    out[~valid] = np.nan
    return out


def _peak_window(lam: FloatArray, bins: int) -> tuple[int, int]:
    """Candidates lo..hi-1 (≤ n-2) with 0.95·p ≤ λ_i ≤ 1.5·p, p = 10^(left edge of fullest bin)."""
    counts, edges = np.histogram(np.log10(lam), bins=bins)
    peak = 10.0 ** float(edges[int(np.argmax(counts))])
    # TempBalance's net_esd_estimator sets the lower bound to log10(0.95·p) and compares it
    # with linear λ, which admits almost every λ below the peak. Both bounds are linear here.
    lo = int(np.searchsorted(lam, 0.95 * peak, side="left"))
    hi = int(np.searchsorted(lam, 1.5 * peak, side="right"))
    return lo, min(hi, lam.size - 1)


def _log10(x: float) -> float:
    return math.log10(x) if x > 0 else math.nan


def _log10_power_sum(lam: FloatArray, alpha: float) -> float:
    """log10 Σ λ^α, factored by λ_max^α so large λ and α cannot overflow."""
    lam_max = float(lam[-1])
    with np.errstate(under="ignore"):
        rest = float(np.sum((lam / lam_max) ** alpha))
    return alpha * math.log10(lam_max) + math.log10(rest)


def _entropy(lam: FloatArray, total: float, matrix_rank: int) -> float:
    """−Σ p ln p / ln R with p = λ/Σλ over the nonzero λ; 0 when R ≤ 1."""
    if matrix_rank <= 1 or total <= 0:
        return 0.0
    p = lam[lam > 0] / total
    p = p[p > 0]  # a subnormal λ over a large total can still round to 0
    return float(-np.sum(p * np.log(p)) / math.log(matrix_rank))
