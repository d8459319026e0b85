"""IA3: a learned vector multiplies the layer's input features (feedforward modules) or its
output features (every other module); merged, it scales the weight's columns or rows."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from esd_worker.analysis.adapters.common import (
    WeightUpdate,
    shape_error,
    stored_transposed,
    unsupported_target,
)
from esd_worker.analysis.layers import CONV1D, CONV2D, LINEAR


def is_feedforward(config: dict[str, Any], name: str) -> bool:
    """peft's IA3 rule: feedforward_modules as a string is a regex the whole module name must
    match; as a list, names the module name ends with."""
    modules = config.get("feedforward_modules")
    if isinstance(modules, str):
        return re.fullmatch(modules, name) is not None
    return any(name.endswith(str(m)) for m in modules or ())


@dataclass(frozen=True)
class Ia3Module(WeightUpdate):
    """W ← W ⊙ l: l (as peft saves ia3_l: (1 x in) feedforward, (out x 1) otherwise, and
    (1 x n x 1 x 1) for Conv2d) scales input columns or output rows of (out x in)."""

    name: str
    vector: torch.Tensor
    feedforward: bool
    target_type: str | None = None
    method: ClassVar[str] = "IA3"

    def check_target(self) -> None:
        unsupported_target(self, (LINEAR, CONV1D, CONV2D))

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        v = self.vector.to(device=weight.device, dtype=weight.dtype).flatten()
        if weight.dim() == 4:
            weight.mul_(_conv_scaling(v, weight, feedforward=self.feedforward, name=self.name))
            return
        transposed = stored_transposed(self.target_type, embedding=False,
                                       fan_in_fan_out=fan_in_fan_out)
        # (out x in): feedforward scales dimension 1; stored (in x out), dimension 0.
        dim = (0 if transposed else 1) if self.feedforward else (1 if transposed else 0)
        if weight.dim() != 2 or weight.shape[dim] != v.numel():
            raise shape_error(self.name, tuple(self.vector.shape), weight)
        weight.mul_(v.unsqueeze(0) if dim == 1 else v.unsqueeze(1))


def _conv_scaling(v: torch.Tensor, weight: torch.Tensor, *, feedforward: bool,
                  name: str) -> torch.Tensor:
    """The factor peft's Conv2d merge multiplies the kernel (out x in/groups x kh x kw) by."""
    out, per_group = weight.shape[0], weight.shape[1]
    if not feedforward:
        if v.numel() != out:
            raise shape_error(name, (1, v.numel(), 1, 1), weight)
        return v.view(-1, 1, 1, 1)
    if v.numel() % per_group or out % (v.numel() // per_group):
        raise shape_error(name, (1, v.numel(), 1, 1), weight)
    groups = v.numel() // per_group
    # input channel g·per_group + j feeds kernel column j of group g's output channels
    factor = v.view(groups, 1, per_group).expand(groups, out // groups, per_group)
    return factor.reshape(out, per_group, 1, 1)
