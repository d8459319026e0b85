"""LoRA adapters: read adapter_config.json and weights, merge W + scale·B@A one layer at a time."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from esd_worker.analysis.layers import (
    CONV1D,
    CONV2D,
    EMBEDDING,
    MATRIX,
    LayerSpec,
    match_by_suffix,
    suffix_index,
)
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.errors import PermanentModelError, UnsupportedAdapterError

ADAPTER_CONFIG = "adapter_config.json"

_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
    r"(?:\.(?P<adapter>[^.]+?))??(?:\.weight)?$"
)
_SAVED_MODULE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)(?:\.modules_to_save\.[^.]+)?\.weight$"
)
# DoRA's per-column magnitudes: `<module>.lora_magnitude_vector` as peft saves them today,
# `<module>.lora_magnitude_vector.weight` in older peft versions.
_DORA_KEY = re.compile(r"(?:^|\.)lora_magnitude_vector(?:\.|$)")

# LoRA options whose merge is not W + scale·B@A (or that change which weights exist); an
# adapter using one is refused rather than analysed wrongly. Option → what to call it.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (LoRA with use_dora=true: its merge rescales whole weight columns)",
    "layer_replication": "LoRA with layer_replication (adds layers the base does not have)",
    "target_parameters": "LoRA on target_parameters (parameters, not modules)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "use_qalora": "QA-LoRA (use_qalora: quantisation-aware, pooled inputs)",
    "kasa_config": "KaSA (kasa_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: cannot be merged)",
    "trainable_token_indices": "LoRA with trainable tokens (trainable_token_indices)",
}


@dataclass(frozen=True)
class LoraModule:
    """The low-rank update of one module: delta = scale · B @ A (in the module's layout).

    target_type: the layer type of the module the update belongs to, set when the adapter
    is matched to the base model (it decides the layout of the delta).
    """

    name: str
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    embedding: bool = False
    target_type: str | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """What result.json records about an adapter."""

    peft_type: str
    base_model: str | None
    r: int | None
    lora_alpha: float | None
    use_rslora: bool
    fan_in_fan_out: bool


@dataclass(frozen=True)
class AdapterMatch:
    """Where an adapter's updates go in the base checkpoint.

    merges: checkpoint key → the updates to add to that tensor (two when tied modules both
    carry one); every layer read from the key gets them, as peft's in-place merge of a
    tied weight changes both modules. replaced: layer name → full weight saved with the
    adapter (modules_to_save). unanalysed: adapter modules whose base weight is not an
    analysed layer (e.g. an embedding without --include-embeddings).
    """

    merges: dict[str, list[LoraModule]]
    replaced: dict[str, torch.Tensor]
    unanalysed: list[str]

    @property
    def merged_modules(self) -> int:
        return sum(len(mods) for mods in self.merges.values())


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


def check_supported(config: dict[str, Any]) -> None:
    """Raise UnsupportedAdapterError naming the adapter type or option this merge cannot do."""
    peft_type = str(config.get("peft_type") or "").upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(
            f"adapter type {peft_type or 'unknown'!r} is not supported: only LoRA adapters are "
            "merged (not IA3, LoHa, LoKr, AdaLoRA, VeRA, OFT, BOFT or prompt tuning)"
        )
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise UnsupportedAdapterError(f"adapter type {what} is not supported")


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
        check_supported(self.config)
        self.fan_in_fan_out = bool(self.config.get("fan_in_fan_out", False))
        self.use_rslora = bool(self.config.get("use_rslora", False))
        self.modules: dict[str, LoraModule] = {}
        self.replaced: dict[str, torch.Tensor] = {}  # modules_to_save: full weights
        with Checkpoint(directory, adapter=True) as ckpt:
            keys = ckpt.keys()
            dora = next((k for k in keys if _DORA_KEY.search(k)), None)
            if dora is not None:
                # The weights are DoRA's whatever the config says; merged as plain LoRA,
                # their magnitudes would be dropped without a word.
                raise UnsupportedAdapterError(
                    f"adapter type DoRA (its weights hold {dora}, though {ADAPTER_CONFIG} "
                    "does not set use_dora: its merge rescales whole weight columns) is not "
                    "supported"
                )
            tensors = {k: ckpt.read(k) for k in keys}
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
            if key.endswith(".bias"):
                # lora_bias (and saved biases) change a layer's bias, not its weight matrix:
                # nothing to merge into the spectrum. Matched as a lora part, a bias would
                # overwrite B with a vector.
                continue
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
            embedding = "lora_embedding_A" in p or "lora_embedding_B" in p
            a = p.get("lora_embedding_A" if embedding else "lora_A")
            b = p.get("lora_embedding_B" if embedding else "lora_B")
            if a is None or b is None:
                raise PermanentModelError(f"adapter module {name} has lora_A or lora_B missing")
            _check_ranks(name, a, b, embedding=embedding)
            r = a.shape[0]
            configured_r = _pattern_value(rank_pattern, name, self.config.get("r", r))
            if int(configured_r) != r:
                raise PermanentModelError(
                    f"adapter module {name}: lora_A has rank {r}, config says r={configured_r}"
                )
            alpha = float(_pattern_value(alpha_pattern, name, self.config.get("lora_alpha", r)))
            scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
            self.modules[name] = LoraModule(name, a, b, scale, embedding)

    def match(self, layers: list[LayerSpec], checkpoint_keys: Iterable[str]) -> AdapterMatch:
        """Pair adapter modules with the base's tensors, by module path suffix.

        A module that is an analysed layer updates that layer's checkpoint tensor (for a
        tied lm_head: the embedding's). A module that is only a checkpoint tensor (not an
        analysed layer) still updates the layers that read the same tensor. A module that
        is neither means a wrong base model: an error.
        """
        by_name = {spec.name: spec for spec in layers}
        name_index = suffix_index(by_name)
        key_index = suffix_index(checkpoint_keys)
        keys_read = {spec.key for spec in layers}
        merges: dict[str, list[LoraModule]] = {}
        unanalysed: list[str] = []
        for name, module in self.modules.items():
            layer = match_by_suffix(name, name_index, min_parts=1)
            target_type: str | None
            if layer is not None:
                spec = by_name[layer]
                key, target_type = spec.key, spec.layer_type
            else:
                found = match_by_suffix(f"{name}.weight", key_index)
                if found is None:
                    raise PermanentModelError(
                        f"adapter module {name} matches no weight of the base model: "
                        "wrong base model?"
                    )
                key, target_type = found, EMBEDDING if module.embedding else None
                if key not in keys_read:
                    unanalysed.append(name)
                    continue
            merges.setdefault(key, []).append(dataclasses.replace(module, target_type=target_type))
        replaced: dict[str, torch.Tensor] = {}
        for name, tensor in self.replaced.items():
            layer = match_by_suffix(name, name_index, min_parts=1)
            if layer is not None:
                replaced[layer] = tensor
        return AdapterMatch(merges, replaced, unanalysed)


def _check_ranks(name: str, a: torch.Tensor, b: torch.Tensor, *, embedding: bool) -> None:
    """A bad adapter (PermanentModelError naming the module and both shapes) unless B @ A
    exists: A is (r, in[, kh, kw]), B is (out, r[, 1, 1]), the same r and as many dims."""
    if a.dim() >= 2 and a.dim() == b.dim() and a.shape[0] == b.shape[1]:
        return
    part_a, part_b = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    raise PermanentModelError(
        f"bad adapter: module {name} has {part_a} of shape {tuple(a.shape)} and {part_b} of "
        f"shape {tuple(b.shape)}: their ranks disagree ({part_a} dimension 0 must equal "
        f"{part_b} dimension 1)"
    )


def _transposed(module: LoraModule, *, fan_in_fan_out: bool) -> bool:
    """Whether the checkpoint stores this module's weight as (in x out), i.e. (B @ A)ᵀ."""
    target = module.target_type
    return (
        module.embedding
        or target in (EMBEDDING, CONV1D)
        or (target in (MATRIX, None) and fan_in_fan_out)
    )


def add_lora_(weight: torch.Tensor, module: LoraModule, *, fan_in_fan_out: bool) -> None:
    """weight += scale · B @ A (in the checkpoint's layout), in place, on weight's device.

    For Linear, Conv1D and Embedding this is one addmm: no full-size temporary, which
    matters for a 32000 x 4096 lm_head on a GPU. weight must be the caller's own copy.
    """
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
        raise PermanentModelError(
            f"adapter delta for {module.name} has shape {tuple(shape)}, the base weight "
            f"{tuple(weight.shape)}: wrong base model?"
        )
    if transposed:
        weight.addmm_(a.t(), b.t(), alpha=module.scale)  # (B @ A)ᵀ = Aᵀ @ Bᵀ
    else:
        weight.addmm_(b, a, alpha=module.scale)


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
    by B. A and B are small: they are moved to the device and computed in `dtype` there.
    """
    a = module.A.to(device=device, dtype=dtype)
    b = module.B.to(device=device, dtype=dtype)
    target = module.target_type
    if target == CONV2D or a.dim() == 4:
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
        raise PermanentModelError(
            f"adapter delta for {module.name} has shape {tuple(delta.shape)}, the base weight "
            f"{tuple(shape)}: wrong base model?"
        )
    return delta
