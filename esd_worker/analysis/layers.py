"""Which checkpoint tensors are analysable layers, and of what type (meta-device model); and
that every weight matrix the checkpoint holds is accounted for (analysed, or a weight of the
model that is not analysed), else the model fails (UnexplainedWeights)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook

from esd_worker.analysis.weights import Tensors
from esd_worker.core.errors import PermanentModelError

log = logging.getLogger(__name__)

Beat = Callable[[], None]  # a sign of progress: the worker's heartbeat

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


def joined_maps(maps: Sequence[tuple[str, LayerMap]]) -> LayerMap:
    """One model's map from its components' (esd_worker.analysis.checkpoints): each layer's
    name and key under its component's prefix ("" for a plain model: its map as it is)."""
    if len(maps) == 1 and not maps[0][0]:
        return maps[0][1]
    layers = [dataclasses.replace(spec, name=prefix + spec.name, key=prefix + spec.key)
              for prefix, layer_map in maps for spec in layer_map.layers]
    discovery = ("architecture" if all(m.discovery == "architecture" for _, m in maps)
                 else "fallback")
    architecture = "+".join(f"{prefix.rstrip('/') or 'model'}:{m.architecture or 'unknown'}"
                            for prefix, m in maps)
    note = "; ".join(f"{prefix}{m.note}" for prefix, m in maps if m.note)
    return LayerMap(layers, discovery, architecture, note)


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


def _meta_config(directory: Path, *, trust_remote_code: bool) -> tuple[Any, list[Any]] | None:
    """config.json as transformers reads it and the classes to build it with, in order: those
    its `architectures` name, then the auto classes (_auto_classes); None when there is no
    config.json or transformers cannot read it."""
    with _TRANSFORMERS:
        import transformers

        if not (directory / "config.json").is_file():
            return None
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(directory), trust_remote_code=trust_remote_code
            )
        except Exception as e:  # any config transformers cannot read: fallback
            text = str(e).strip()
            first_line = text.splitlines()[0] if text else type(e).__name__
            log.warning("config.json not understood by transformers (%s); using fallback",
                        first_line)
            return None
        classes: list[Any] = [
            cls for arch in (config.architectures or [])
            if (cls := getattr(transformers, arch, None))
        ]
        return config, [*classes, *_auto_classes(transformers)]


def _auto_classes(transformers: Any) -> tuple[Any, ...]:
    """The auto classes tried after config.json's architectures: the causal LM, the bare
    model, and last the pretraining model (with its heads: a checkpoint saved from
    pretraining, as BERT's were, holds them whatever class config.json names)."""
    return (transformers.AutoModelForCausalLM, transformers.AutoModel,
            transformers.AutoModelForPreTraining)


def _beat_on_registration(beat: Beat, *_: object) -> None:
    """A module-registration hook that beats and returns None: anything else it returned
    would replace the module being registered."""
    beat()


