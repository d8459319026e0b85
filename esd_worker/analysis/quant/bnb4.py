"""bitsandbytes 4-bit (nf4, fp4), as transformers saves Params4bit.

`weight`: the codes, two to a byte (the first in the high nibble), of the weight flattened
in row-major order, stored as uint8 (or any dtype holding those bytes: quant_storage);
`weight.absmax`: one float32 scale per block of `blocksize` values (the last block maybe
partial); `weight.quant_map`: the 16 values a code stands for; with double quantization
the absmax are themselves 8-bit codes (`weight.nested_absmax`, `weight.nested_quant_map`,
blocks of nested_blocksize) plus nested_offset; `weight.quant_state.bitsandbytes__nf4`
(or __fp4): JSON bytes with quant_type, blocksize, dtype, shape and the nested fields.
W = quant_map[code] * absmax of its block, reshaped to `shape`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from esd_worker.analysis.quant.plan import CHUNK, Module, Plan, refused
from esd_worker.analysis.weights import Tensors

_STATE = "weight.quant_state.bitsandbytes__"


def bnb4_plan(module: Module, tensors: Tensors) -> Plan | None:
    """The plan of a bitsandbytes 4-bit module; None when the module is none."""
    params = module.params
    states = [p for p in params if p.startswith("weight.quant_state.")]
    if "weight.absmax" not in params and not states:
        return None
    key = module.key("weight")
    folded = module.others("weight")
    stored_shape = tensors.shape(key) if "weight" in params else ()
    if "weight" not in params:
        return refused(key, (), next(iter(params.values())), folded,
                       "bitsandbytes 4-bit state without its weight")
    if len(states) != 1 or not states[0].startswith(_STATE):
        return refused(key, stored_shape, key, folded,
                       "bitsandbytes 4-bit weight without one quant_state."
                       "bitsandbytes__nf4/fp4 (its shape and block size)")
    try:
        state = json.loads(bytes(tensors.read(params[states[0]]).to(torch.uint8).tolist()))
    except (ValueError, TypeError) as e:
        return refused(key, stored_shape, key, folded,
                       f"bitsandbytes quant_state that is no JSON: {e}")
    checked = _checked(state, states[0].removeprefix(_STATE), params)
    if isinstance(checked, str):
        return refused(key, stored_shape, key, folded, checked)
    shape, quant_type, blocksize = checked
    nested = "weight.nested_absmax" in params

    def compute(t: Tensors) -> torch.Tensor:
        absmax = t.read(params["weight.absmax"])
        if nested:
            absmax = _codes_times(absmax,
                                  t.read(params["weight.nested_quant_map"]).to(torch.float32),
                                  t.read(params["weight.nested_absmax"]).to(torch.float32),
                                  int(state["nested_blocksize"]))
            absmax += float(state["nested_offset"])
        raw = t.read(key).contiguous().view(torch.uint8).reshape(-1)
        n = math.prod(shape)
        if 2 * raw.numel() < n:
            raise ValueError(f"{key} holds {2 * raw.numel()} codes for a weight of {n}")
        # Each byte's two values (high nibble first) looked up at once.
        code = torch.arange(256)
        table = t.read(params["weight.quant_map"]).to(torch.float32)
        pairs = torch.stack([table[code >> 4], table[code & 0x0F]], dim=-1)
        return _codes_times(raw, pairs, absmax.to(torch.float32), blocksize, n).reshape(shape)

    return Plan(key, shape, key, tuple(folded), scheme=f"bnb-{quant_type}", compute=compute)


def _checked(state: Any, named: str, params: dict[str, str]
             ) -> tuple[tuple[int, ...], str, int] | str:
    """(shape, quant_type, blocksize) of a quant_state, or why it cannot be dequantized."""
    if not isinstance(state, dict):
        return "bitsandbytes quant_state that is no JSON object"
    quant_type = state.get("quant_type", named)
    if quant_type not in ("nf4", "fp4") or quant_type != named:
        return f"bitsandbytes 4-bit quant_type {quant_type!r} is not supported (nf4, fp4 are)"
    shape, blocksize = state.get("shape"), state.get("blocksize")
    if not (isinstance(shape, list) and shape and all(isinstance(v, int) for v in shape)):
        return f"bitsandbytes quant_state with no shape ({shape!r})"
    if not isinstance(blocksize, int) or blocksize <= 0:
        return f"bitsandbytes quant_state with block size {blocksize!r}"
    missing = [p for p in ("weight.absmax", "weight.quant_map") if p not in params]
    if "weight.nested_absmax" in params:
        missing += [p for p in ("weight.nested_quant_map",) if p not in params]
        missing += [f for f in ("nested_blocksize", "nested_offset") if f not in state]
    if missing:
        return f"bitsandbytes 4-bit weight without {', '.join(missing)}"
    return tuple(shape), quant_type, blocksize


def _codes_times(codes: torch.Tensor, table: torch.Tensor, absmax: torch.Tensor,
                 blocksize: int, n: int | None = None) -> torch.Tensor:
    """table[codes], flat (a table of rows: each code that many values), its first `n`
    values, each block of `blocksize` times its absmax (the last block maybe partial):
    bitsandbytes' blockwise dequantization."""
    width = table.shape[1] if table.dim() == 2 else 1
    total = codes.numel() * width
    values = torch.empty(total, dtype=torch.float32)
    step = max(1, CHUNK // width)
    for start in range(0, codes.numel(), step):  # int64 indices a slice at a time
        part = codes[start: start + step].to(torch.int64)
        values[start * width: (start + part.numel()) * width] = table[part].reshape(-1)
    values = values[: total if n is None else n]
    n = values.numel()
    full, rem = divmod(n, blocksize)
    if absmax.numel() != full + (1 if rem else 0):
        raise ValueError(f"{absmax.numel()} absmax for {n} values in blocks of {blocksize}")
    absmax = absmax.reshape(-1)
    if full:
        values[: full * blocksize].view(full, blocksize).mul_(absmax[:full, None])
    if rem:
        values[full * blocksize:].mul_(absmax[full])
    return values
