"""Every tensor a checkpoint holds, accounted for: a layer row or a documented skip rule;
anything else fails the model, naming it (never silently left out).

Owns the rules for tensors that no module of the architecture types (raw parameters such as
`in_proj_weight` or `text_projection`, a MoE's per-expert matrices, expert stacks stored as
3-D tensors, a checkpoint without an architecture): what each is, by its shape, dtype and
name; the names of the rows of a stack of matrices (one per expert, a slice of the stored
tensor: `key[i]`, esd_worker.analysis.stacks' syntax); and the `coverage` a result.json
records. Does not build the model or join its modules to keys (esd_worker.analysis.layers),
dequantize (esd_worker.analysis.quantized) or read tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from esd_worker.analysis.stacks import row_key, split
from esd_worker.analysis.weights import Tensors, float_dtype
from esd_worker.core.errors import PermanentModelError

CONV2D = "Conv2d"
EMBEDDING = "Embedding"
MATRIX = "Matrix"  # a 2-D weight no Linear/Conv1D/Embedding module of the architecture holds
EXPERT = "Expert"  # one expert's matrix of a mixture of experts (stored 2-D, or a 3-D slice)

# Skip rules: every tensor that is no layer row has one (docs/metrics.md "Which layers").
RULES: dict[str, str] = {
    "vector": "tensors with at most one axis longer than 1 (biases, norm scales, learned "
              "tokens), and stacks of biases (a MoE's per-expert `*_bias`)",
    "embedding": "token, position and type embeddings (rows with --include-embeddings)",
    "norm": "normalisation weights",
    "integer": "integer tensors that are no weight (position ids, index tables, counters)",
    "conv": "kernels of convolutions other than nn.Conv2d (nn.Conv1d of speech front ends "
            "and Mamba, nn.Conv3d patch embeddings of video models, transposed ones)",
    "tied_copy": "a stored copy of a tied weight: analysed once, under the layer tying it",
    "ignored_on_load": "keys the model class tells transformers not to load",
    "quantization": "a quantized weight's scales, zero points and indices (folded into it)",
}

# An untyped tensor is an embedding when its own name says so (`wte`, `embed_tokens`,
# `position_embeddings`, `pos_embed`, `cls_token`), not when a module above it does:
# `time_embedding.linear_1` and `patch_embed.proj` are projections.
_EMBEDDING_LEAF = re.compile(
    r"^(wte|wpe|shared|embed_tokens|embeddings?|word_embeddings|pos_embed\w*|"
    r"\w*position\w*|rel_pos\w*|\w*_embeddings?|\w*_embeds?|\w*_embd|\w*_tokens?|token_types|"
    r"cls_token|mask_token)$",
    re.IGNORECASE,
)
_NORM_LEAF = re.compile(r"(norm|^ln_|^ln\d*$)", re.IGNORECASE)
# A 3-D kernel by its name when no module says so: `conv`, or weight norm's factors.
_CONV_LEAF = re.compile(r"(conv|weight_[gv]$|parametrizations\.weight\.original\d)",
                        re.IGNORECASE)
_INDEX_LEAF = re.compile(r"(_ids|_index|_indices|_idx|position|_mask|count|step)$",
                         re.IGNORECASE)
_BIAS_LEAF = re.compile(r"(^|_)bias$", re.IGNORECASE)
# `experts`, and llama.cpp's GGUF names (`blk.3.ffn_gate_exps.weight`).
_EXPERTS = re.compile(r"(^|\.)experts?(\.|$)|_exps$")


def leaf(key: str) -> str:
    """The tensor's own name: its key's last part before `.weight` (`wte`, `in_proj_weight`)."""
    parts = key.removesuffix(".weight").split(".")
    return parts[-1]


def is_embedding_name(key: str) -> bool:
    return _EMBEDDING_LEAF.match(leaf(key)) is not None


def effective(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape without its leading 1s: a position table stored (1, n, d) is a matrix."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return shape[i:]


@dataclass(frozen=True)
class Untyped:
    """What an untyped tensor is: rows (name, key, layer type, shape) or a skip rule; `rule`
    None and no rows: unexplained."""

    rows: tuple[tuple[str, str, str, tuple[int, ...]], ...] = ()
    rule: str | None = None


def classify(tensors: Tensors, key: str, *, name: str, include_embeddings: bool,
             stack: bool) -> Untyped:
    """An untyped tensor: `name` is what its rows are called (the model's parameter name
    where the architecture joins it, else the key's stem); `stack`: a 3-D tensor is a stack
    of experts (its first axis is the config's expert count); without that, only a tensor
    named as experts is. A 4-D tensor is a Conv2d kernel whatever its name; the name rules
    (embedding, norm) apply to matrices only."""
    shape, dtype = tensors.shape(key), tensors.dtype(key)
    eff = effective(shape)
    stem = name.removesuffix(".weight")
    if sum(1 for n in shape if n > 1) <= 1 or _BIAS_LEAF.search(leaf(key)):
        # At most one axis of length > 1 ((heads, 1, 1) scales too), or a stack of
        # per-expert biases: vectors.
        return Untyped(rule="vector")
    if float_dtype(dtype) is None and not dtype.startswith("F8") and tensors.refusal(key) is None:
        # Integers that are no quantized weight the view knows: an index table or a counter
        # by its name, else a matrix the analysis cannot read (a quantization this worker
        # does not know, e.g. HQQ's `W_q`): a row that says unsupported_dtype, never skipped.
        if _INDEX_LEAF.search(leaf(key)) or len(eff) != 2:
            return Untyped(rule="integer")
        return Untyped(rows=((stem, key, MATRIX, eff),))
    if len(shape) == 4 and shape[0] > 1:
        return Untyped(rows=((stem, key, CONV2D, shape),))  # a kernel, whatever its name
    if len(shape) == 5 or (len(shape) == 3 and _CONV_LEAF.search(stem)):
        return Untyped(rule="conv")  # Conv3d, a (weight-normed) Conv1d by its name
    if len(eff) == 2 and is_embedding_name(key):
        if not include_embeddings:
            return Untyped(rule="embedding")
        return _rows(stem, key, EMBEDDING, shape, eff)
    if len(eff) == 2 and _NORM_LEAF.search(leaf(key)):
        return Untyped(rule="norm")
    if len(eff) == 2:
        kind = EXPERT if _EXPERTS.search(stem) else MATRIX
        return _rows(stem, key, kind, shape, eff)
    if len(eff) == 3 and len(shape) == 3 and (stack or _EXPERTS.search(stem)):
        return Untyped(rows=tuple(
            (expert_name(stem, i), row_key(key, i), EXPERT, shape[1:]) for i in range(shape[0])))
    return Untyped()


def _rows(stem: str, key: str, kind: str, shape: tuple[int, ...], eff: tuple[int, ...]
          ) -> Untyped:
    """One row for a matrix, read through slices of its leading 1s when it has some."""
    if len(eff) != 2:
        return Untyped()
    return Untyped(rows=((stem, row_key(key, *[0] * (len(shape) - 2)), kind, eff),))


def expert_name(stem: str, index: int) -> str:
    """Row `index` of a stack: after its `experts` part (`mlp.experts.3.gate_up_proj`), else
    at the end (`block_sparse_moe.input_linear.3`)."""
    parts = stem.split(".")
    for i, part in enumerate(parts):
        if part in ("experts", "expert"):
            return ".".join([*parts[: i + 1], str(index), *parts[i + 1:]])
    return f"{stem}.{index}"


class UnexplainedTensors(PermanentModelError):
    """Stored tensors that are neither a layer row nor skipped by a documented rule (a tensor
    of six dimensions, a 3-D tensor that is no stack of experts nor a kernel): the model
    fails, naming them, rather than being marked done without them."""

    def __init__(self, keys: list[str], parameters: int) -> None:
        self.keys = keys
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        n = len(keys)
        super().__init__(
            f"{n} tensor{'s' if n > 1 else ''} of the checkpoint ({parameters} parameters) "
            f"neither analysable nor skipped by a documented rule ({shown}): not analysed, "
            "so the model is not marked done without them")


def coverage(tensors: Tensors, row_keys: Iterable[str], skipped: Mapping[str, str],
             ) -> dict[str, Any]:
    """result.json's coverage: every tensor held (a quantized weight's companions counted as
    tensors, its parameters as the logical weight's), those behind layer rows (tensors,
    parameters, and matrices: rows, one per expert of a stack), and those skipped by each
    rule (with one example each). UnexplainedTensors when any tensor is neither."""
    keys = tensors.keys()
    numel = {key: prod(tensors.shape(key)) for key in keys}
    read = [split(k)[0] for k in row_keys]  # the stored key each row reads
    analysed = set(read)
    left = [key for key in keys if key not in analysed and key not in skipped]
    if left:
        raise UnexplainedTensors(left, sum(numel[key] for key in left))
    rules: dict[str, dict[str, Any]] = {}
    folded = tensors.folded()
    for key, rule in [*skipped.items(), *((k, "quantization") for k in folded)]:
        if key in analysed:
            continue
        entry = rules.setdefault(rule, {"tensors": 0, "parameters": 0, "example": key})
        entry["tensors"] += 1
        entry["parameters"] += numel.get(key, 0)
    return {
        "tensors": len(keys) + len(folded),
        "parameters": sum(numel.values()),
        "analysed": {"tensors": len(analysed), "matrices": len(read),
                     "parameters": sum(numel.get(key, 0) for key in analysed)},
        "skipped": dict(sorted(rules.items())),
    }
