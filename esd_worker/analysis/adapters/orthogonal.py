"""Orthogonal multipliers: OFT (block-diagonal rotation of the input features) and BOFT
(a product of permuted block-diagonal rotations, then a scale of each output feature).

Both merge as W ← W R (R: in x in, rows of W rotated) for a (out x in) weight, a Conv2d
kernel flattened to (out x in·kh·kw), and W ← W Rᵀ... as peft writes it: peft computes
(R Wᵀ)ᵀ = W Rᵀ. The rotation is applied block by block, never built as an (in x in) matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from esd_worker.analysis.adapters.common import WeightUpdate, shape_error, unsupported_target
from esd_worker.analysis.layers import CONV2D, EMBEDDING, LINEAR
from esd_worker.core.errors import PermanentModelError


def _skew(vec: torch.Tensor, size: int) -> torch.Tensor:
    """OFT's skew-symmetric blocks from their strict upper triangles (n x size(size-1)/2)."""
    rows, cols = torch.triu_indices(size, size, 1, device=vec.device)
    m = torch.zeros(vec.shape[0], size, size, device=vec.device, dtype=vec.dtype)
    m[:, rows, cols] = vec
    return m - m.transpose(-2, -1)


def _cayley(skew: torch.Tensor) -> torch.Tensor:
    """(I - S)(I + S)⁻¹ for each block: the exact Cayley transform (orthogonal)."""
    eye = torch.eye(skew.shape[-1], device=skew.device, dtype=skew.dtype).expand_as(skew)
    return torch.linalg.solve(eye + skew, eye - skew, left=False)


def _cayley_neumann(q: torch.Tensor, terms: int) -> torch.Tensor:
    """peft's truncated series for the Cayley transform: I + 2Q + 2Q² + … (its last term
    once), term for term as OFTRotationModule._cayley_batch sums it."""
    r = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype).repeat(q.shape[0], 1, 1)
    if terms > 1:
        r.add_(q, alpha=2.0)
        if terms > 2:
            power = torch.bmm(q, q)
            r.add_(power, alpha=2.0)
            for _ in range(3, terms - 1):
                power = torch.bmm(power, q)
                r.add_(power, alpha=2.0)
            power = torch.bmm(power, q)
            r.add_(power)
    return r


