"""A model's modules joined to its checkpoint: which stored tensor each Linear, Conv1D,
Conv2d and Embedding weight is, and what every other stored tensor is.

Owns the join (the longest dotted suffix, then transformers' own checkpoint-key conversion,
which renames legacy keys and fuses a MoE's per-expert matrices on load), tied weights, the
keys a class ignores on load, and how well a class explains a checkpoint (Join.score). The
checkpoint is the truth: a tensor the class does not hold is still in the map, by its shape
and name (esd_worker.analysis.accounting.classify), and noted. Building the model is
esd_worker.analysis.metamodel's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from esd_worker.analysis.accounting import CONV2D, EMBEDDING, classify
from esd_worker.analysis.hflock import TRANSFORMERS as _TRANSFORMERS
from esd_worker.analysis.layers import (
    CONV1D,
    LINEAR,
    Beat,
    LayerMap,
    LayerSpec,
    map_by_names,
    match_by_suffix,
    suffix_index,
)
from esd_worker.analysis.weights import Tensors

log = logging.getLogger(__name__)

_CONV_OTHER = "conv"  # an nn.Conv1d/Conv3d/transposed convolution: no matrix ESD convention


@dataclass(frozen=True)
class Join:
    """A class's layer map of a checkpoint and how well the class explains it: `outside`,
    stored matrices no parameter of the class is (analysed by name); `borrowed`, layers the
    checkpoint stores only under another name (a tied head of a class config.json does not
    name) plus keys the class ignores on load. Lower is better; perfect is (0, 0)."""

    layer_map: LayerMap
    outside: int
    borrowed: int

    @property
    def score(self) -> tuple[int, int]:
        return (self.outside, self.borrowed)

    @property
    def perfect(self) -> bool:
        return self.score == (0, 0)


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
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return _CONV_OTHER
    return None


def map_modules(model: torch.nn.Module, checkpoint: Tensors, *,
                include_embeddings: bool = False, beat: Beat | None = None) -> LayerMap:
    """The layer map of a model's modules (a model held in memory, or one built on meta);
    a model none of whose modules is stored: the map by names."""
    found = join_model(model, checkpoint, include_embeddings=include_embeddings, beat=beat,
                       named=True)
    if found is None:
        return map_by_names(checkpoint, include_embeddings=include_embeddings,
                            reason=f"no {type(model).__name__} layer matched a checkpoint tensor")
    return found.layer_map


def join_model(model: torch.nn.Module, checkpoint: Tensors, *, include_embeddings: bool,
               beat: Beat | None, named: bool) -> Join | None:
    """The model's layers in module order, then every stored tensor no typed module holds,
    in checkpoint order (classify); None when no stored key is any parameter of the model.
    `named`: the class is one config.json names (its tied heads are its own)."""
    keys = checkpoint.keys()
    index = suffix_index(keys)
    params = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    params |= {name: tuple(b.shape) for name, b in model.named_buffers(remove_duplicate=False)}
    joined: dict[str, str] = {}  # stored key -> the model's parameter it is
    for name in params:
        if beat is not None:
            beat()
        key = match_by_suffix(name, index)
        if key is not None:
            joined.setdefault(key, name)
    # A parameter's own stored key: the name join, whatever the stored shape (a packed or
    # flattened weight is the module's, and its row says what is wrong with it), then
    # transformers' conversion where the shapes agree (a fused MoE parameter is joined by
    # many keys of another shape: those are matrices of their own).
    own = {name: key for key, name in joined.items()}
    renamed = _renamer(model, set(params))
    for key in keys:
        if key not in joined and (target := renamed(key)) is not None:
            joined[key] = target
            if params.get(target) == checkpoint.shape(key):
                own.setdefault(target, key)
    tied = _tied_sources(model)
    layers: list[LayerSpec] = []
    skipped: dict[str, str] = {}
    unmatched: list[str] = []
    borrowed = 0
    for name, module in model.named_modules():
        if beat is not None:
            beat()
        layer_type = _module_type(module)
        param = f"{name}.weight"
        key = own.get(param)
        if layer_type is None or (key is None and param not in tied):
            if layer_type is not None and layer_type != _CONV_OTHER:
                unmatched.append(param)
            continue
        if layer_type == _CONV_OTHER:
            if key is not None:
                skipped[key] = "conv"
            continue
        if param in tied:
            # A tied weight is its source's, as transformers loads it, even when the
            # checkpoint also holds a copy under the tied name (torch.save'd state dicts);
            # a stored weight that differs from its source is its own, as transformers then
            # does not tie them.
            source = own.get(tied[param]) or match_by_suffix(tied[param], index)
            if source is not None and (key is None or _same(checkpoint, key, source)):
                if key is not None and key != source:
                    skipped[key] = "tied_copy"
                elif key is None and not named:
                    borrowed += 1
                key = source
        if key is None:
            unmatched.append(param)
            continue
        if layer_type == EMBEDDING and not include_embeddings:
            skipped.setdefault(key, "embedding")
            continue
        layers.append(LayerSpec(name, key, layer_type, checkpoint.shape(key)))
    if not joined:
        return None
    used = {spec.key for spec in layers}
    ignored = _ignored_on_load(model)
    experts = _expert_counts(model)
    outside: list[str] = []
    for key in keys:
        if key in used or key in skipped:
            continue
        param_name = joined.get(key)
        if param_name is None and ignored(key):
            skipped[key] = "ignored_on_load"
            borrowed += 0 if named else 1  # the named class's own rule, not a misfit
            continue
        conv = param_name is not None and _in_conv(model, param_name)
        if conv and len(checkpoint.shape(key)) in (3, 5):
            skipped[key] = "conv"  # a convolution's kernel, whatever its name
            continue
        same = param_name is not None and params.get(param_name) == checkpoint.shape(key)
        what = classify(checkpoint, key, name=param_name if same and param_name else key,
                        include_embeddings=include_embeddings,
                        stack=not conv and checkpoint.shape(key)[:1] in experts)
        if what.rule is not None:
            skipped[key] = what.rule
        layers += [LayerSpec(*row) for row in what.rows]
        if what.rows and param_name is None:
            outside.append(key)
    used = {spec.key for spec in layers}
    skipped = {key: rule for key, rule in skipped.items() if key not in used}
    arch = type(model).__name__
    notes = []
    if outside:
        notes.append(f"{len(outside)} stored matrices are no parameter of {arch}: analysed "
                     f"under their checkpoint names (e.g. {outside[0]})")
    if unmatched:
        notes.append(f"{len(unmatched)} module weights not in the checkpoint "
                     f"(e.g. {unmatched[0]})")
    for note in notes:
        log.info("%s", note)
    return Join(LayerMap(layers, "architecture", arch, "; ".join(notes), skipped),
                len(outside), borrowed)


def _same(checkpoint: Tensors, key: str, other: str) -> bool:
    """Whether two stored tensors are the same values (a tied weight's stored copy)."""
    if key == other:
        return True
    if checkpoint.shape(key) != checkpoint.shape(other):
        return False
    return bool(torch.equal(checkpoint.read(key), checkpoint.read(other)))


def _expert_counts(model: torch.nn.Module) -> set[tuple[int]]:
    """The expert counts config.json gives (a 3-D tensor whose first axis is one of them is a
    stack of experts; XLNet's (d_model, heads, d_head) projections are not)."""
    config = getattr(model, "config", None)
    configs = [config, *(getattr(config, f, None) for f in ("text_config", "language_config"))]
    counts = {getattr(c, name, None) for c in configs if c is not None for name in (
        "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")}
    return {(n,) for n in counts if isinstance(n, int) and n > 1}


def _in_conv(model: torch.nn.Module, name: str) -> bool:
    """Whether a parameter belongs to a convolution (its module or one above it): a 3-D
    weight there is a kernel, not a stack of matrices."""
    parts = name.split(".")[:-1]
    module: torch.nn.Module | None = model
    for part in parts:
        module = getattr(module, part, None) if module is not None else None
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            return True
    return False


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


def _renamer(model: torch.nn.Module, names: set[str]) -> Callable[[str], str | None]:
    """The model's parameter or buffer (`names`) that transformers, loading the checkpoint
    into `model`, puts a key into: the renamings and converters of the model's conversion
    mapping (transformers.conversion_mapping.get_model_conversion_mapping, the list peft
    uses too). The key and its suffixes that keep every block index are tried, as the
    suffix join does; a transformers without the mapping renames nothing."""
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
        return lambda key: None
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None) or None
    present = dict.fromkeys(names, True)

    def rename(key: str) -> str | None:
        parts = key.split(".")
        for i in range(len(parts) - 1):
            if i and parts[i - 1].isdigit():
                return None  # never across a block index (match_by_suffix's rule)
            try:
                renamed, _ = rename_source_key(".".join(parts[i:]), renamings, converters,
                                               prefix, present)
            except Exception:  # a transform that does not take this key: not loaded
                return None
            if renamed in present:
                return str(renamed)
        return None

    return rename


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
