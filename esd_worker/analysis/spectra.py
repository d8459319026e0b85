"""Eigenvalues of one weight tensor on a torch device: Gram matrix + eigvalsh (float32 or
float64), float64 SVD where the eigensolver does not converge. Owns what --precision means
as a dtype (work_dtype), for every part of the analysis."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from esd_worker.analysis.layers import CONV1D, CONV2D
from esd_worker.core.command.settings import PRECISIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spectrum:
    """Eigenvalues (ascending, float64, >= 0) of a layer and the shape they came from.

    M, N: rows and columns of the weight matrix as the layer applies it (out x in);
    max_dim: max(M, N) of one matrix, for the matrix-rank tolerance.
    """

    evals: np.ndarray
    M: int
    N: int
    max_dim: int


def as_matrices(weight: torch.Tensor, layer_type: str, *, conv_norm: float) -> torch.Tensor:
    """The layer's weight as a batch of (out x in) matrices, shape (k, M, N).

    Conv1D stores (in x out): transposed, same singular values. Conv2d (out, in, kh, kw)
    becomes kh*kw matrices (out x in) scaled by sqrt(conv_norm) whose spectra are pooled.
    Embedding (vocab x dim) is analysed as stored.
    """
    if layer_type == CONV2D:
        if weight.dim() != 4:
            raise ValueError(f"Conv2d weight must be 4-D, got shape {tuple(weight.shape)}")
        out_ch, in_ch, kh, kw = weight.shape
        mats = weight.permute(2, 3, 0, 1).reshape(kh * kw, out_ch, in_ch)
        return mats * math.sqrt(conv_norm)
    if weight.dim() != 2:
        raise ValueError(f"{layer_type} weight must be 2-D, got shape {tuple(weight.shape)}")
    if layer_type == CONV1D:
        weight = weight.t()
    return weight.unsqueeze(0)


Eigensolver = Callable[[torch.Tensor], torch.Tensor]


def work_dtype(precision: str) -> torch.dtype:
    """The dtype a weight is analysed in for --precision
    (esd_worker.core.command.settings.PRECISIONS):
    the one map of precision to dtype (the analysis, its memory bound and speculation use
    it). ValueError for any other precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be float32 or float64, got {precision!r}")
    return torch.float64 if precision == "float64" else torch.float32


@dataclass(frozen=True)
class Gram:
    """A layer's Gram matrices, formed where its weight is (k x n x n, the work dtype), and
    the shape the spectrum comes from; `mats` are kept for the float64 SVD fallback."""

    gram: torch.Tensor
    mats: torch.Tensor
    M: int
    N: int
    max_dim: int

    @property
    def nbytes(self) -> int:
        return self.gram.numel() * self.gram.element_size()


def gram_matrices(
    weight: torch.Tensor, layer_type: str, *, precision: str = "float32", conv_norm: float = 0.5
) -> Gram:
    """The smaller Gram matrix (WᵀW or WWᵀ) of each of the layer's matrices, in the work
    dtype on the weight's device (the costly matmul; fp16/bf16 upcast first)."""
    dtype = work_dtype(precision)
    mats = as_matrices(weight.to(dtype), layer_type, conv_norm=conv_norm)
    _, M, N = mats.shape
    if layer_type == CONV1D:
        # Diagonalise the stored (in x out) layout: the Gram matrix, and so every bit of the
        # spectrum, is then that of a Linear layer stored the same way (a square weight would
        # otherwise give WWᵀ for one and WᵀW for the other), which lets
        # esd_worker.analysis.speculate compute a 2-D tensor's spectrum before knowing which
        # of the two it is.
        mats = mats.mT
    m, n = mats.shape[-2:]
    gram = mats.mT @ mats if m >= n else mats @ mats.mT
    return Gram(gram, mats, int(M), int(N), int(max(M, N)))


def solve_gram(gram: torch.Tensor, *, fallback: torch.Tensor | None = None,
               eigensolver: Eigensolver = torch.linalg.eigvalsh) -> torch.Tensor:
    """Eigenvalues (>= 0, float64) of a batch of Gram matrices, diagonalised in float64
    wherever they are (the device, or a host eigensolver: esd_worker.analysis.hostsolve), so
    that a layer's spectrum does not depend on which side solved it. Where eigvalsh raises
    LinAlgError (no convergence: rare), the float64 singular values of `fallback` (the
    layer's matrices) squared, or of the Gram matrices themselves without them.
    `eigensolver` is a parameter so that the fallback can be exercised without patching
    torch."""
    gram64 = gram.to(torch.float64)
    try:
        return eigensolver(gram64).clamp_min_(0.0)
    except torch.linalg.LinAlgError:
        log.warning("eigvalsh did not converge on a %dx%d Gram; using float64 svdvals",
                    gram.shape[-1], gram.shape[-1])
    del gram64
    if fallback is not None:
        return torch.linalg.svdvals(fallback.to(torch.float64)).square()
    return torch.linalg.svdvals(gram.to(torch.float64))


def sorted_evals(evals: torch.Tensor) -> np.ndarray:
    """A batch's eigenvalues pooled, ascending, float64, on the host."""
    return np.sort(evals.reshape(-1).to("cpu", torch.float64).numpy())


def compute_spectrum(
    weight: torch.Tensor, layer_type: str, *, precision: str = "float32", conv_norm: float = 0.5
) -> Spectrum:
    """Eigenvalues λ = σ² of the layer's weight, pooled over Conv2d slices.

    The smaller Gram matrix (WᵀW or WWᵀ) is formed in the work dtype on the weight's device
    (gram_matrices) and diagonalised in float64 with eigvalsh (solve_gram), negatives
    clamped to 0, falling back to float64 svdvals where eigvalsh raises LinAlgError.

    float32: the Gram matrix is formed in float32, the costly part; its eigensolver runs in
    float64 on every device. A float32 eigensolver was measured 4.7e-5 off on the CPU (LAPACK,
    4096² bf16 Gaussian) against 1e-7 for float64 eigvalsh of the same float32 Gram, and on
    an H100 it put α up to 1.1e-3 off on a 7B layer whose noise eigenvalues cross
    evals_thresh (docs/metrics.md); the float64 solve makes the result the same whichever
    side solved it (the GPU, or a host eigensolver).

    float64: the Gram matrix is formed in float64 too. Squaring costs relative accuracy only
    on eigenvalues far below λ_max (absolute error ~ m·eps64·λ_max); the alphas agree with
    float64 svdvals to ~1e-12 (docs/metrics.md, benchmarks/bench_precision.py) at ~12x less
    time on an H100 for a 4096² layer.
    """
    g = gram_matrices(weight, layer_type, precision=precision, conv_norm=conv_norm)
    evals = solve_gram(g.gram, fallback=g.mats)
    return Spectrum(sorted_evals(evals), g.M, g.N, g.max_dim)
