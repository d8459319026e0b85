"""float8 and int8 weights stored whole beside their scales.

- FP8 (e4m3, e5m2): `weight` float8 with `weight_scale` (FBGEMM, compressed-tensors
  float-quantized: per tensor, per output channel, per group or per block) or
  `weight_scale_inv` (DeepSeek-V3, transformers' FineGrainedFP8: per block of
  quantization_config.weight_block_size). Both multiply: W = w * scale, each scale over
  its block, the blocks at the right and bottom edges partial. An e8m0 scale (uint8, MXFP8)
  is 2^(s - 127).
- compressed-tensors int8 (int-quantized): `weight` int8, `weight_scale`, maybe
  `weight_zero_point`: W = (w - zero) * scale over the same grids.
- bitsandbytes int8 (LLM.int8): `weight` int8 and `SCB`, one absmax per row:
  W = w * SCB / 127.
A float8 weight with no scale at all is refused: its raw values are not the weights.
"""

from __future__ import annotations

import math

import torch

from esd_worker.analysis.quant.plan import (
    FLOAT8_DTYPES,
    Module,
    Plan,
    QuantConfig,
    apply_grid,
    float_name,
    grid_blocks,
    grid_name,
    grid_scales,
    refused,
)
from esd_worker.analysis.weights import Tensors

# Stored beside a scaled weight and not needed to dequantize it (activation scales).
_ACTIVATION = ("input_scale", "input_scale_ub", "activation_scale", "output_scale",
               "input_zero_point", "input_global_scale")
_SCALE_ENDINGS = ("scale", "scale_inv", "scale_ub", "zero_point", "global_scale", "SCB")
_INT8 = ("I8", "int8")
_SCALES = ("weight_scale_inv", "weight_scale")


def scaled_plans(module: Module, tensors: Tensors, config: QuantConfig) -> list[Plan] | None:
    """The plans of a module's weights stored whole as float8 (or as int8 with a scale):
    its `weight` (scales `weight_scale_inv`/`weight_scale`), and fused expert parameters
    such as `gate_up_proj` (scales `gate_up_proj_scale_inv`/`_scale`, as transformers saves
    FP8 experts); None when the module holds none."""
    params = module.params
    names = [p for p in params if not p.endswith(_SCALE_ENDINGS) and (
        tensors.dtype(params[p]) in FLOAT8_DTYPES or (p == "weight" and (
            tensors.dtype(params[p]) in _INT8
            and any(s in params for s in ("SCB", "weight_scale", "weight_scale_inv")))))]
    if not names:
        return None
    own = {p: [c for c in (f"{p}_scale_inv", f"{p}_scale", f"{p}_zero_point",
                           *(f"{p}_{a}" for a in _ACTIVATION)) if c in params]
           for p in names if p != "weight"}
    taken = {p for companions in own.values() for p in (*companions, *own)}
    plans = []
    for name in names:
        if name == "weight":
            folded = [k for p, k in params.items() if p not in taken and p not in (
                "weight", "bias")]
            plans.append(_scaled(module, "weight", _SCALES, "weight_zero_point", folded,
                                 tensors, config))
        else:
            plans.append(_scaled(module, name, (f"{name}_scale_inv", f"{name}_scale"),
                                 f"{name}_zero_point", [params[p] for p in own[name]],
                                 tensors, config))
    return plans


