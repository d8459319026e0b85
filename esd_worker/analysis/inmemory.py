"""A model held in memory (a torch module or a state dict) as the analysis' weights.

Owns what a model in a notebook is to the analysis: its tensors as a Checkpoint
(`Checkpoint.of_tensors`, nothing copied up front), its layer map from its own modules (a
module) or from the tensor names (a state dict), and the ResolvedModel that names it in the
result. The analysis itself is esd_worker.analysis.analyze's, the same as for a model on
disk, so both give the same numbers. Never modifies the model: the analysis copies a
weight before it merges or casts it in place.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from esd_worker.analysis.layers import LayerMap, map_by_names
from esd_worker.analysis.modulemap import map_modules
from esd_worker.analysis.weights import Checkpoint, Tensors
from esd_worker.core.errors import UsageError
from esd_worker.fetch.resolve import ResolvedModel

MEMORY_SOURCE = "memory"


@dataclass(frozen=True)
class HeldWeights:
    """The weights of a model in memory: its tensors and how its layers are found.

    module: the torch module (None for a bare state dict). name: what the result calls it.
    """

    tensors: Mapping[str, torch.Tensor]
    module: torch.nn.Module | None
    name: str

    def checkpoint(self) -> Checkpoint:
        return Checkpoint.of_tensors(self.tensors, name=self.name)

    def layer_map(self, checkpoint: Tensors, *, include_embeddings: bool) -> LayerMap:
        if self.module is None:
            return map_by_names(checkpoint, include_embeddings=include_embeddings,
                                reason="a state dict without its model")
        return map_modules(self.module, checkpoint, include_embeddings=include_embeddings)

    def resolved(self, folder: Path) -> ResolvedModel:
        """The model as the result names it: no revision, its tensors' bytes as its size;
        `folder` is an empty one (no config, no adapter: nothing is read from it)."""
        size = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return ResolvedModel(ref=self.name, model_id=self.name, revision=None,
                             resolved_revision=None, directory=folder, source=MEMORY_SOURCE,
                             size_bytes=size)


def hold(model: Any, *, name: str | None = None) -> HeldWeights:
    """A torch module or a state dict ({name: tensor}) as HeldWeights; anything else, or a
    PEFT model (its LoRA modules would be read as layers of their own), is a UsageError."""
    if hasattr(model, "peft_config"):
        raise UsageError(
            "a PEFT model in memory: pass its base model and the adapter's folder or hub id "
            "(adapter=...), so the LoRA updates are merged into the base's layers"
        )
    if isinstance(model, torch.nn.Module):
        return HeldWeights(unaliased(model.state_dict()), model, name or f"<in memory: "
                           f"{type(model).__name__}>")
    if isinstance(model, Mapping) and model and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        return HeldWeights(unaliased(model), None, name or "<in memory: state dict>")
    raise UsageError(
        f"cannot analyse a {type(model).__name__}: pass a torch.nn.Module, a state dict "
        "({name: tensor}), a local folder or a hub id"
    )


def unaliased(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors less those that are another name of one before them (a tied weight: a
    state dict lists GPT-2's lm_head and its word embeddings, one tensor), as
    save_pretrained leaves them out: the layer map then finds a tied module's weight under
    its source's name, as for the model's saved files."""
    seen: set[tuple[Any, ...]] = set()
    kept: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        same = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                tensor.stride())
        if tensor.numel() and same in seen:
            continue
        seen.add(same)
        kept[key] = tensor
    return kept


def empty_folder() -> tempfile.TemporaryDirectory[str]:
    """The folder a held model's ResolvedModel names (nothing is ever read from it)."""
    return tempfile.TemporaryDirectory(prefix="esd-held-")
