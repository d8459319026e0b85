"""Which checkpoint tensors are analysable layers, and of what type (meta-device model)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.errors import PermanentModelError

log = logging.getLogger(__name__)

LINEAR = "Linear"
CONV1D = "Conv1D"
CONV2D = "Conv2d"
EMBEDDING = "Embedding"
MATRIX = "Matrix"  # a 2-D weight found without an architecture (fallback discovery)

_FALLBACK_SKIP = re.compile(
    r"(embed|wte|wpe|norm|ln_|\bln\d|position|rotary|bias)", re.IGNORECASE
)
_EMBEDDING_NAME = re.compile(r"(embed|wte|wpe)", re.IGNORECASE)


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
    suffix is the robust join; an ambiguous match is no match, and so is one that needs
    to drop a numeric part (a block index) of `name`.
    """
    parts = name.split(".")
    for i in range(len(parts) - min_parts + 1):
        if i and parts[i - 1].isdigit():
            # Dropping a block index ("layers.5.") would pair block 5 with another block.
            return None
        hits = index.get(".".join(parts[i:]))
        if hits:
            return hits[0] if len(hits) == 1 else None
    return None


# transformers is imported lazily, module by module: two threads importing it at once can
# see it half initialised ("module 'transformers' has no attribute 'AutoConfig'", seen with
# warm_up running beside a discovery), and a discovery would silently fall back. Whoever
# imports or uses it to build a model holds this lock.
_TRANSFORMERS = threading.RLock()


def warm_up(*, cuda: bool) -> None:
    """Import what layer discovery needs (transformers, its model base class: ~3 s on a CPU,
    more on a cold image) and start CUDA, so that a long-lived worker pays this while its
    first model downloads, not after. Safe in a background thread."""
    try:
        with _TRANSFORMERS:
            import transformers.modeling_utils  # noqa: F401
            from accelerate import init_empty_weights  # noqa: F401
            from transformers.pytorch_utils import Conv1D  # noqa: F401
        if cuda and torch.cuda.is_available():
            torch.cuda.init()
    except Exception as e:  # the model that needs it will report the problem
        log.debug("warm-up: %s", e)


def _module_type(module: torch.nn.Module) -> str | None:
    with _TRANSFORMERS:
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
    with _TRANSFORMERS:
        return _build_meta_model_locked(directory, trust_remote_code=trust_remote_code)