def _build_meta_model(cls: Any, config: Any, *, trust_remote_code: bool,
                      beat: Beat | None = None) -> torch.nn.Module | None:
    """`cls` built from `config` with no weights, or None when it cannot be built. `beat` is
    called as each submodule is registered: building a model of hundreds of blocks takes
    long enough for a watchdog to take the worker for hung."""
    with _TRANSFORMERS:
        import transformers
        from accelerate import init_empty_weights

        autos = _auto_classes(transformers)
        # torch's global module-registration hook is the one place every block and
        # projection passes through while transformers builds the model, whatever the
        # architecture (a process-wide hook: removed as soon as the model is built).
        hook = None if beat is None else register_module_module_registration_hook(
            partial(_beat_on_registration, beat))
        try:
            with init_empty_weights(), contextlib.redirect_stderr(io.StringIO()):
                if cls in autos:
                    return cls.from_config(config, trust_remote_code=trust_remote_code)
                return cls._from_config(config)
        except Exception as e:  # any class that cannot be built: the caller tries the next
            log.debug("cannot build %s on meta: %s", getattr(cls, "__name__", cls), e)
            return None
        finally:
            if hook is not None:
                hook.remove()


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
    checkpoint: Tensors,
    *,
    include_embeddings: bool = False,
    trust_remote_code: bool = False,
    beat: Beat | None = None,
) -> LayerMap:
    """Map the model's Linear/Conv1D/Conv2d (and optionally Embedding) weights to checkpoint
    keys; without an architecture transformers can build, fall back to tensor names.

    The model is the first class built from config.json (its architectures, then the auto
    classes) that accounts for every matrix the checkpoint holds (map_modules), and the note
    says when that is not the first class built; when none does, the first one's
    UnexplainedWeights is the model's failure. `beat` is called as discovery goes
    (esd_worker.analysis.analyze: the worker's heartbeat)."""
    config, classes = _meta_config(directory, trust_remote_code=trust_remote_code) or (None, [])
    unexplained: UnexplainedWeights | None = None
    for cls in classes:
        model = _build_meta_model(cls, config, trust_remote_code=trust_remote_code, beat=beat)
        if model is None:
            continue
        try:
            found = map_modules(model, checkpoint, include_embeddings=include_embeddings,
                                beat=beat)
        except UnexplainedWeights as e:
            log.info("%s", e)
            unexplained = unexplained or e
            continue
        if unexplained is None:
            return found
        instead = (f"{unexplained.architecture} does not account for "
                   f"{unexplained.count} of the checkpoint (e.g. {unexplained.keys[0]}); "
                   f"{found.architecture} does")
        log.warning("%s", instead)
        return dataclasses.replace(found, note="; ".join(n for n in (instead, found.note) if n))
    if unexplained is not None:
        raise unexplained
    return map_by_names(
        checkpoint, include_embeddings=include_embeddings,
        reason="architecture unknown to transformers",
    )


def map_modules(model: torch.nn.Module, checkpoint: Tensors, *,
                include_embeddings: bool = False, beat: Beat | None = None) -> LayerMap:
    """The layer map of a model's modules (a meta model built from its config, or a model
    held in memory): each Linear/Conv1D/Conv2d (and optionally Embedding) module whose
    weight the checkpoint holds; none matched: the fallback by tensor names.

    Ends with the check that every matrix the checkpoint holds is accounted for
    (UnexplainedWeights otherwise): a config that says fewer blocks than are stored must not
    leave the rest out of a model marked done. `beat`: called once a module."""
    index = suffix_index(checkpoint.keys())
    tied = _tied_sources(model)
    layers: list[LayerSpec] = []
    unmatched: list[str] = []
    for name, module in model.named_modules():
        if beat is not None:
            beat()
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
    used = {spec.key for spec in layers}
    unexplained = _unexplained(model, checkpoint, index, used, beat)
    if unexplained:
        raise UnexplainedWeights(arch, unexplained)
    notes: list[str] = []
    if unmatched:
        notes.append(
            f"{len(unmatched)} module weights not in the checkpoint (e.g. {unmatched[0]})"
        )
    # Accounted for, yet not analysed: weights of the model that no Linear/Conv module holds
    # (transformers 5 fuses a MoE's experts into 3-D parameters), or a tied head's copy.
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


class UnexplainedWeights(PermanentModelError):
    """Weight matrices the checkpoint holds that the model built from config.json does not
    account for (a config that says fewer blocks than are stored, a stray matrix): the
    model fails rather than being marked done without them."""

    def __init__(self, architecture: str, keys: Sequence[str]) -> None:
        self.architecture, self.keys = architecture, list(keys)
        shown = ", ".join(self.keys[:_SHOWN])
        more = f" and {len(self.keys) - _SHOWN} more" if len(self.keys) > _SHOWN else ""
        n = len(self.keys)
        self.count = "1 weight matrix" if n == 1 else f"{n} weight matrices"
        super().__init__(
            f"{self.count} in the checkpoint not part of {architecture} as config.json describes "
            f"it ({shown}{more}): config.json does not describe this checkpoint (e.g. fewer "
            "layers than stored), so not every layer could be analysed"
        )


