"""LyCORIS updates: LoHa (Hadamard product of two low-rank products) and LoKr (Kronecker
product), both additive: W + ΔW, with ΔW reshaped to the base weight as peft does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from esd_worker.analysis.adapters.common import WeightUpdate, shape_error, unsupported_target
from esd_worker.analysis.layers import CONV2D, LINEAR
from esd_worker.core.errors import PermanentModelError

LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@dataclass(frozen=True)
class LycorisModule(WeightUpdate):
    """One LoHa or LoKr module: its saved parts (names as peft saves them) and alpha / r."""

    name: str
    parts: dict[str, torch.Tensor] = field(hash=False)
    scale: float
    target_type: str | None = None

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV2D))

    def delta(self, shape: tuple[int, ...], *, device: torch.device | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """peft's get_delta_weight, reshaped to `shape` (the base weight's)."""
        p = {k: v.to(device=device, dtype=dtype) for k, v in self.parts.items()}
        w = product(self.method, p) * self.scale
        if w.numel() != _numel(shape):
            raise shape_error(self.name, tuple(w.shape), shape)
        return w.reshape(shape)

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        weight += self.delta(tuple(weight.shape), device=weight.device, dtype=weight.dtype)


@dataclass(frozen=True)
class LohaModule(LycorisModule):
    """LoHa: ΔW = (w1_a @ w1_b) ⊙ (w2_a @ w2_b) · alpha/r (CP-decomposed kernels for
    use_effective_conv2d)."""

    method: ClassVar[str] = "LoHa"


@dataclass(frozen=True)
class LokrModule(LycorisModule):
    """LoKr: ΔW = w1 ⊗ w2 · alpha/r, each factor full or a low-rank product."""

    method: ClassVar[str] = "LoKr"


def product(kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return _loha(parts) if kind == "LoHa" else _lokr(parts)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _loha(p: dict[str, torch.Tensor]) -> torch.Tensor:
    if "hada_t1" in p:  # use_effective_conv2d: CP decomposition of the kernel
        one = torch.einsum("ijkl,jr,ip->prkl", p["hada_t1"], p["hada_w1_b"], p["hada_w1_a"])
        two = torch.einsum("ijkl,jr,ip->prkl", p["hada_t2"], p["hada_w2_b"], p["hada_w2_a"])
        return one * two
    return (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])


def _lokr(p: dict[str, torch.Tensor]) -> torch.Tensor:
    w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
    if "lokr_w2" in p:
        w2 = p["lokr_w2"]
    elif "lokr_t2" in p:
        w2 = torch.einsum("ijkl,ip,jr->prkl", p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"])
    else:
        w2 = p["lokr_w2_a"] @ p["lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    return torch.kron(w1, w2.contiguous())


def check_lycoris_parts(name: str, kind: str, parts: dict[str, torch.Tensor], r: int) -> None:
    """A bad adapter (naming the module) unless the parts make one of peft's layouts of rank
    r: the factors of each product present, with shapes that multiply."""
    try:
        if kind == "LoHa":
            needed = ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"]
            needed += ["hada_t1", "hada_t2"] if "hada_t1" in parts or "hada_t2" in parts else []
            rank = parts["hada_w1_b"].shape[0]
        else:
            needed = ["lokr_w1"] if "lokr_w1" in parts else ["lokr_w1_a", "lokr_w1_b"]
            needed += ["lokr_w2"] if "lokr_w2" in parts else ["lokr_w2_a", "lokr_w2_b"]
            rank = None
            for low in ("lokr_w1_b", "lokr_w2_b"):
                if low in parts:
                    rank = parts[low].shape[0]
        missing = [k for k in needed if k not in parts]
        if missing:
            raise PermanentModelError(
                f"bad adapter: {kind} module {name} has no {', '.join(missing)}"
            )
        if rank is not None and rank != r:
            raise PermanentModelError(
                f"bad adapter: {kind} module {name} has rank {rank}, its config says r={r}"
            )
        product(kind, {k: v.to("meta") for k, v in parts.items()})  # shapes only
    except (RuntimeError, IndexError, KeyError) as e:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(parts.items()))
        raise PermanentModelError(
            f"bad adapter: {kind} module {name} has parts that do not multiply ({shapes})"
        ) from e
