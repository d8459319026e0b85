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


def gram_eigenvalues(
    mats: torch.Tensor, *, solve_dtype: torch.dtype,
    eigensolver: Eigensolver = torch.linalg.eigvalsh,
) -> torch.Tensor:
    """Eigenvalues (>= 0) of the smaller Gram matrix of each matrix in the batch (k, M, N).

    The Gram matrix is formed in `mats`' dtype (the costly matmul) and diagonalised by
    `eigensolver` in `solve_dtype`, negatives (round-off of λ ≈ 0) clamped to 0. Where the
    eigensolver raises LinAlgError (no convergence: rare, ill-conditioned) the batch's
    singular values are taken in float64 instead. `eigensolver` is a parameter so that
    fallback can be exercised without patching torch.
    """
    _, M, N = mats.shape
    gram = mats.mT @ mats if M >= N else mats @ mats.mT
    gram = gram.to(solve_dtype)
    try:
        return eigensolver(gram).clamp_min_(0.0)
    except torch.linalg.LinAlgError:
        log.warning("eigvalsh did not converge on a %dx%d Gram; using float64 svdvals",
                    gram.shape[-1], gram.shape[-1])
    del gram
    return torch.linalg.svdvals(mats.to(torch.float64)).square()


def work_dtype(precision: str) -> torch.dtype:
    """The dtype a weight is analysed in for --precision
    (esd_worker.core.command.settings.PRECISIONS):
    the one map of precision to dtype (the analysis, its memory bound and speculation use
    it). ValueError for any other precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be float32 or float64, got {precision!r}")
    return torch.float64 if precision == "float64" else torch.float32


def compute_spectrum(
    weight: torch.Tensor, layer_type: str, *, precision: str = "float32", conv_norm: float = 0.5
) -> Spectrum:
    """Eigenvalues λ = σ² of the layer's weight, pooled over Conv2d slices.

    Both precisions diagonalise the smaller Gram matrix (WᵀW or WWᵀ) with eigvalsh,
    negatives clamped to 0, falling back to float64 svdvals where eigvalsh raises
    LinAlgError (gram_eigenvalues). fp16/bf16 weights are upcast before any linear algebra.

    float32: the Gram matrix is formed in float32. On the GPU it is diagonalised in float32
    too (docs/metrics.md: top-500 eigenvalues within 1e-6 of float64 SVD, measured on an
    H100). On the CPU, LAPACK's float32 eigensolver was measured 4.7e-5 off (4096² bf16
    Gaussian) while float64 eigvalsh of the same float32 Gram is 1e-7 off, so the CPU
    diagonalises in float64.

    float64: the Gram matrix is formed and diagonalised in float64 on the device. Squaring
    costs relative accuracy only on eigenvalues far below λ_max (absolute error
    ~ m·eps64·λ_max); the alphas agree with float64 svdvals to ~1e-12 (docs/metrics.md,
    benchmarks/bench_precision.py) at ~12x less time on an H100 for a 4096² layer.
    """
    dtype = work_dtype(precision)
    mats = as_matrices(weight.to(dtype), layer_type, conv_norm=conv_norm)
    _, M, N = mats.shape
    if layer_type == CONV1D:
        # Diagonalise the stored (in x out) layout: the Gram matrix, and so every bit of the
        # spectrum, is then that of a Linear layer stored the same way (a square weight would
        # otherwise give WWᵀ for one and WᵀW for the other), which lets
        # esd_worker.analysis.speculate
        # compute a 2-D tensor's spectrum before knowing which of the two it is.
        mats = mats.mT
    solve_dtype = torch.float64 if precision == "float64" or mats.device.type == "cpu" else dtype
    evals = gram_eigenvalues(mats, solve_dtype=solve_dtype)
    flat = evals.reshape(-1).to("cpu", torch.float64).numpy()
    return Spectrum(np.sort(flat), int(M), int(N), int(max(M, N)))
