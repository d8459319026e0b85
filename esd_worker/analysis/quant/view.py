"""A checkpoint's quantized weights read as float32 weights: which plan each module gets
(recognised by the tensors stored beside its weight, quantization_config breaking ties),
and the Tensors view over the checkpoint that reads each planned weight dequantized."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch

from esd_worker.analysis.quant.bnb4 import bnb4_plan
from esd_worker.analysis.quant.fp4 import fp4_plans
from esd_worker.analysis.quant.packed import packed_plan
from esd_worker.analysis.quant.plan import (
    FLOAT8_DTYPES,
    INTEGER_DTYPES,
    Module,
    Plan,
    QuantConfig,
    modules,
    refused,
)
from esd_worker.analysis.quant.scaled import scaled_plans
from esd_worker.analysis.weights import Tensors
from esd_worker.core.errors import PermanentModelError

log = logging.getLogger(__name__)


def plans(tensors: Tensors, config: QuantConfig) -> list[Plan]:
    """A plan for every quantized weight of the checkpoint, in its order; [] for a dense
    one."""
    found: list[Plan] = []
    for module in modules(tensors.keys()).values():
        found += module_plans(module, tensors, config)
    return found


def module_plans(module: Module, tensors: Tensors, config: QuantConfig) -> list[Plan]:
    """The plans of one module: each family asked in turn (the first that recognises the
    tensors stored decides), else a refusal for an integer or float8 weight stored with
    companions or under a quantization_config, else none (read as stored)."""
    fp4 = fp4_plans(module, tensors, config)
    if fp4:
        return fp4
    plan = packed_plan(module, tensors, config) or bnb4_plan(module, tensors)
    if plan is not None:
        return [plan]
    scaled = scaled_plans(module, tensors, config)
    if scaled:
        return scaled
    weight = module.params.get("weight")
    if weight is None:
        return []
    dtype = tensors.dtype(weight)
    others = module.others("weight")
    if dtype not in INTEGER_DTYPES | FLOAT8_DTYPES or not (others or config.raw):
        return []
    method = config.method or "no quant_method"
    beside = f", stored with {', '.join(k.rpartition('.')[2] for k in others)}" if others else ""
    return [refused(weight, tensors.shape(weight), weight, others,
                    f"{dtype} weight of a quantization not supported ({method}{beside})")]


class QuantizedView:
    """`tensors` with each planned weight under its logical key and shape, read as float32
    (dequantized on the CPU, one weight at a time), its stored tensors folded into it;
    every other tensor as stored. A refused weight stays a key of its logical shape whose
    `read` is a placeholder of no values (int8, never a float: the analysis gives it a
    status row)."""

    def __init__(self, tensors: Tensors, found: list[Plan], directory: Path | None = None
                 ) -> None:
        self.directory: Path = directory or tensors.directory
        self._inner = tensors
        self._plans = {plan.key: plan for plan in found}
        self._folded = {c: plan.key for plan in found for c in plan.companions}
        anchors = {plan.stored: plan.key for plan in found}
        keys: list[str] = []
        for key in tensors.keys():  # noqa: SIM118 - Tensors is not a Mapping
            if key in anchors:
                keys.append(anchors[key])
            elif key in self._plans:  # stored under the name a plan reads: part of it
                self._folded[key] = key
            elif key not in self._folded:
                keys.append(key)
        self._keys = list(dict.fromkeys(keys))
        schemes = Counter(p.scheme or "refused" for p in found)
        log.info("quantized checkpoint: %d weights dequantized or refused (%s)", len(found),
                 ", ".join(f"{n} {s}" for s, n in sorted(schemes.items())))
        reasons: dict[str, list[str]] = {}
        for plan in found:
            if plan.refusal is not None:
                reasons.setdefault(plan.refusal, []).append(plan.key)
        for why, keys in reasons.items():  # one line a reason, not one a weight
            log.warning("%d quantized weight%s cannot be dequantized (e.g. %s): %s", len(keys),
                        "" if len(keys) == 1 else "s", keys[0], why)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._plans or (key in self._inner and key not in self._folded)

    def shape(self, key: str) -> tuple[int, ...]:
        plan = self._plans.get(key)
        return self._inner.shape(key) if plan is None else plan.shape

    def dtype(self, key: str) -> str:
        plan = self._plans.get(key)
        if plan is None:
            return self._inner.dtype(key)
        return "F32" if plan.compute is not None else self._inner.dtype(plan.stored)

    def read(self, key: str) -> torch.Tensor:
        plan = self._plans.get(key)
        if plan is None:
            return self._inner.read(key)
        if plan.compute is None:
            return torch.zeros((), dtype=torch.int8).expand(plan.shape)
        return self._computed(plan, partial(plan.compute, self._inner))

    def read_row(self, key: str, index: int) -> torch.Tensor:
        plan = self._plans.get(key)
        if plan is None:
            return self._inner.read_row(key, index)
        if plan.compute is None:
            return torch.zeros((), dtype=torch.int8).expand(plan.shape[1:])
        if plan.row is None:
            return self.read(key)[index]
        return self._computed(plan, partial(plan.row, self._inner, index))

    def _computed(self, plan: Plan, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            tensor = compute()
        except (ValueError, RuntimeError, IndexError, KeyError) as e:
            raise PermanentModelError(
                f"cannot dequantize {plan.key} ({plan.scheme}) in {self.directory}: {e}"
            ) from e
        return tensor.to(torch.float32).contiguous()

    def nbytes(self, key: str) -> int:
        plan = self._plans.get(key)
        if plan is None:
            return self._inner.nbytes(key)
        return 0 if plan.compute is None else math.prod(plan.shape) * 4

    def in_memory(self, key: str) -> bool:
        """Dequantized weights are computed by `read`: nothing to read into a buffer."""
        return key in self._plans or self._inner.in_memory(key)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        if key not in self._plans:
            return self._inner.read_into(key, out)
        held = self.read(key)
        if not held.is_floating_point():
            return held
        n = held.numel() * held.element_size()
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < n:
            raise ValueError(f"a buffer of {out.numel()} bytes cannot hold {key!r} ({n} bytes)")
        return out[:n].view(held.dtype).reshape(held.shape).copy_(held)

    def scheme(self, key: str) -> str | None:
        plan = self._plans.get(key)
        return None if plan is None else plan.scheme

    def refusal(self, key: str) -> str | None:
        plan = self._plans.get(key)
        return None if plan is None else plan.refusal

    def folded(self) -> Mapping[str, str]:
        return dict(self._folded)

    def close(self) -> None:
        self._inner.close()

