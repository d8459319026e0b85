"""Additive low-rank updates: LoRA (rsLoRA, DoRA), AdaLoRA and VeRA, all W + scale·B@A.

DoRA then rescales each output row (each column for (in x out) layouts) of W + ΔW to its
learned magnitude; AdaLoRA's B @ (A·E) is a LoRA product with E folded into A; VeRA's is one
with the shared projections sliced to the layer and scaled by its lambda vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from esd_worker.analysis.adapters.common import (
    WeightUpdate,
    shape_error,
    stored_transposed,
    unsupported_target,
)
from esd_worker.analysis.layers import CONV1D, CONV2D, EMBEDDING, LINEAR


@dataclass(frozen=True)
class LoraModule(WeightUpdate):
    """The low-rank update of one module: delta = scale · B @ A (in the module's layout).

    magnitude: DoRA's per-output magnitudes (None for plain LoRA): the merged weight is
    magnitude / ‖W + ΔW‖ · (W + ΔW), norms taken per output feature as peft takes them.
    """

    name: str
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    embedding: bool = False
    target_type: str | None = None
    magnitude: torch.Tensor | None = None
    method: ClassVar[str] = "LoRA"

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        add_lora_(weight, self, fan_in_fan_out=fan_in_fan_out)

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV1D, CONV2D, EMBEDDING))


def _transposed(module: LoraModule, *, fan_in_fan_out: bool) -> bool:
    return stored_transposed(module.target_type, embedding=module.embedding,
                             fan_in_fan_out=fan_in_fan_out)


def add_lora_(weight: torch.Tensor, module: WeightUpdate, *, fan_in_fan_out: bool) -> None:
    """Apply one adapter update to `weight` (the caller's own copy), in place, on its device.

    For a LoRA module: weight += scale · B @ A in the checkpoint's layout, one addmm for
    Linear, Conv1D and Embedding (no full-size temporary, which matters for a 32000 x 4096
    lm_head on a GPU), then DoRA's rescaling if the module has magnitudes. Any other
    update applies itself (the name is historical: every method goes through here).
    """
    if not isinstance(module, LoraModule):
        module.apply_(weight, fan_in_fan_out=fan_in_fan_out)
        return
    _add_product_(weight, module, fan_in_fan_out=fan_in_fan_out)
    if module.magnitude is not None:
        _dora_rescale_(weight, module, fan_in_fan_out=fan_in_fan_out)


def _add_product_(weight: torch.Tensor, module: LoraModule, *, fan_in_fan_out: bool) -> None:
    if module.target_type == CONV2D or module.A.dim() == 4:
        weight += lora_delta(
            module, tuple(weight.shape), fan_in_fan_out=fan_in_fan_out,
            device=weight.device, dtype=weight.dtype,
        )
        return
    a = module.A.to(device=weight.device, dtype=weight.dtype)
    b = module.B.to(device=weight.device, dtype=weight.dtype)
    transposed = _transposed(module, fan_in_fan_out=fan_in_fan_out)
    shape = (a.shape[1], b.shape[0]) if transposed else (b.shape[0], a.shape[1])
    if tuple(shape) != tuple(weight.shape):
        raise shape_error(module.name, tuple(shape), weight)
    if transposed:
        weight.addmm_(a.t(), b.t(), alpha=module.scale)  # (B @ A)ᵀ = Aᵀ @ Bᵀ
    else:
        weight.addmm_(b, a, alpha=module.scale)


def _dora_rescale_(weight: torch.Tensor, module: LoraModule, *, fan_in_fan_out: bool) -> None:
    """weight (= W + ΔW) ← magnitude / ‖W + ΔW‖ · weight, as peft's DoRA merge.

    The norm is over each output feature's inputs: a row of (out x in) and of a Conv2d
    kernel (all of its in x kh x kw), a column of a Conv1D's (in x out); for an embedding
    (peft's DoRA takes its transpose) a column of (num_embeddings x dim)."""
    assert module.magnitude is not None
    magnitude = module.magnitude.to(device=weight.device, dtype=weight.dtype).flatten()
    per_column = weight.dim() == 2 and _transposed(module, fan_in_fan_out=fan_in_fan_out)
    count = weight.shape[1] if per_column else weight.shape[0]
    if magnitude.numel() != count:
        raise shape_error(f"{module.name} (DoRA magnitude)", (magnitude.numel(),), weight)
    if per_column:
        norm = torch.linalg.vector_norm(weight, dim=0)
        weight.mul_((magnitude / norm).unsqueeze(0))
    else:
        norm = torch.linalg.vector_norm(weight.reshape(count, -1), dim=1)
        weight.mul_((magnitude / norm).view(-1, *([1] * (weight.dim() - 1))))


def lora_delta(
    module: LoraModule,
    shape: tuple[int, ...],
    *,
    fan_in_fan_out: bool,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """scale · B @ A in the layout the base checkpoint stores the weight in, on `device`.

    Matches peft's get_delta_weight: Linear (out x in) as is; Conv1D stores (in x out), so
    the product is transposed (peft forces fan_in_fan_out on for Conv1D and off for
    Linear, whatever the config says; only a layer of unknown type follows the config);
    Embedding deltas are (B @ A)ᵀ; Conv2d uses the 1x1 product or the convolution of A
    by B, or (AdaLoRA, whose A is (r x in·kh·kw)) the product reshaped to the kernel.
    A and B are small: they are moved to the device and computed in `dtype` there.
    DoRA's rescaling is not part of the delta (it depends on the base weight).
    """
    a = module.A.to(device=device, dtype=dtype)
    b = module.B.to(device=device, dtype=dtype)
    target = module.target_type
    if a.dim() == 2 and b.dim() == 2 and target == CONV2D:
        delta = b @ a
        if delta.numel() == math.prod(shape):
            delta = delta.reshape(shape)
    elif target == CONV2D or a.dim() == 4:
        if a.shape[2:] == (1, 1):
            delta = (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], a.shape[1], 1, 1)
        else:
            delta = torch.nn.functional.conv2d(a.permute(1, 0, 2, 3), b).permute(1, 0, 2, 3)
    else:
        delta = b @ a
        if _transposed(module, fan_in_fan_out=fan_in_fan_out):
            delta = delta.t()
    delta = delta * module.scale
    if tuple(delta.shape) != tuple(shape):
        raise shape_error(module.name, tuple(delta.shape), shape)
    return delta


@dataclass(frozen=True)
class VeraModule(WeightUpdate):
    """VeRA: delta = (lambda_b ⊙ B[:out]) @ (lambda_d ⊙ A[:, :in]), with A (r x max_in) and
    B (max_out x r) the projections shared by every module (one copy, not one per module)."""

    name: str
    lambda_b: torch.Tensor
    lambda_d: torch.Tensor
    vera_A: torch.Tensor
    vera_B: torch.Tensor
    target_type: str | None = None
    method: ClassVar[str] = "VeRA"

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV1D))

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        transposed = stored_transposed(self.target_type, embedding=False,
                                       fan_in_fan_out=fan_in_fan_out)
        if weight.dim() != 2:
            raise shape_error(self.name, (self.lambda_b.numel(), -1), weight)
        out, inp = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
        if out != self.lambda_b.numel() or out > self.vera_B.shape[0] or inp > self.vera_A.shape[1]:
            raise shape_error(self.name, (self.lambda_b.numel(), self.vera_A.shape[1]), weight)
        dev, dt = weight.device, weight.dtype
        a = self.vera_A[:, :inp].to(dev, dt) * self.lambda_d.to(dev, dt).reshape(-1, 1)
        b = self.vera_B[:out, :].to(dev, dt) * self.lambda_b.to(dev, dt).reshape(-1, 1)
        LoraModule(self.name, a, b, 1.0, False, self.target_type).apply_(
            weight, fan_in_fan_out=fan_in_fan_out
        )