def _coft_project(vec: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """Constrained OFT: each block's skew matrix shrunk to Frobenius norm ≤ eps/√blocks."""
    skew = _skew(vec, size)
    # peft's bound is eps / torch.sqrt(torch.tensor(n)): a float32 root, a float32 quotient
    root = float(torch.sqrt(torch.tensor(skew.shape[0], dtype=torch.float32)))
    eps = float(torch.tensor(eps / root, dtype=torch.float32))
    norm = torch.linalg.matrix_norm(skew, keepdim=True)
    out = torch.where(norm <= eps, skew, eps * (skew / norm))
    rows, cols = torch.triu_indices(size, size, 1, device=vec.device)
    return out[:, rows, cols]


def _rotate_columns_(flat: torch.Tensor, blocks: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """flat (out x n·b) times blockdiag(blocks)ᵀ (transpose) or blockdiag(blocks)."""
    n, b, _ = blocks.shape
    x = flat.reshape(flat.shape[0], n, b)
    spec = "onk,nck->onc" if transpose else "onk,nkc->onc"
    return torch.einsum(spec, x, blocks).reshape(flat.shape)


@dataclass(frozen=True)
class OftModule(WeightUpdate):
    """OFT: oft_R holds, per block (or one shared block), the upper triangle of a skew
    matrix Q; R = Cayley(Q) (or its Neumann series), block-diagonal over the input
    features. Linear/Conv2d: W ← W Rᵀ; Embedding (dim is its input): W ← W R."""

    name: str
    vec: torch.Tensor
    coft: bool = False
    eps: float = 6e-5
    use_cayley_neumann: bool = True
    num_cayley_neumann_terms: int = 5
    embedding: bool = False
    target_type: str | None = None
    method: ClassVar[str] = "OFT"

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV2D, EMBEDDING))

    def check_block_size(self) -> None:
        """PermanentModelError unless oft_R's rows are upper triangles of square blocks."""
        _ = self.block_size

    @property
    def block_size(self) -> int:
        n = self.vec.shape[1]
        size = (1 + math.isqrt(1 + 8 * n)) // 2
        if size * (size - 1) // 2 != n:
            raise PermanentModelError(
                f"bad adapter: OFT module {self.name} has oft_R of shape {tuple(self.vec.shape)}:"
                f" {n} is not the size of a block's upper triangle"
            )
        return size

    def blocks(self, features: int, *, device: torch.device | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rotation's diagonal blocks (features/b x b x b): peft's get_delta_weight."""
        size = self.block_size
        vec = self.vec.to(device=device, dtype=dtype)
        if self.coft:
            vec = _coft_project(vec, size, self.eps)
        skew = _skew(vec, size)
        r = (_cayley_neumann(skew, self.num_cayley_neumann_terms) if self.use_cayley_neumann
             else _cayley(skew))
        count = features // size
        if features % size or r.shape[0] not in (1, count):
            raise PermanentModelError(
                f"adapter module {self.name}: OFT blocks {tuple(r.shape)} do not cover "
                f"{features} input features: wrong base model?"
            )
        return r.expand(count, size, size) if r.shape[0] == 1 else r

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        embedding = self.embedding or self.target_type == EMBEDDING
        flat = weight.reshape(weight.shape[0], -1)
        blocks = self.blocks(flat.shape[1], device=weight.device, dtype=weight.dtype)
        weight.copy_(_rotate_columns_(flat, blocks, transpose=not embedding).view_as(weight))


def butterfly_perm(n: int, blocks: int, r: int, factor: int) -> torch.Tensor:
    """BOFTLayer.block_butterfly_perm: the index permutation of one butterfly level."""
    if factor == 0:
        return torch.arange(n)
    if blocks * r * 2 > n:
        raise PermanentModelError("BOFT: invalid number of blocks for its butterfly factor")
    size = n // blocks
    step = size / r
    order = torch.empty(size, dtype=torch.long)
    initial = torch.arange(size)
    seq = torch.cat((torch.arange(0, step, 2), torch.arange(1, step, 2)))
    for i, pos in enumerate(seq.tolist()):
        order[int(i * r): int(i * r + r)] = initial[int(pos * r): int(pos * r + r)]
    indices = torch.arange(n)
    for i in range(0, n, size):
        indices[i: i + size] = indices[i: i + size][order]
    return indices


@dataclass(frozen=True)
class BoftModule(WeightUpdate):
    """BOFT: boft_R (N x D x b x b) gives N butterfly levels of D Cayley blocks; level i is
    Mᵢ = Pᵢ·blockdiag(Cayley(Rᵢ))·Pᵢᵀ, the rotation M = M_{N-1}…M₀, and W ← (W Mᵀ) ⊙ s with
    s (boft_s) one scale per output feature."""

    name: str
    R: torch.Tensor
    s: torch.Tensor
    target_type: str | None = None
    method: ClassVar[str] = "BOFT"

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV2D))

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        levels, count, size, _ = self.R.shape
        flat = weight.reshape(weight.shape[0], -1)
        features = flat.shape[1]
        s = self.s.to(device=weight.device, dtype=weight.dtype).flatten()
        if count * size != features or s.numel() != weight.shape[0]:
            raise shape_error(self.name, (s.numel(), count * size), weight)
        data = self.R.to(device=weight.device, dtype=weight.dtype).reshape(-1, size, size)
        rot = _cayley(0.5 * (data - data.transpose(1, 2))).reshape(levels, count, size, size)
        x = flat
        for i in range(levels):  # x ← x Mᵢᵀ = x Pᵢ blockdiag(Bᵢ)ᵀ Pᵢᵀ
            idx = butterfly_perm(features, count // 2**i, size // 2, levels - 1).to(x.device)
            inverse = torch.argsort(idx)
            x = _rotate_columns_(x[:, inverse], rot[i], transpose=True)[:, idx]
        weight.copy_((x * s.unsqueeze(1)).view_as(weight))