def _scaled(module: Module, name: str, scales: tuple[str, ...], zero: str, folded: list[str],
            tensors: Tensors, config: QuantConfig) -> Plan:
    """The plan of one float8 (or int8) parameter `name` with one of `scales` beside it."""
    params = module.params
    key = params[name]
    dtype = tensors.dtype(key)
    shape = tensors.shape(key)
    if "SCB" in params and name == "weight" and dtype in _INT8:
        return _bnb_int8(module, key, shape, tensors, folded)
    fp8 = float_name(dtype)
    scale_param = next((p for p in scales if p in params), None)
    if fp8 is None and dtype not in _INT8:
        return refused(key, shape, key, folded, f"{dtype} weights are not supported")
    if scale_param is None:
        return refused(key, shape, key, folded,
                       f"{dtype} weight with no scale ({' or '.join(scales)}): its stored "
                       "values are not the weights")
    if len(shape) < 2:
        return refused(key, shape, key, folded, f"a scaled weight of shape {list(shape)}")
    scale_key = params[scale_param]
    scale_dtype = tensors.dtype(scale_key)
    if scale_dtype not in ("F32", "F16", "BF16", "U8", "float32", "float16", "bfloat16",
                           "uint8"):
        return refused(key, shape, key, folded,
                       f"{scale_param} of dtype {scale_dtype} is not supported")
    grid = _grid_shape(tensors.shape(scale_key), shape)
    block = None if grid is None else grid_blocks(grid, shape, config.blocks())
    if grid is None or block is None:
        return refused(key, shape, key, folded,
                       f"{scale_param} of shape {list(tensors.shape(scale_key))} does not "
                       f"fit the weight's {list(shape)}")
    zero_key = params.get(zero)
    e8m0 = scale_dtype in ("U8", "uint8")
    # e8m0 scales (uint8 exponents): MXFP8
    prefix = "compressed-int8" if fp8 is None else ("mx" + fp8 if e8m0 else fp8)
    return Plan(
        key, tuple(shape), key, tuple(folded),
        scheme=f"{prefix}-{grid_name(grid, block, shape)}",
        compute=lambda t: _dequantize(t.read(key), t.read(scale_key), block, e8m0,
                                      None if zero_key is None else t.read(zero_key)),
        row=None if len(shape) < 3 else lambda t, i: _row(
            t, i, key, scale_key, zero_key, block, e8m0),
    )


def _grid_shape(scale_shape: tuple[int, ...], shape: tuple[int, ...]
                ) -> tuple[int, ...] | None:
    grid = grid_scales(torch.empty(scale_shape, device="meta"), shape)
    return None if grid is None else tuple(grid.shape)


def _dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], e8m0: bool,
                zero: torch.Tensor | None) -> torch.Tensor:
    """w (..., N, K) with its scale grid (and zero points) as float32."""
    grid = grid_scales(scale, w.shape)
    if grid is None:
        raise ValueError(f"scale of shape {list(scale.shape)} for a weight {list(w.shape)}")
    if e8m0:  # MXFP8's shared exponents: 2^(s - 127)
        grid = torch.exp2(grid.to(torch.float32) - 127.0)
    zeros = None if zero is None else grid_scales(zero, w.shape)
    return apply_grid(w.to(torch.float32), grid, block, zeros)


def _row(t: Tensors, index: int, key: str, scale_key: str, zero_key: str | None,
         block: tuple[int, int], e8m0: bool) -> torch.Tensor:
    """Expert `index` of a stacked (E, N, K) weight: its own rows of weight and scales
    (a scale shared by all experts read whole)."""

    experts = t.shape(key)[0]

    def part(name: str) -> torch.Tensor:
        shape = t.shape(name)
        if shape and shape[0] == experts and math.prod(shape) > 1:
            return t.read_row(name, index)  # the expert's own scales
        return t.read(name)  # one scale for all

    w = t.read_row(key, index)
    zero = None if zero_key is None else part(zero_key)
    return _dequantize(w, part(scale_key), block, e8m0, zero)


def _bnb_int8(module: Module, key: str, shape: tuple[int, ...], tensors: Tensors,
              folded: list[str]) -> Plan:
    scb = module.params["SCB"]
    if len(shape) != 2 or tensors.shape(scb) not in ((shape[0],), (shape[0], 1)):
        return refused(key, shape, key, folded,
                       f"bitsandbytes int8 SCB of shape {list(tensors.shape(scb))} does not "
                       f"fit the weight's {list(shape)}")

    def compute(t: Tensors) -> torch.Tensor:
        absmax = t.read(scb).to(torch.float32).reshape(-1, 1)
        return t.read(key).to(torch.float32).mul_(absmax / 127.0)

    return Plan(key, tuple(shape), key, tuple(folded), scheme="bnb-int8", compute=compute)
