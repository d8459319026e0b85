"""What a model's layer map is: the analysable weights (LayerSpec: a name, the key it is read
from, a type, a shape), the tensors skipped by rule, and how names join checkpoint keys.

Owns the layer types, the longest-suffix join of names to keys, the joining of components'
maps, and the map of a checkpoint without an architecture (every tensor by its shape, dtype
and name: esd_worker.analysis.accounting). Building the model from config.json and joining
its modules to the checkpoint are esd_worker.analysis.metamodel's and
esd_worker.analysis.modulemap's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from esd_worker.analysis.accounting import CONV2D, EMBEDDING, EXPERT, MATRIX, classify
from esd_worker.analysis.weights import Tensors
from esd_worker.core.errors import PermanentModelError

__all__ = ["CONV1D", "CONV2D", "EMBEDDING", "EXPERT", "LINEAR", "MATRIX", "LayerMap",
           "LayerSpec", "joined_maps", "map_by_names", "match_by_suffix", "suffix_index"]

log = logging.getLogger(__name__)

Beat = Callable[[], None]  # a sign of progress: the worker's heartbeat

LINEAR = "Linear"
CONV1D = "Conv1D"


@dataclass(frozen=True)
class LayerSpec:
    """One analysable weight: `name` as the model names the module, `key` in the checkpoint
    (`key[i]`: row i of a stored stack, esd_worker.analysis.stacks)."""

    name: str
    key: str
    layer_type: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerMap:
    """The layers, how they were found, and `skipped`: every other tensor of the checkpoint
    that a documented rule skips (key -> rule, esd_worker.analysis.accounting.RULES)."""

    layers: list[LayerSpec]
    discovery: str  # "architecture" or "fallback"
    architecture: str | None
    note: str = ""
    skipped: Mapping[str, str] = field(default_factory=dict)


def joined_maps(maps: Sequence[tuple[str, LayerMap]]) -> LayerMap:
    """One model's map from its components' (esd_worker.analysis.checkpoints): each layer's
    name and key under its component's prefix ("" for a plain model: its map as it is)."""
    if len(maps) == 1 and not maps[0][0]:
        return maps[0][1]
    layers = [dataclasses.replace(spec, name=prefix + spec.name, key=prefix + spec.key)
              for prefix, layer_map in maps for spec in layer_map.layers]
    skipped = {prefix + key: rule for prefix, layer_map in maps
               for key, rule in layer_map.skipped.items()}
    discovery = ("architecture" if all(m.discovery == "architecture" for _, m in maps)
                 else "fallback")
    architecture = "+".join(f"{prefix.rstrip('/') or 'model'}:{m.architecture or 'unknown'}"
                            for prefix, m in maps)
    note = "; ".join(f"{prefix}{m.note}" for prefix, m in maps if m.note)
    return LayerMap(layers, discovery, architecture, note, skipped)


def suffix_index(keys: Iterable[str]) -> dict[str, list[str]]:
    """Every dotted suffix of every key -> the keys that end with it."""
    index: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts)):
            index.setdefault(".".join(parts[i:]), []).append(key)
    return index


def match_by_suffix(name: str, index: dict[str, list[str]], *, min_parts: int = 2) -> str | None:
    """The one indexed key sharing the longest dotted suffix with `name`.

    Checkpoints and model classes disagree on prefixes ("model.", "bert.", "transformer.",
    "base_model.model."), never on the module path below them, so the longest common
    suffix is the robust join. Several keys sharing it are told apart by the sub-model they
    sit in: the one whose prefix shares the most parts with `name`'s (a VLM's
    `language_model.model.layers.0.…` for `model.language_model.layers.0.…`, not the
    `vision_tower`'s); a tie is no match, and so is one that needs to drop a numeric part
    (a block index) of `name`.
    """
    parts = name.split(".")
    for i in range(len(parts) - min_parts + 1):
        if i and parts[i - 1].isdigit():
            # Dropping a block index ("layers.5.") would pair block 5 with another block.
            return None
        hits = index.get(".".join(parts[i:]))
        if hits:
            return hits[0] if len(hits) == 1 else _by_sub_model(set(parts[:i]), hits,
                                                                len(parts) - i)
    return None


def _by_sub_model(prefix: set[str], hits: list[str], suffix_parts: int) -> str | None:
    """The hit whose own prefix shares the most parts with `prefix`, if it is the only one
    (and shares any)."""
    shared = [len(prefix & set(hit.split(".")[:-suffix_parts])) for hit in hits]
    best = max(shared)
    return hits[shared.index(best)] if best and shared.count(best) == 1 else None


def map_by_names(checkpoint: Tensors, *, include_embeddings: bool, reason: str) -> LayerMap:
    """The map of a checkpoint without an architecture: every tensor by its shape, dtype and
    name (esd_worker.analysis.accounting.classify); `reason` why, logged and noted."""
    layers: list[LayerSpec] = []
    skipped: dict[str, str] = {}
    for key in checkpoint.keys():  # noqa: SIM118 - Tensors is not a Mapping
        what = classify(checkpoint, key, name=key, include_embeddings=include_embeddings,
                        stack=False)
        if what.rule is not None:
            skipped[key] = what.rule
        layers += [LayerSpec(*row) for row in what.rows]
    if not layers:
        raise PermanentModelError("no analysable 2-D weights found in the checkpoint")
    note = f"{reason}: tensors analysed by their names and shapes"
    log.warning("%s", note)
    return LayerMap(layers, "fallback", None, note, skipped)
