"""Which checkpoint tensors are analysable layers, and of what type (meta-device model, no weights)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from esd_worker.errors import PermanentModelError
from esd_worker.weights import Checkpoint

log = logging.getLogger(__name__)

LINEAR = "Linear"
CONV1D = "Conv1D"
CONV2D = "Conv2d"
EMBEDDING = "Embedding"
MATRIX = "Matrix"  # a 2-D weight found without an architecture (fallback discovery)

_FALLBACK_SKIP = re.compile(r"(embed|wte|wpe|norm|ln_|\bln\d|position|rotary|bias)", re.IGNORECASE)


@dataclass(frozen=True)
class LayerSpec:
    """One analysable weight: `name` as the model names the module, `key` in the checkpoint."""

    name: str
    key: str
    layer_type: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerMap:
    layers: list[LayerSpec]
    discovery: str  # "architecture" or "fallback"
    architecture: str | None
    note: str = ""


def suffix_index(keys: Iterable[str]) -> dict[str, list[str]]:
    """Every dotted suffix of every key -> the keys that end with it."""
    index: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts)):
            index.setdefault(".".join(parts[i:]), []).append(key)
    return index


def match_by_suffix(name: str, index: dict[str, list[str]], *, min_parts: int = 2) -> str | None:
    """The one indexed key sharing the longest dotted suffix with `name`, if unambiguous.

    Checkpoints and model classes disagree on prefixes ("model.", "bert.", "transformer.",
    "base_model.model."), never on the module path below them, so the longest common
    suffix is the robust join; an ambiguous match is no match.
    """
    parts = name.split(".")
    for i in range(len(parts) - min_parts + 1):
        hits = index.get(".".join(parts[i:]))
        if hits:
            return hits[0] if len(hits) == 1 else None
    return None


def _module_type(module: torch.nn.Module) -> str | None:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return CONV1D
    if isinstance(module, torch.nn.Linear):
        return LINEAR
    if isinstance(module, torch.nn.Conv2d):
        return CONV2D
    if isinstance(module, torch.nn.Embedding):
        return EMBEDDING
    return None


def _build_meta_model(directory: Path, *, trust_remote_code: bool) -> torch.nn.Module | None:
    """The model's architecture with no weights, or None when transformers does not know it."""
    import transformers
    from accelerate import init_empty_weights

    if not (directory / "config.json").is_file():
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(directory), trust_remote_code=trust_remote_code
        )
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        log.warning("config.json not understood by transformers (%s); using fallback", e)
        return None
    classes: list[type] = [
        cls for arch in (config.architectures or []) if (cls := getattr(transformers, arch, None))
    ]
    autos = [transformers.AutoModelForCausalLM, transformers.AutoModel]
    quiet = io.StringIO()
    for cls in [*classes, *autos]:
        try:
            with init_empty_weights(), contextlib.redirect_stderr(quiet):
                if cls in autos:
                    model = cls.from_config(config, trust_remote_code=trust_remote_code)
                else:
                    model = cls._from_config(config)
            return model  # type: ignore[no-any-return]
        except (ValueError, KeyError, TypeError, AttributeError, ImportError, OSError) as e:
            log.debug("cannot build %s on meta: %s", getattr(cls, "__name__", cls), e)
    return None


def _tied_sources(model: torch.nn.Module) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(
        model, "_tied_weights_keys", None
    )
    return dict(tied) if isinstance(tied, dict) else {}


def discover_layers(
    directory: Path,
    checkpoint: Checkpoint,
    *,
    include_embeddings: bool = False,
    trust_remote_code: bool = False,
) -> LayerMap:
    """Map the model's Linear/Conv1D/Conv2d (and optionally Embedding) weights to checkpoint keys."""
    model = _build_meta_model(directory, trust_remote_code=trust_remote_code)
    if model is None:
        return _fallback(checkpoint, include_embeddings=include_embeddings)
    index = suffix_index(checkpoint.keys())
    tied = _tied_sources(model)
    layers: list[LayerSpec] = []
    unmatched: list[str] = []
    for name, module in model.named_modules():
        layer_type = _module_type(module)
        if layer_type is None or (layer_type == EMBEDDING and not include_embeddings):
            continue
        param = f"{name}.weight"
        key = match_by_suffix(param, index)
        if key is None and param in tied:
            key = match_by_suffix(tied[param], index)
        if key is None:
            unmatched.append(param)
            continue
        layers.append(LayerSpec(name, key, layer_type, checkpoint.shape(key)))
    arch = type(model).__name__
    if not layers:
        log.warning("%s: no layer matched a checkpoint tensor; using fallback", arch)
        return _fallback(checkpoint, include_embeddings=include_embeddings)
    note = ""
    if unmatched:
        note = f"{len(unmatched)} module weights not in the checkpoint (e.g. {unmatched[0]})"
        log.warning("%s", note)
    return LayerMap(layers, "architecture", arch, note)


def _fallback(checkpoint: Checkpoint, *, include_embeddings: bool) -> LayerMap:
    layers = []
    for key in checkpoint.keys():
        shape = checkpoint.shape(key)
        if not key.endswith(".weight") or len(shape) not in (2, 4):
            continue
        if _FALLBACK_SKIP.search(key.removesuffix(".weight")) and not (
            include_embeddings and "embed" in key.lower()
        ):
            continue
        layer_type = CONV2D if len(shape) == 4 else MATRIX
        layers.append(LayerSpec(key.removesuffix(".weight"), key, layer_type, shape))
    if not layers:
        raise PermanentModelError("no analysable 2-D weights found in the checkpoint")
    note = "architecture unknown to transformers: analysed 2-D/4-D *.weight tensors by name"
    log.warning("%s", note)
    return LayerMap(layers, "fallback", None, note)