def _build_meta_model_locked(directory: Path, *, trust_remote_code: bool
                             ) -> torch.nn.Module | None:
    import transformers
    from accelerate import init_empty_weights

    if not (directory / "config.json").is_file():
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(directory), trust_remote_code=trust_remote_code
        )
    except Exception as e:  # any config transformers cannot read: fallback
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("config.json not understood by transformers (%s); using fallback", first_line)
        return None
    classes: list[Any] = [
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
            return model
        except Exception as e:  # any class that cannot be built: try the next
            log.debug("cannot build %s on meta: %s", getattr(cls, "__name__", cls), e)
    return None


def _tied_sources(model: torch.nn.Module) -> dict[str, str]:
    """{tied parameter: the parameter it shares}, as transformers ties them for this config.

    `all_tied_weights_keys` (transformers 5) already honours tie_word_embeddings; the class
    attribute `_tied_weights_keys` lists what *may* be tied, so it only counts when the
    config ties embeddings (an untied lm_head missing from a checkpoint is not the embedding).
    """
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:
        config = getattr(model, "config", None)
        tie = getattr(config, "tie_word_embeddings", False)
        tied = getattr(model, "_tied_weights_keys", None) if tie else None
    return dict(tied) if isinstance(tied, dict) else {}


def discover_layers(
    directory: Path,
    checkpoint: Checkpoint,
    *,
    include_embeddings: bool = False,
    trust_remote_code: bool = False,
) -> LayerMap:
    """Map the model's Linear/Conv1D/Conv2d (and optionally Embedding) weights to checkpoint
    keys; without an architecture transformers can build, fall back to tensor names."""
    model = _build_meta_model(directory, trust_remote_code=trust_remote_code)
    if model is None:
        return map_by_names(
            checkpoint, include_embeddings=include_embeddings,
            reason="architecture unknown to transformers",
        )
    return map_modules(model, checkpoint, include_embeddings=include_embeddings)


def map_modules(model: torch.nn.Module, checkpoint: Checkpoint, *,
                include_embeddings: bool = False) -> LayerMap:
    """The layer map of a model's modules (a meta model built from its config, or a model
    held in memory): each Linear/Conv1D/Conv2d (and optionally Embedding) module whose
    weight the checkpoint holds; none matched: the fallback by tensor names."""
    index = suffix_index(checkpoint.keys())
    tied = _tied_sources(model)
    layers: list[LayerSpec] = []
    unmatched: list[str] = []
    for name, module in model.named_modules():
        layer_type = _module_type(module)
        if layer_type is None or (layer_type == EMBEDDING and not include_embeddings):
            continue
        param = f"{name}.weight"
        # A tied weight is its source's, as transformers loads it, even when the checkpoint
        # also holds a copy under the tied name (torch.save'd state dicts do).
        key = match_by_suffix(tied[param], index) if param in tied else None
        key = key or match_by_suffix(param, index)
        if key is None:
            unmatched.append(param)
            continue
        layers.append(LayerSpec(name, key, layer_type, checkpoint.shape(key)))
    arch = type(model).__name__
    if not layers:
        return map_by_names(
            checkpoint, include_embeddings=include_embeddings,
            reason=f"no {arch} layer matched a checkpoint tensor",
        )
    notes: list[str] = []
    if unmatched:
        notes.append(
            f"{len(unmatched)} module weights not in the checkpoint (e.g. {unmatched[0]})"
        )
    used = {spec.key for spec in layers}
    left = [
        key for key in matrix_keys(checkpoint, include_embeddings=include_embeddings)
        if key not in used
    ]
    if left:
        notes.append(
            f"{len(left)} 2-D/4-D checkpoint weights belong to no Linear/Conv1D/Conv2d module "
            f"of {arch} and were not analysed (e.g. {left[0]})"
        )
    for note in notes:
        log.warning("%s", note)
    return LayerMap(layers, "architecture", arch, "; ".join(notes))


def matrix_keys(checkpoint: Checkpoint, *, include_embeddings: bool) -> list[str]:
    """Checkpoint keys that look like analysable weights by name and shape alone."""
    keys = []
    for key in checkpoint.keys():  # noqa: SIM118 - Checkpoint is not a Mapping
        if not key.endswith(".weight") or len(checkpoint.shape(key)) not in (2, 4):
            continue
        stem = key.removesuffix(".weight")
        embedding = include_embeddings and _EMBEDDING_NAME.search(stem)
        if _FALLBACK_SKIP.search(stem) and not embedding:
            continue
        keys.append(key)
    return keys


def map_by_names(checkpoint: Checkpoint, *, include_embeddings: bool, reason: str) -> LayerMap:
    """The fallback map: 2-D/4-D `*.weight` tensors by name and shape, `reason` why logged."""
    layers = []
    for key in matrix_keys(checkpoint, include_embeddings=include_embeddings):
        shape = checkpoint.shape(key)
        if len(shape) == 4:
            layer_type = CONV2D
        elif _EMBEDDING_NAME.search(key):
            layer_type = EMBEDDING
        else:
            layer_type = MATRIX
        layers.append(LayerSpec(key.removesuffix(".weight"), key, layer_type, shape))
    if not layers:
        raise PermanentModelError("no analysable 2-D weights found in the checkpoint")
    skipped = "norms" if include_embeddings else "embeddings and norms"
    note = f"{reason}: analysed 2-D/4-D *.weight tensors by name, skipping {skipped}"
    log.warning("%s", note)
    return LayerMap(layers, "fallback", None, note)
