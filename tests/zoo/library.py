"""What a zoo model's own library holds, as the checker compares the worker's rows with it.

A model's parameters are read by its library, never by the worker's code: transformers'
`from_pretrained` (in float64: exact for float32, float16 and bfloat16 values), peft's
`merge_and_unload()` for an adapter, sentence-transformers' `SentenceTransformer`, the
`gguf` package's reader and dequantizer; where no installed library reads a checkpoint on
the CPU as it is written (a diffusers folder: diffusers is not installed; quantized
schemes: their loaders need a GPU, and bitsandbytes' CPU dequantization disagrees with its
own format), the files as stored, dequantized by the scheme's published formula
(tests.zoo.quantized).

Each parameter of two or more dimensions (leading 1s aside) is a `Unit`: the matrices a row
may match (`alternatives`: each a list of `Ref`s that together cover it), or none when the
worker is expected to skip it by a documented rule (`category` says which kind it is).
A 3-D expert stack is one unit per expert; a fused gate_up stack's expert is covered by its
whole slice or by both halves (contiguous or interleaved, along either side); a Conv2d weight
is one ref whose λ_max is conv_norm × the largest σ² of its kh·kw slices (docs/metrics.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

# Categories a row must cover (the worker analyses them) ...
MATRIX = "matrix"  # a Linear/Conv1D weight or any raw 2-D parameter
EXPERT = "expert"  # one expert's matrix (a slice of a 3-D stack)
CONV2D = "conv2d"
# ... and those a documented skip rule may cover instead (result.json's coverage).
EMBEDDING = "embedding"  # token/position/type tables, position bias tables
NORM = "norm"
BIAS = "bias"  # a stack of bias vectors (one per expert)
CONV1D = "conv1d"
CONV3D = "conv3d"
OTHER = "other"  # none of the above (no rule is expected for it)

MUST_ANALYSE = frozenset({MATRIX, EXPERT, CONV2D, OTHER})
# The skip rules (result.json coverage["skipped"] keys) that explain a category.
RULES_FOR: Mapping[str, frozenset[str]] = {
    EMBEDDING: frozenset({"embedding"}),
    NORM: frozenset({"norm", "vector"}),
    BIAS: frozenset({"vector", "bias"}),
    CONV1D: frozenset({"conv1d", "conv"}),
    CONV3D: frozenset({"conv3d", "conv", "convnd"}),
}

_EMBEDDING_LEAF = re.compile(
    r"(embed|embd|^wte$|^wpe$|^shared$|position|pos_emb|_token$|_tokens$|^cls_token|"
    r"^mask_token|relative_position_bias_table|relative_attention_bias)", re.IGNORECASE)
_FUSED = re.compile(r"(gate_up|input_linear|w13|w1_w3)", re.IGNORECASE)


@dataclass(frozen=True)
class Ref:
    """One matrix a row may be: its shape (as held; rows match either orientation) and
    λ_max (σ_max² in float64; conv_norm·σ_max² over a Conv2d's slices)."""

    shape: tuple[int, int]
    lam: float


@dataclass
class Unit:
    """One parameter of the library (or one expert of a stack): `name` as the library names
    it (`x.gate_up_proj[2]` for expert 2), its category, and the ways rows cover it."""

    name: str
    category: str
    numel: int
    alternatives: list[list[Ref]] = field(default_factory=list)


def effective(shape: Iterable[int]) -> tuple[int, ...]:
    """The shape without leading 1s: a (1, n, d) position table is a matrix."""
    dims = tuple(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims = dims[1:]
    return dims


def lam_max(matrix: torch.Tensor) -> float:
    """σ_max² of a matrix, float64 SVD."""
    return float(torch.linalg.svdvals(matrix.to(torch.float64)).max()) ** 2


def conv_ref(weight: torch.Tensor, conv_norm: float) -> Ref:
    """A Conv2d weight (out, in, kh, kw): its kh·kw slices pooled, scaled by conv_norm."""
    w = weight.to(torch.float64)
    lam = max(lam_max(w[:, :, i, j]) for i in range(w.shape[2]) for j in range(w.shape[3]))
    return Ref((w.shape[0], w.shape[1]), conv_norm * lam)


def _matrix_ref(m: torch.Tensor) -> Ref:
    return Ref((m.shape[0], m.shape[1]), lam_max(m))


def _halves(m: torch.Tensor) -> Iterator[list[Ref]]:
    """A fused gate_up slice's two halves, each way they may be laid out."""
    for dim in (0, 1):
        n = m.shape[dim]
        if n % 2:
            continue
        first, second = m.narrow(dim, 0, n // 2), m.narrow(dim, n // 2, n // 2)
        yield [_matrix_ref(first), _matrix_ref(second)]
        even = m.index_select(dim, torch.arange(0, n, 2))
        odd = m.index_select(dim, torch.arange(1, n, 2))
        yield [_matrix_ref(even), _matrix_ref(odd)]


def units_of(name: str, tensor: torch.Tensor, category: str, *, conv_norm: float,
             typed: bool = False) -> list[Unit]:
    """The units of one parameter (none when it is a vector or a scalar); `typed`: a
    module's weight (Linear, Conv1D), whose shape is taken as it is."""
    t = tensor.detach().to(torch.float64)
    if category == CONV2D and t.dim() == 4:  # an out or in of 1 is no leading 1 to drop
        return [Unit(name, CONV2D, t.numel(), [[conv_ref(t, conv_norm)]])]
    # A Linear's (1, n) weight is a matrix (a one-output gate); a raw (1, n, d) table is
    # one too, and a (1, 1, d) token a vector.
    eff = tuple(t.shape) if typed and t.dim() == 2 else effective(t.shape)
    if len(eff) <= 1:
        return []
    t = t.reshape(eff)
    if category == EXPERT and t.dim() == 3:
        found = []
        for i in range(t.shape[0]):
            alternatives = [[_matrix_ref(t[i])]]
            if _FUSED.search(name.rsplit(".", 1)[-1]):
                alternatives.extend(_halves(t[i]))
            found.append(Unit(f"{name}[{i}]", EXPERT, t[i].numel(), alternatives))
        return found
    if t.dim() == 2 and category in (MATRIX, EMBEDDING, BIAS, EXPERT, NORM, OTHER):
        return [Unit(name, category, t.numel(), [[_matrix_ref(t)]])]
    return [Unit(name, category if category != MATRIX else OTHER, t.numel())]


def name_category(name: str, shape: tuple[int, ...]) -> str:
    """A stored tensor's category from its name and shape alone (no module to ask)."""
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    eff = effective(shape)
    if "norm" in leaf.lower() or leaf.startswith("ln_"):
        return NORM
    if leaf.endswith("bias"):
        return BIAS
    if _EMBEDDING_LEAF.search(leaf):
        return EMBEDDING
    if len(eff) == 4:
        return CONV2D
    if len(eff) == 3:
        return EXPERT if "expert" in name or "_exps" in name else OTHER
    return MATRIX


def _is_linear(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, torch.nn.Linear | Conv1D)


def module_category(module: torch.nn.Module, leaf: str, name: str,
                    shape: tuple[int, ...]) -> str:
    """A parameter's category from the module holding it (its type), else its name."""
    kind = type(module).__name__
    if isinstance(module, torch.nn.Embedding):
        return EMBEDDING
    if _is_linear(module) and leaf == "weight":
        return MATRIX
    if isinstance(module, torch.nn.Conv2d) and leaf == "weight":
        return CONV2D
    if isinstance(module, torch.nn.Conv1d):
        return CONV1D
    if isinstance(module, torch.nn.Conv3d):
        return CONV3D
    if "Norm" in kind:
        return NORM
    if isinstance(module, torch.nn.MultiheadAttention) and leaf == "in_proj_weight":
        return MATRIX
    return name_category(name, shape)


def module_units(model: torch.nn.Module, *, conv_norm: float, prefix: str = "",
                 weights: Mapping[str, torch.Tensor] | None = None) -> list[Unit]:
    """Every parameter of `model` (shared ones once) as units; `weights` replaces a
    parameter's value (a dequantized weight) by name."""
    found: list[Unit] = []
    for name, param in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        if ".parametrizations." in name:  # weight_norm: the module it parametrizes
            owner_name, leaf = name.split(".parametrizations.")[0], "weight"
        owner = model.get_submodule(owner_name) if owner_name else model
        value = weights[name] if weights is not None and name in weights else param
        if not value.is_floating_point():
            continue
        category = module_category(owner, leaf, name, tuple(value.shape))
        typed = leaf == "weight" and _is_linear(owner)
        found.extend(units_of(prefix + name, value, category, conv_norm=conv_norm, typed=typed))
    return found


def tensor_units(tensors: Mapping[str, torch.Tensor], *, conv_norm: float,
                 prefix: str = "") -> list[Unit]:
    """Stored tensors (a diffusers component read from its files, a dequantized
    checkpoint) as units, each categorised by its name and shape."""
    found: list[Unit] = []
    for name, value in tensors.items():
        if not value.is_floating_point():
            continue
        category = name_category(name, tuple(value.shape))
        found.extend(units_of(prefix + name, value, category, conv_norm=conv_norm))
    return found
