"""LoRA adapters: read adapter_config.json and weights, merge W + scale·B@A one layer at a time."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from esd_worker.errors import PermanentModelError, UnsupportedAdapterError
from esd_worker.layers import CONV1D, CONV2D, EMBEDDING, LayerSpec, match_by_suffix, suffix_index
from esd_worker.weights import Checkpoint

ADAPTER_CONFIG = "adapter_config.json"

_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
    r"(?:\.(?P<adapter>[^.]+?))??(?:\.weight)?$"
)
_SAVED_MODULE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)(?:\.modules_to_save\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """The low-rank update of one module: delta = scale · B @ A (in the module's layout)."""

    name: str
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    embedding: bool = False


@dataclass(frozen=True)
class AdapterInfo:
    """What result.json records about an adapter."""

    peft_type: str
    base_model: str | None
    r: int | None
    lora_alpha: float | None
    use_rslora: bool
    fan_in_fan_out: bool


def read_adapter_config(directory: Path) -> dict[str, Any]:
    path = directory / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise PermanentModelError(f"{directory} is not an adapter: no {ADAPTER_CONFIG}") from e
    except (OSError, ValueError) as e:
        raise PermanentModelError(f"corrupt {ADAPTER_CONFIG} in {directory}: {e}") from e
    if not isinstance(config, dict):
        raise PermanentModelError(f"corrupt {ADAPTER_CONFIG} in {directory}: not an object")
    return config


def _check_supported(config: dict[str, Any]) -> None:
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(
            f"adapter type {peft_type or 'unknown'!r} is not supported (only LoRA adapters are "
            "merged; DoRA, IA3, LoHa, LoKr, AdaLoRA and prompt-tuning adapters are not)"
        )
    if config.get("use_dora"):
        raise UnsupportedAdapterError(
            "adapter type 'DoRA' (LoRA with use_dora=true) is not supported: its merge rescales "
            "whole weight columns"
        )
    if config.get("layer_replication"):
        raise UnsupportedAdapterError("LoRA adapters with layer_replication are not supported")


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    # Same rule as peft.utils.other.get_pattern_key: the first pattern that matches a
    # dotted suffix of the module name.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


class LoraAdapter:
    """A loaded LoRA adapter, small enough to hold in memory (A and B are low rank)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config = read_adapter_config(directory)
        _check_supported(self.config)
        self.fan_in_fan_out = bool(self.config.get("fan_in_fan_out", False))
        self.use_rslora = bool(self.config.get("use_rslora", False))
        self.modules: dict[str, LoraModule] = {}
        self.replaced: dict[str, torch.Tensor] = {}  # modules_to_save: full weights
        with Checkpoint(directory, adapter=True) as ckpt:
            tensors = {k: ckpt.read(k) for k in ckpt.keys()}
        self._collect(tensors)
        if not self.modules and not self.replaced:
            raise PermanentModelError(f"adapter in {directory} holds no LoRA weights")

    @property
    def info(self) -> AdapterInfo:
        r = self.config.get("r")
        alpha = self.config.get("lora_alpha")
        return AdapterInfo(
            peft_type="LORA",
            base_model=self.config.get("base_model_name_or_path"),
            r=int(r) if r is not None else None,
            lora_alpha=float(alpha) if alpha is not None else None,
            use_rslora=self.use_rslora,
            fan_in_fan_out=self.fan_in_fan_out,
        )

    def _collect(self, tensors: dict[str, torch.Tensor]) -> None:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            m = _LORA_KEY.match(key)
            if m:
                parts.setdefault(m["module"], {})[m["part"]] = tensor
                continue
            saved = _SAVED_MODULE.match(key)
            if saved and "lora_" not in key:
                self.replaced[saved["module"]] = tensor
        rank_pattern = self.config.get("rank_pattern") or {}
        alpha_pattern = self.config.get("alpha_pattern") or {}
        for name, p in parts.items():
            embedding = "lora_embedding_A" in p
            a = p.get("lora_embedding_A" if embedding else "lora_A")
            b = p.get("lora_embedding_B" if embedding else "lora_B")
            if a is None or b is None:
                raise PermanentModelError(f"adapter module {name} has lora_A or lora_B missing")
            r = a.shape[0]
            configured_r = _pattern_value(rank_pattern, name, self.config.get("r", r))
            if int(configured_r) != r:
                raise PermanentModelError(
                    f"adapter module {name}: lora_A has rank {r}, config says r={configured_r}"
                )
            alpha = float(_pattern_value(alpha_pattern, name, self.config.get("lora_alpha", r)))
            scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
            self.modules[name] = LoraModule(name, a, b, scale, embedding)

    def match(self, layers: list[LayerSpec]) -> tuple[dict[str, LoraModule], dict[str, torch.Tensor]]:
        """Pair adapter modules with layers (by module path suffix); unmatched ones are an error."""
        index = suffix_index(spec.name for spec in layers)
        merged: dict[str, LoraModule] = {}
        for name, module in self.modules.items():
            layer = match_by_suffix(name, index, min_parts=1)
            if layer is None:
                raise PermanentModelError(
                    f"adapter module {name} matches no layer of the base model: wrong base model?"
                )
            merged[layer] = module
        replaced: dict[str, torch.Tensor] = {}
        for name, tensor in self.replaced.items():
            layer = match_by_suffix(name, index, min_parts=1)
            if layer is not None:
                replaced[layer] = tensor
        return merged, replaced


def lora_delta(module: LoraModule, spec: LayerSpec, *, fan_in_fan_out: bool) -> torch.Tensor:
    """scale · B @ A in the layout the base checkpoint stores the layer's weight in.

    Matches peft's get_delta_weight: Linear (out x in) as is; Conv1D and fan_in_fan_out
    layers store (in x out), so the product is transposed; Embedding deltas are (B @ A)ᵀ;
    Conv2d uses the 1x1 product or the convolution of A by B.
    """
    a = module.A.to(torch.float32) if module.A.dtype != torch.float64 else module.A
    b = module.B.to(a.dtype)
    if spec.layer_type == CONV2D:
        if a.shape[2:] == (1, 1):
            delta = (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], a.shape[1], 1, 1)
        else:
            delta = torch.nn.functional.conv2d(a.permute(1, 0, 2, 3), b).permute(1, 0, 2, 3)
    else:
        delta = b @ a
        if module.embedding or spec.layer_type == EMBEDDING:
            delta = delta.t()
        elif spec.layer_type == CONV1D or fan_in_fan_out:
            delta = delta.t()
    delta = delta * module.scale
    if tuple(delta.shape) != tuple(spec.shape):
        raise PermanentModelError(
            f"adapter delta for {spec.name} has shape {tuple(delta.shape)}, the base weight "
            f"{tuple(spec.shape)}: wrong base model?"
        )
    return delta
