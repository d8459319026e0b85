"""Integer weights packed into int32 words: GPTQ, AWQ (GEMM) and compressed-tensors
pack-quantized. Each is dequantized a slice of rows at a time into the float32 weight.

- GPTQ: `qweight` (in*bits/32, out), the inputs packed down the rows, first in the lowest
  bits; `qzeros` (groups, out*bits/32); `scales` (groups, out); `g_idx` (in) the group of
  each input (act-order), else input // group_size. W[o, i] = (q - z) * s of group g_idx[i],
  with z + 1 in the original format (AutoGPTQ stored zero - 1) and z as stored in
  checkpoint_format "gptq_v2". 2, 4 and 8 bits (3-bit words straddle: refused).
- AWQ GEMM: `qweight` (in, out*bits/32), the outputs packed across the columns in AWQ's
  order [0, 2, 4, 6, 1, 3, 5, 7]; `qzeros` (in/group, out*bits/32) packed the same way;
  `scales` (in/group, out); no g_idx. 4-bit only, as AWQ writes it.
- compressed-tensors pack-quantized: `weight_packed` (out, ceil(in*bits/32)), the inputs
  packed across the columns, first in the lowest bits, stored as the signed value plus
  2^(bits-1); `weight_shape` the logical shape; `weight_scale` (out, groups) or (out, 1);
  `weight_zero_point` (asymmetric) packed the same way down the rows. Bit widths that
  divide 32 (older releases padded each word for the others: ambiguous, refused).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from esd_worker.analysis.quant.plan import (
    CHUNK,
    Module,
    Plan,
    QuantConfig,
    apply_grid,
    block_size,
    grid_blocks,
    grid_name,
    grid_scales,
    refused,
    stacked,
    unpack,
)
from esd_worker.analysis.weights import Tensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # where AWQ puts output j of each word of eight
_INT_DTYPES = ("I32", "int32")
_BITS = (2, 4, 8)
_CANDIDATES = (4, 8, 2, 3, 5, 6, 7, 1)


def packed_plan(module: Module, tensors: Tensors, config: QuantConfig) -> Plan | None:
    """The plan of a GPTQ, AWQ or compressed-tensors packed module; None for others."""
    if "qweight" in module.params:
        return _gptq_or_awq(module, tensors, config)
    if "weight_packed" in module.params:
        return _compressed(module, tensors, config)
    return None


def _gptq_or_awq(module: Module, tensors: Tensors, config: QuantConfig) -> Plan:
    params = module.params
    stored, key = params["qweight"], module.key("weight")
    folded = [stored, *module.others("qweight")]
    qshape = tensors.shape(stored)
    missing = [p for p in ("qzeros", "scales") if p not in params]
    if missing or len(qshape) != 2 or tensors.dtype(stored) not in _INT_DTYPES:
        what = f"no {' or '.join(missing)}" if missing else (
            f"qweight {tensors.dtype(stored)} {list(qshape)}")
        return refused(key, _guessed(qshape, config), stored, folded,
                       f"packed int weight with {what}")
    zshape, sshape = tensors.shape(params["qzeros"]), tensors.shape(params["scales"])
    awq = "g_idx" not in params and len(sshape) == 2 and sshape[1] > qshape[1]
    method = config.method
    if method in ("gptq", "awq") and method != ("awq" if awq else "gptq"):
        return refused(key, qshape, stored, folded,
                       f"quant_method {method}, but the tensors are laid out as "
                       f"{'AWQ' if awq else 'GPTQ'}'s")
    if awq:
        return _awq(module, key, folded, qshape, zshape, sshape, config)
    return _gptq(module, key, folded, qshape, zshape, sshape, tensors, config)


def _guessed(qshape: tuple[int, ...], config: QuantConfig) -> tuple[int, ...]:
    """The logical shape of a qweight whose companions are missing, from the config's bit
    width (GPTQ unless it says AWQ); the stored shape when it names none."""
    named = config.bits()
    if len(qshape) != 2 or len(named) != 1 or 32 % named[0]:
        return qshape
    per = 32 // named[0]
    if config.method == "awq":
        return (qshape[1] * per, qshape[0])
    return (qshape[1], qshape[0] * per)


def _bits(words: int, values: int, config: QuantConfig, name: str, *,
          padded: bool = False) -> tuple[int | None, str]:
    """Bits per value from `values` packed into `words` int32 words (`padded`: the last
    word maybe part full), the config's bit widths first, and "" or why this code does not
    unpack them (the bits None when no width fits)."""
    named = config.bits()
    fits = [b for b in (*named, *_CANDIDATES) if 0 < b <= 8 and (
        math.ceil(values * b / 32) == words if padded else values * b == words * 32)]
    if not fits:
        of = f" (quantization_config says {named})" if named else ""
        return None, f"{name}: {values} values in {words} int32 words fit no bit width{of}"
    if fits[0] not in _BITS:
        return fits[0], f"{fits[0]}-bit {name} is not supported (2, 4 and 8 bits are)"
    return fits[0], ""


def _gptq(module: Module, key: str, folded: list[str], qshape: tuple[int, ...],
          zshape: tuple[int, ...], sshape: tuple[int, ...], tensors: Tensors,
          config: QuantConfig) -> Plan:
    params = module.params
    out = qshape[1]
    bits, why = _bits(zshape[-1] if len(zshape) == 2 else 0, out, config, "GPTQ")
    if bits is None or why:
        inputs = qshape[0] * 32 // bits if bits else qshape[0]
        return refused(key, (out, inputs), params["qweight"], folded, why)
    inputs = qshape[0] * 32 // bits
    shape = (out, inputs)
    groups = sshape[0] if len(sshape) == 2 else 0
    if sshape != (groups, out) or zshape != (groups, out * bits // 32) or groups < 1:
        return refused(key, shape, params["qweight"], folded,
                       f"GPTQ scales {list(sshape)} / qzeros {list(zshape)} do not fit "
                       f"qweight {list(qshape)}")
    fmt = str(config.raw.get("checkpoint_format") or config.raw.get("format") or "gptq")
    if fmt.lower() not in ("gptq", "gptq_v2", "gptq-v2"):
        return refused(key, shape, params["qweight"], folded,
                       f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are)")
    v1 = fmt.lower() == "gptq"
    group = config.integer("group_size")
    if group is None or group <= 0:
        # Only where the shapes allow one group size (block_size): else the groups' bounds
        # are unknown without g_idx, and a guess dequantizes wrongly.
        group = block_size(inputs, groups, [])
    if "g_idx" in params:
        if tensors.shape(params["g_idx"]) != (inputs,):
            return refused(key, shape, params["qweight"], folded,
                           f"GPTQ g_idx of shape {list(tensors.shape(params['g_idx']))} "
                           f"for {inputs} inputs")
        if group is None:
            group = _group_size(tensors.read(params["g_idx"]).to(torch.int64))
    elif group is None or math.ceil(inputs / group) != groups:
        return refused(key, shape, params["qweight"], folded,
                       f"GPTQ: {groups} groups for {inputs} inputs, and no group_size in "
                       "quantization_config nor g_idx to say where each begins")
    size = "channel" if groups == 1 else f"g{group}" if group else "gidx"

    def compute(t: Tensors) -> torch.Tensor:
        if "g_idx" in params:
            g_idx = t.read(params["g_idx"]).to(torch.int64)
        else:
            assert group is not None, "refused above without a group size"
            g_idx = torch.arange(inputs) // group
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"GPTQ g_idx of {key} names groups outside 0..{groups - 1}")
        zeros = unpack(t.read(params["qzeros"]), bits).to(torch.float32)
        return _by_input_rows(t.read(params["qweight"]), bits, 0, zeros + 1 if v1 else zeros,
                              t.read(params["scales"]).to(torch.float32), g_idx, None)

    return Plan(key, shape, params["qweight"], tuple(folded), scheme=f"gptq-int{bits}-{size}",
                compute=compute)


def _awq(module: Module, key: str, folded: list[str], qshape: tuple[int, ...],
         zshape: tuple[int, ...], sshape: tuple[int, ...], config: QuantConfig) -> Plan:
    params = module.params
    stored = params["qweight"]
    out = sshape[1]
    shape = (out, qshape[0])
    bits, why = _bits(qshape[1], out, config, "AWQ")
    if bits is None or why or bits != 4:
        return refused(key, shape, stored, folded, why or f"{bits}-bit AWQ is not supported")
    version = str(config.raw.get("version") or "gemm").lower()
    if version not in ("gemm", "exllama", "ipex"):
        return refused(key, shape, stored, folded,
                       f"AWQ version {version!r} is not supported (the GEMM layout is)")
    groups, inputs = sshape[0], qshape[0]
    group = config.integer("group_size")
    if group is None or group <= 0:
        group = block_size(inputs, groups, [])  # None: the shapes allow several sizes
    if group is None:
        return refused(key, shape, stored, folded,
                       f"AWQ: {groups} groups for {inputs} inputs, and no group_size in "
                       "quantization_config to say where each begins")
    if zshape != (groups, qshape[1]) or math.ceil(inputs / group) != groups:
        return refused(key, shape, stored, folded,
                       f"AWQ scales {list(sshape)} / qzeros {list(zshape)} do not fit "
                       f"qweight {list(qshape)} in groups of {group}")
    size = "channel" if groups == 1 else f"g{group}"

    def compute(t: Tensors) -> torch.Tensor:
        zeros = unpack(t.read(params["qzeros"]), bits, order=AWQ_ORDER).to(torch.float32)
        return _by_input_rows(t.read(stored), bits, -1, zeros,
                              t.read(params["scales"]).to(torch.float32),
                              torch.arange(inputs) // group, AWQ_ORDER)

    return Plan(key, shape, stored, tuple(folded), scheme=f"awq-int{bits}-{size}",
                compute=compute)


def _by_input_rows(qweight: torch.Tensor, bits: int, dim: int, zeros: torch.Tensor,
                   scales: torch.Tensor, g_idx: torch.Tensor,
                   order: tuple[int, ...] | None) -> torch.Tensor:
    """The (out, in) float32 weight of a GPTQ (inputs packed down the rows: dim 0) or AWQ
    (outputs packed across: dim -1) qweight, a slice of input rows at a time. Groups in
    order (input i in group i // size: no act-order) are broadcast over their rows, others
    gathered row by row."""
    per = 32 // bits
    rows_per_word = per if dim == 0 else 1
    inputs = qweight.shape[0] * rows_per_word
    out = zeros.shape[1]
    size = _group_size(g_idx)
    weight = torch.empty(out, inputs, dtype=torch.float32)
    step = max(1, CHUNK // max(1, out * rows_per_word))  # packed rows a slice
    if size is not None and size % rows_per_word == 0:  # slices of whole groups
        words = size // rows_per_word
        step = max(words, step // words * words)
    for r0 in range(0, qweight.shape[0], step):
        w = unpack(qweight[r0: r0 + step], bits, dim=dim, order=order).to(torch.float32)
        i0, n = r0 * rows_per_word, w.shape[0]
        if size is not None and i0 % size == 0 and n % size == 0:
            g0, g1 = i0 // size, (i0 + n) // size
            grouped = w.view(g1 - g0, size, out)
            grouped.sub_(zeros[g0:g1, None]).mul_(scales[g0:g1, None])
        else:
            g = g_idx[i0: i0 + n]
            w.sub_(zeros[g]).mul_(scales[g])
        weight[:, i0: i0 + n] = w.T
    return weight


def _group_size(g_idx: torch.Tensor) -> int | None:
    """The group size when input i is in group i // size (no act-order), else None."""
    n = g_idx.numel()
    if n == 0 or int(g_idx[0]) != 0:
        return None
    size = int((g_idx == 0).sum())
    return size if torch.equal(g_idx, torch.arange(n) // size) else None


def _compressed(module: Module, tensors: Tensors, config: QuantConfig) -> Plan:
    params = module.params
    stored, key = params["weight_packed"], module.key("weight")
    folded = [stored, *module.others("weight_packed")]
    pshape = tensors.shape(stored)
    fmt = str(config.raw.get("format") or "pack-quantized")
    if tensors.dtype(stored) not in _INT_DTYPES:
        why = (f"compressed-tensors {fmt} ({tensors.dtype(stored)} weight_packed) is not "
               "supported (int pack-quantized is)")
        return refused(key, pshape, stored, folded, why)
    if "weight_shape" not in params or "weight_scale" not in params:
        return refused(key, pshape, stored, folded,
                       "compressed-tensors weight_packed without weight_shape or weight_scale")
    shape = tuple(int(v) for v in tensors.read(params["weight_shape"]).reshape(-1).tolist())
    if len(shape) != len(pshape) or shape[:-1] != pshape[:-1]:
        return refused(key, shape, stored, folded,
                       f"compressed-tensors weight_shape {list(shape)} for weight_packed "
                       f"{list(pshape)}")
    bits, why = _bits(pshape[-1], shape[-1], config, "compressed-tensors pack-quantized",
                      padded=True)
    if bits is None or why:
        return refused(key, shape, stored, folded, why)
    sshape = tensors.shape(params["weight_scale"])
    grid = grid_scales(torch.empty(sshape, device="meta"), shape)
    hints = config.blocks()
    block = None if grid is None else grid_blocks(tuple(grid.shape), shape, hints)
    if grid is None or block is None or block[0] not in (1, shape[-2]):
        return refused(key, shape, stored, folded,
                       f"compressed-tensors weight_scale {list(sshape)} does not fit the "
                       f"weight's {list(shape)}")
    g_shape = tensors.shape(params["weight_g_idx"]) if "weight_g_idx" in params else None
    if g_shape is not None and g_shape[-1:] != shape[-1:]:
        return refused(key, shape, stored, folded,
                       f"compressed-tensors weight_g_idx {list(g_shape)} for {shape[-1]} inputs")
    name = f"compressed-int{bits}-{grid_name(tuple(grid.shape), block, shape)}"

    def row(t: Tensors, index: int | None) -> torch.Tensor:
        def part(name: str) -> torch.Tensor:
            if index is None or t.shape(name)[:1] != shape[:1]:
                return t.read(name)  # 2-D, or one for all experts
            return t.read_row(name, index)

        zero, g_idx = params.get("weight_zero_point"), params.get("weight_g_idx")
        return _packed_rows(part(stored), bits, shape[-2:], part(params["weight_scale"]),
                            None if zero is None else part(zero), block,
                            None if g_idx is None else part(g_idx).to(torch.int64))

    def compute(t: Tensors) -> torch.Tensor:
        if len(shape) == 2:
            return row(t, None)
        return stacked(partial(row, t), shape)

    return Plan(key, shape, stored, tuple(folded), scheme=name, compute=compute,
                row=None if len(shape) < 3 else row)


def _packed_rows(packed: torch.Tensor, bits: int, shape: tuple[int, ...],
                 scale: torch.Tensor, zero: torch.Tensor | None, block: tuple[int, int],
                 g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """One (out, in) compressed-tensors packed weight as float32, a slice of rows at a
    time: (signed value - zero point) * scale over the scale grid, or of the group
    `g_idx` names for each input (activation order)."""
    out, inputs = shape
    offset = float(1 << (bits - 1))
    grid = grid_scales(scale, shape)
    assert grid is not None
    zeros = None
    if zero is not None and zero.dim() == 2 and zero.dtype == torch.int32 and (
            zero.shape[0] == math.ceil(out * bits / 32) != out):
        # groups, channels: packed down the rows as the weight is across, signed + offset
        zeros = grid_scales(unpack(zero, bits, dim=0)[:out].to(torch.float32) - offset, shape)
    elif zero is not None:  # per tensor: the signed value as it is
        zeros = grid_scales(zero.to(torch.float32), shape)
    if g_idx is not None and int(g_idx.max()) >= grid.shape[-1]:
        raise ValueError(f"weight_g_idx names group {int(g_idx.max())} of {grid.shape[-1]}")
    weight = torch.empty(out, inputs, dtype=torch.float32)
    step = max(1, CHUNK // max(1, inputs))
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        w = unpack(packed[r0:r1], bits)[:, :inputs].to(torch.float32).sub_(offset)
        s = grid[r0:r1] if grid.shape[-2] == out else grid
        z = None if zeros is None else zeros[r0:r1] if zeros.shape[-2] == out else zeros
        if g_idx is None:
            weight[r0:r1] = apply_grid(w, s, (1, block[1]), z)
            continue
        if z is not None:
            w.sub_(z.to(torch.float32)[:, g_idx])
        weight[r0:r1] = w.mul_(s.to(torch.float32)[:, g_idx])
    return weight