_SHOWN = 3  # unexplained tensors named in the error


def _is_matrix(checkpoint: Tensors, key: str) -> bool:
    """A weight matrix by the analysis' definition (matrix_keys), whatever its name says."""
    return key.endswith(".weight") and len(checkpoint.shape(key)) in (2, 4)


def _unexplained(model: torch.nn.Module, checkpoint: Tensors, index: dict[str, list[str]],
                 used: set[str], beat: Beat | None) -> list[str]:
    """The checkpoint's weight matrices, in its order, that `model` does not account for:
    neither analysed (`used`), nor one of its parameters or buffers under the longest-suffix
    join of the layer map (embeddings, a tied head's copy, any other module's weight), nor
    what transformers itself turns into one of them when it loads the checkpoint (renamed
    legacy names, a MoE's per-expert matrices fused into one parameter), nor a key the
    model class tells transformers to ignore (`_keys_to_ignore_on_load_unexpected`, e.g.
    multi-token-prediction blocks stored beside the model)."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    accounted = set(used)
    for name in names:
        if beat is not None:
            beat()
        key = match_by_suffix(name, index)
        if key is not None:
            accounted.add(key)
    left = [key for key in checkpoint.keys()  # noqa: SIM118 - Checkpoint is not a Mapping
            if key not in accounted and _is_matrix(checkpoint, key)]
    if not left:
        return []
    loads = _loaded_as(model, set(names))
    ignored = _ignored_on_load(model)
    unexplained = []
    for key in left:  # a MoE's experts: tens of thousands of keys
        if beat is not None:
            beat()
        if not loads(key) and not ignored(key):
            unexplained.append(key)
    return unexplained


def _loaded_as(model: torch.nn.Module, names: set[str]) -> Callable[[str], bool]:
    """Whether transformers, loading a checkpoint key into `model`, puts it into one of its
    parameters or buffers (`names`): the renamings and converters of the model's conversion
    mapping (transformers.conversion_mapping.get_model_conversion_mapping, the list peft
    uses too). The key and its suffixes that keep every block index are tried, as the layer
    map's join does; a transformers without the mapping loads nothing this way."""
    try:
        with _TRANSFORMERS:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                WeightConverter,
                WeightRenaming,
                rename_source_key,
            )

            # A module that is no PreTrainedModel (a model in memory) has no mapping: [].
            transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    except Exception as e:  # no mapping to consult: only the model's own names count
        log.debug("no weight conversion mapping: %s", e)
        return lambda key: False
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None) or None
    present = dict.fromkeys(names, True)

    def loads(key: str) -> bool:
        parts = key.split(".")
        for i in range(len(parts) - 1):
            if i and parts[i - 1].isdigit():
                return False  # never across a block index (match_by_suffix's rule)
            try:
                renamed, _ = rename_source_key(".".join(parts[i:]), renamings, converters,
                                               prefix, present)
            except Exception:  # a transform that does not take this key: not loaded
                return False
            if renamed in present:
                return True
        return False

    return loads


def _ignored_on_load(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether the model class tells transformers that a checkpoint key is expected and not
    loaded (`_keys_to_ignore_on_load_unexpected`, regular expressions searched in the key,
    as transformers does, with or without the base model's prefix)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    try:
        regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    except (re.error, TypeError):
        regex = None
    if regex is None:
        return lambda key: False
    prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."

    def ignored(key: str) -> bool:
        return regex.search(key) is not None or regex.search(key.removeprefix(prefix)) is not None

    return ignored


def matrix_keys(checkpoint: Tensors, *, include_embeddings: bool) -> list[str]:
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


def map_by_names(checkpoint: Tensors, *, include_embeddings: bool, reason: str) -> LayerMap:
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
