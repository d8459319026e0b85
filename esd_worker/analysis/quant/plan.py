"""What the quantization families share: a Plan per logical weight, the stored tensors grouped
by module, the checkpoint's quantization_config, and the arithmetic every family uses
(integers unpacked from int32 words, scales expanded over a grid of blocks)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from esd_worker.analysis.weights import Tensors

Compute = Callable[[Tensors], torch.Tensor]
RowCompute = Callable[[Tensors, int], torch.Tensor]

# Elements computed at once where a weight is dequantized in slices (GPTQ, AWQ, packed
# rows): the float32 temporaries of a slice stay near 16 MiB whatever the layer's size.
CHUNK = 1 << 22


@dataclass(frozen=True)
class Plan:
    """One quantized weight: read under `key` (`<module>.weight`) with the logical float
    `shape`, dequantized by `compute` (None: refused, `refusal` says why). `stored`: the
    stored tensor that stands in its place in the checkpoint's order (its dtype is reported
    while refused); `companions`: every other stored tensor folded into it."""

    key: str
    shape: tuple[int, ...]
    stored: str
    companions: tuple[str, ...]
    scheme: str | None = None
    compute: Compute | None = None
    row: RowCompute | None = None
    refusal: str | None = None


def refused(key: str, shape: Sequence[int], stored: str, companions: Iterable[str],
            why: str) -> Plan:
    return Plan(key, tuple(shape), stored, tuple(c for c in companions if c != key), refusal=why)


@dataclass
class Module:
    """The stored tensors of one module: parameter name (`qweight`, `weight.absmax`, ...)
    -> stored key."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def key(self, param: str) -> str:
        return f"{self.name}.{param}" if self.name else param

    def others(self, *used: str) -> list[str]:
        """The module's stored keys but `used` ones and its bias (which stays a tensor of
        its own)."""
        return [k for p, k in self.params.items() if p not in used and p != "bias"]


# bitsandbytes 4-bit keeps its state under the weight's own name: `x.weight.absmax`, ...
_BNB_STATE = re.compile(
    r"^(?P<module>.*?)\.?(?P<param>weight\.(?:absmax|quant_map|nested_absmax|nested_quant_map"
    r"|quant_state\.[\w.]+))$")


def modules(keys: Iterable[str]) -> dict[str, Module]:
    """The stored keys by module, in the checkpoint's order."""
    found: dict[str, Module] = {}
    for key in keys:
        state = _BNB_STATE.match(key)
        if state is not None:
            name, param = state["module"], state["param"]
        else:
            name, _, param = key.rpartition(".")
        found.setdefault(name, Module(name)).params[param] = key
    return found


@dataclass(frozen=True)
class QuantConfig:
    """config.json's quantization_config (empty: none), with what the families ask of it."""

    raw: Mapping[str, Any]

    @classmethod
    def of(cls, config: Mapping[str, Any] | None) -> QuantConfig:
        found = (config or {}).get("quantization_config")
        return cls(found if isinstance(found, Mapping) else {})

    @property
    def method(self) -> str:
        return str(self.raw.get("quant_method") or "").lower().replace("_", "-")

    def integer(self, name: str) -> int | None:
        value = self.raw.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def weight_args(self) -> list[Mapping[str, Any]]:
        """compressed-tensors: the `weights` arguments of each config group."""
        groups = self.raw.get("config_groups")
        if not isinstance(groups, Mapping):
            return []
        return [g["weights"] for g in groups.values()
                if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping)]

    def bits(self) -> list[int]:
        """The bit widths the config names (GPTQ/AWQ `bits`, compressed-tensors num_bits)."""
        found = [self.integer("bits"), self.integer("w_bit")]
        found += [a.get("num_bits") for a in self.weight_args()]
        return list(dict.fromkeys(b for b in found if isinstance(b, int)))

    def blocks(self) -> list[tuple[int, int]]:
        """Scale-block sizes (rows, columns) the config names: FP8's weight_block_size,
        compressed-tensors' block_structure, a group size as (1, group)."""
        found: list[Any] = [self.raw.get("weight_block_size")]
        for args in self.weight_args():
            found.append(args.get("block_structure"))
            group = args.get("group_size")
            if isinstance(group, int) and group > 0:
                found.append([1, group])
        blocks = []
        for block in found:
            if isinstance(block, str) and "x" in block:  # old compressed-tensors: "128x128"
                block = block.split("x")
            try:
                rows, cols = (int(v) for v in block)
            except (TypeError, ValueError):
                continue
            if rows > 0 and cols > 0:
                blocks.append((rows, cols))
        return list(dict.fromkeys(blocks))


def float_name(dtype: str) -> str | None:
    """"fp8-e4m3" / "fp8-e5m2" for a stored float8 dtype name, else None."""
    return {"F8_E4M3": "fp8-e4m3", "F8_E5M2": "fp8-e5m2", "float8_e4m3fn": "fp8-e4m3",
            "float8_e5m2": "fp8-e5m2"}.get(dtype)


INTEGER_DTYPES = frozenset({"I8", "U8", "I16", "I32", "I64", "int8", "uint8", "int16",
                            "int32", "int64"})
FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                           "float8_e4m3fn", "float8_e5m2"})


