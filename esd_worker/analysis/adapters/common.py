"""What every adapter method shares: adapter_config.json, the record of an adapter, where its
updates go in the base checkpoint, and the layout rule of a stored weight."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from esd_worker.analysis.layers import CONV1D, EMBEDDING, MATRIX
from esd_worker.core.errors import PermanentModelError

ADAPTER_CONFIG = "adapter_config.json"

_U = TypeVar("_U", bound="WeightUpdate")


class WeightUpdate:
    """The update one adapter module makes to one base weight, applied in place.

    Subclasses are frozen dataclasses with (at least) `name` and `target_type`: the layer type
    of the module the update belongs to, set when the adapter is matched to the base model
    (it decides the layout of the weight the update sees). They hold the adapter's small
    tensors only; `apply_` computes on the weight's device and in its dtype.
    """

    name: str
    target_type: str | None
    embedding: bool = False  # an embedding update, matched to a checkpoint key only
    method: ClassVar[str] = "adapter"  # what to call the method in messages

    def apply_(self, weight: torch.Tensor, *, fan_in_fan_out: bool) -> None:
        raise NotImplementedError

    def targeted(self: _U, target_type: str | None) -> _U:
        return dataclasses.replace(self, target_type=target_type)  # type: ignore[type-var]

    def check_target(self) -> None:
        """Raise PermanentModelError when peft never applies this method to the target's type."""


@dataclass(frozen=True)
class AdapterInfo:
    """What result.json records about an adapter.

    peft_type names the method: adapter_config.json's peft_type, except DORA for a LoRA
    adapter with use_dora. r and lora_alpha where the method has them (LoHa and LoKr call
    their alpha `alpha`; AdaLoRA's r is its init_r, the rank its scaling divides by).
    """

    peft_type: str
    base_model: str | None
    r: int | None
    lora_alpha: float | None
    use_rslora: bool
    fan_in_fan_out: bool


@dataclass(frozen=True)
class AdapterMatch:
    """Where an adapter's updates go in the base checkpoint.

    merges: checkpoint key → the updates to apply to that tensor, in order (two when tied
    modules both carry one, in the model's order, as peft merges them); every layer read
    from the key gets them, as peft's in-place merge of a tied weight changes both modules.
    replaced: layer name → full weight saved with the adapter (modules_to_save). unanalysed:
    adapter modules whose base weight is not an analysed layer (e.g. an embedding without
    --include-embeddings).
    """

    merges: dict[str, list[WeightUpdate]]
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


def pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """peft.utils.other.get_pattern_key's rule: the first pattern that matches a dotted suffix
    of the module name (rank_pattern, alpha_pattern)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def stored_transposed(target_type: str | None, *, embedding: bool, fan_in_fan_out: bool) -> bool:
    """Whether the checkpoint stores the module's weight as (in x out).

    peft forces fan_in_fan_out on for Conv1D and off for Linear, whatever the config says;
    only a layer of unknown type (fallback discovery) follows the config. Embeddings store
    (num_embeddings x dim), which LoRA treats as (in x out)."""
    return (
        embedding
        or target_type in (EMBEDDING, CONV1D)
        or (target_type in (MATRIX, None) and fan_in_fan_out)
    )


def shape_error(name: str, got: tuple[int, ...], weight: torch.Tensor | tuple[int, ...]
                ) -> PermanentModelError:
    shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight)
    return PermanentModelError(
        f"adapter delta for {name} has shape {got}, the base weight {shape}: wrong base model?"
    )


def unsupported_target(update: WeightUpdate, types: tuple[str, ...]) -> None:
    """A PermanentModelError unless the update's target type is one peft gives the method
    (None: a checkpoint tensor that is no analysed layer, matched by name only)."""
    if update.target_type is not None and update.target_type not in (*types, MATRIX):
        raise PermanentModelError(
            f"adapter module {update.name} is a {update.method} update of a "
            f"{update.target_type} layer, which peft's {update.method} never adapts "
            f"(only {', '.join(types)}): wrong base model?"
        )
