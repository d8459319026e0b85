"""4-bit floats (E2M1) with block scales: MXFP4 as GPT-OSS stores its experts, and
compressed-tensors' mxfp4/nvfp4 pack-quantized.

E2M1 codes: bit 3 the sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6]; two codes a byte,
the first in the low nibble.
- GPT-OSS (transformers' mxfp4): `<p>_blocks` uint8 (E, rows, groups, 16), 32 codes a
  group, and `<p>_scales` uint8 (E, rows, groups), a shared exponent 2^(s - 127) per group.
  The weight is read as the model holds it, (E, groups*32, rows): transposed, as
  transformers' dequantization gives it.
- compressed-tensors mxfp4-pack-quantized: `weight_packed` uint8 (out, in/2), `weight_scale`
  uint8 (out, in/32) exponents as above.
- compressed-tensors nvfp4-pack-quantized: `weight_packed` uint8 (out, in/2), `weight_scale`
  float8 e4m3 (out, in/16), `weight_global_scale` (1): W = code * scale / global_scale.
"""

from __future__ import annotations

from functools import partial

import torch

from esd_worker.analysis.quant.plan import (
    Module,
    Plan,
    QuantConfig,
    apply_grid,
    refused,
    stacked,
)
from esd_worker.analysis.weights import Tensors

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_U8 = ("U8", "uint8")


def fp4_plans(module: Module, tensors: Tensors, config: QuantConfig) -> list[Plan] | None:
    """The plans of a module of E2M1 weights (GPT-OSS experts, compressed-tensors mxfp4 or
    nvfp4); None for any other module."""
    params = module.params
    blocks = [p.removesuffix("_blocks") for p in params
              if p.endswith("_blocks") and f"{p.removesuffix('_blocks')}_scales" in params]
    if blocks:
        return [_gpt_oss(module, name, tensors) for name in blocks]
    packed = params.get("weight_packed")
    if packed is not None and tensors.dtype(packed) in _U8:
        return [_compressed(module, tensors)]
    return None


def codes(packed: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of a uint8 tensor, two a byte (low nibble first): last dim doubled.
    Each byte's pair is looked up at once."""
    raw = packed.to(torch.uint8)
    table = torch.tensor(E2M1, dtype=torch.float32)
    code = torch.arange(256)
    pairs = torch.stack([table[code & 0x0F], table[code >> 4]], dim=-1)
    return pairs[raw.to(torch.int64)].flatten(-2)


def _gpt_oss(module: Module, name: str, tensors: Tensors) -> Plan:
    blocks_key = module.params[f"{name}_blocks"]
    scales_key = module.params[f"{name}_scales"]
    key = module.key(name)
    folded = [blocks_key, scales_key]
    bshape, sshape = tensors.shape(blocks_key), tensors.shape(scales_key)
    if (len(bshape) != 4 or bshape[:-1] != sshape or tensors.dtype(blocks_key) not in _U8
            or tensors.dtype(scales_key) not in _U8):
        return refused(key, bshape, blocks_key, folded,
                       f"MXFP4 {name}_blocks {tensors.dtype(blocks_key)} {list(bshape)} / "
                       f"_scales {tensors.dtype(scales_key)} {list(sshape)}: not GPT-OSS's "
                       "(E, rows, groups, 16) uint8 with (E, rows, groups) uint8")
    experts, rows, groups, width = bshape
    shape = (experts, groups * width * 2, rows)

    def row(t: Tensors, index: int) -> torch.Tensor:
        values = codes(t.read_row(blocks_key, index))  # (rows, groups, 32)
        exponents = t.read_row(scales_key, index).to(torch.float32) - 127.0
        return torch.ldexp(values, exponents[..., None]).reshape(rows, -1).T.contiguous()

    return Plan(key, shape, blocks_key, tuple(folded), scheme="mxfp4",
                compute=lambda t: stacked(partial(row, t), shape), row=row)


def _compressed(module: Module, tensors: Tensors) -> Plan:
    params = module.params
    packed = params["weight_packed"]
    key = module.key("weight")
    folded = [packed, *module.others("weight_packed")]
    pshape = tensors.shape(packed)
    shape = (*pshape[:-1], pshape[-1] * 2)
    scale = params.get("weight_scale")
    nv = "weight_global_scale" in params
    if scale is None or len(pshape) != 2:
        why = "without weight_scale" if scale is None else "of a rank other than 2"
        return refused(key, shape, packed, folded,
                       f"compressed-tensors fp4 weight_packed {list(pshape)} {why}")
    sshape, sdtype = tensors.shape(scale), tensors.dtype(scale)
    group = shape[1] // sshape[1] if len(sshape) == 2 and sshape[1] else 0
    expected = ("F8_E4M3", "float8_e4m3fn") if nv else _U8
    if (len(sshape) != 2 or sshape[0] != shape[0] or not group
            or shape[1] != group * sshape[1] or sdtype not in expected):
        return refused(key, shape, packed, folded,
                       f"compressed-tensors {'nv' if nv else 'mx'}fp4 weight_scale {sdtype} "
                       f"{list(sshape)} does not fit the weight's {list(shape)}")

    def compute(t: Tensors) -> torch.Tensor:
        s = t.read(scale).to(torch.float32)
        if nv:
            s = s / t.read(params["weight_global_scale"]).to(torch.float32).reshape(())
        else:
            s = torch.exp2(s - 127.0)
        return apply_grid(codes(t.read(packed)), s, (1, group))

    return Plan(key, shape, packed, tuple(folded), scheme="nvfp4" if nv else "mxfp4",
                compute=compute)