def unpack(packed: torch.Tensor, bits: int, *, dim: int = -1,
           order: Sequence[int] | None = None) -> torch.Tensor:
    """The unsigned `bits`-bit integers packed into int32 words along `dim` (0 or -1), the
    first in each word's lowest bits, as a contiguous uint8 tensor with that dimension
    `32 // bits` times longer. `order`: where each element sits in its word (AWQ's
    interleave), else in order."""
    per, mask = 32 // bits, (1 << bits) - 1
    words = packed.to(torch.int32).contiguous()
    at = 1 if dim == 0 else words.dim()  # the axis of value j of each word
    if 8 % bits == 0 and sys.byteorder == "little":
        # Byte k of a word holds its values k * (8 // bits) onwards: 8 // bits operations
        # on uint8 planes, not 32 // bits on int32 words.
        in_byte = 8 // bits
        planes = words.view(torch.uint8).unflatten(-1, (-1, 4))  # (..., words, 4 bytes)
        planes = planes.movedim(-1, 1) if dim == 0 else planes.flatten(-2)
        axis = 2 if dim == 0 else words.dim()  # (rows, 4, cols, ...) or (..., bytes)
        values = torch.empty((*planes.shape[:axis], in_byte, *planes.shape[axis:]),
                             dtype=torch.uint8)
        for j in range(in_byte):
            values.select(axis, j).copy_(torch.bitwise_and(planes >> (bits * j), mask))
        values = values.reshape((*words.shape[:at], per, *words.shape[at:]))
    else:
        values = torch.empty((*words.shape[:at], per, *words.shape[at:]), dtype=torch.uint8)
        for j in range(per):
            values.select(at, j).copy_(
                torch.bitwise_and(torch.bitwise_right_shift(words, bits * j), mask))
    if order is not None:
        values = values.index_select(at, torch.tensor([list(order).index(e) for e in range(per)]))
    return values.flatten(at - 1, at)


def block_size(n: int, count: int, hints: Iterable[int]) -> int | None:
    """The block length along a dimension of `n` that `count` scales cover (the last block
    maybe partial): the first hint that fits, else the one length that gives `count` blocks,
    else None. Without a hint the shapes rarely decide it: 200 columns in 4 blocks are
    blocks of 50 or of 64 (the last partial), whose dequantizations differ, so that is None
    (refused), never a guess."""
    for hint in hints:
        if hint > 0 and math.ceil(n / hint) == count:
            return hint
    if count == 1:
        return n
    if count < 1 or count > n:
        return None
    # ceil(n / b) == count  <=>  ceil(n / count) <= b <= (n - 1) // (count - 1)
    low, high = -(-n // count), (n - 1) // (count - 1)
    return low if low == high else None


def grid_scales(scale: torch.Tensor, shape: Sequence[int]) -> torch.Tensor | None:
    """`scale` as a grid of the weight's rank: (..., rows of blocks, columns of blocks), or
    None when its shape is no grid of `shape` (a scalar, (out,), (out, 1), (E,), (E, out)
    and grids of the weight's rank are)."""
    rank = len(shape)
    if scale.numel() == 1:
        return scale.reshape((1,) * rank)
    if scale.dim() == rank:
        return scale
    if scale.dim() == rank - 1 and tuple(scale.shape) == tuple(shape[:-1]):
        return scale.unsqueeze(-1)  # per output channel
    if rank == 3 and scale.dim() == 1 and scale.shape[0] == shape[0]:
        return scale.reshape(-1, 1, 1)  # one scale per expert
    return None


def grid_blocks(grid: Sequence[int], shape: Sequence[int],
                hints: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The (rows, columns) of the block each scale of `grid` covers in a weight of `shape`:
    a block size of the config where it fits, else 128 (FP8's usual block) where it fits,
    else the one size the shapes allow (plan.block_size); None when the grid cannot be a
    blocking of the weight, is not the 2-D block the config names, or could be several."""
    (rows, cols), (grid_rows, grid_cols) = shape[-2:], grid[-2:]
    if any(g not in (1, s) for g, s in zip(grid[:-2], shape[:-2], strict=True)):
        return None
    for block in hints:
        if math.ceil(rows / block[0]) == grid_rows and math.ceil(cols / block[1]) == grid_cols:
            return block
    if any(block[0] > 1 for block in hints) and (grid_rows, grid_cols) != (1, 1):
        return None  # the config names a 2-D block this grid is not: a contradiction
    br = block_size(rows, grid_rows, [128])
    bc = block_size(cols, grid_cols, [128])
    return None if br is None or bc is None else (br, bc)


def grid_name(grid: Sequence[int], block: tuple[int, int], shape: Sequence[int]) -> str:
    """tensor, channel, g<columns> or block<rows>x<columns>: how far each scale reaches."""
    if tuple(grid[-2:]) == (1, 1):
        return "tensor"
    if block[0] == 1:
        return "channel" if grid[-1] == 1 else f"g{block[1]}"
    return f"block{block[0]}x{block[1]}"


def apply_grid(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               zero: torch.Tensor | None = None) -> torch.Tensor:
    """w (float32, modified in place) as (w - zero) * scale, each entry of the grids `scale`
    and `zero` (same rank as w) covering one block; blocks at the edges may be partial.
    The scales are expanded over rows only, never to a second weight-sized tensor."""
    rows, cols = w.shape[-2:]
    full, rem = divmod(cols, block[1])
    for grid, op in ((zero, torch.Tensor.sub_), (scale, torch.Tensor.mul_)):
        if grid is None:
            continue
        g = grid.to(torch.float32).repeat_interleave(block[0], dim=-2)[..., :rows, :]
        if full:
            op(w[..., : full * block[1]].unflatten(-1, (full, block[1])), g[..., :full, None])
        if rem:
            op(w[..., full * block[1]:], g[..., full: full + 1])
    return w


def stacked(row: Callable[[int], torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """A (E, ...) float32 stack of `row(e)`, each written into its place as it is computed
    (one expert's temporaries at a time, not a list of them and a copy)."""
    out = torch.empty(tuple(shape), dtype=torch.float32)
    for index in range(shape[0]):
        out[index] = row(index)
    return out
