"""Tiny quantized checkpoints for tests/esd_worker/test_quantized*.py: each builder quantizes
a float matrix by one scheme's layout and returns the tensors as that scheme stores them
(under `<module>.`), the quantization_config it writes, and the reference dequantization:
the scheme's own library where it runs on the CPU (bitsandbytes, compressed-tensors,
transformers' FP8 and MXFP4 functions), else the published formula written out here from
the integers before packing (GPTQ, AWQ: no CPU library)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    """`tensors` as stored; `config` the quantization_config (None: none); `reference` the
    float32 weight the scheme's own dequantization gives; `scheme` the name expected."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None
    reference: torch.Tensor
    scheme: str
    key: str = "layer.weight"
    extra: dict[str, Any] = field(default_factory=dict)


def _pack_words(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """Unsigned `bits`-bit integers (last dim a multiple of 32 // bits) packed into int32
    words along the last dim, value j of each word in bits j*bits.. (`order`: the element
    placed at position j)."""
    per = 32 // bits
    v = values.to(torch.int64).unflatten(-1, (-1, per))
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., j] << (bits * j) for j in range(per))
    assert isinstance(words, torch.Tensor)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _asym(w: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (1..2^bits-1, so that GPTQ's v1 format holds it) along `dim`."""
    top = (1 << bits) - 1
    lo, hi = w.amin(dim).clamp(max=0), w.amax(dim).clamp(min=0)
    scale = ((hi - lo) / top).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(1, top)
    return scale, zero


def gptq(out: int = 64, inputs: int = 96, *, bits: int = 4, group: int = 32,
         sym: bool = True, act_order: bool = False, v2: bool = False,
         seed: int = 0, weight: torch.Tensor | None = None, module: str = "layer"
         ) -> Quantized:
    """GPTQ (AutoGPTQ/GPTQModel): qweight (in*bits/32, out), qzeros (groups, out*bits/32)
    holding zero - 1 unless v2, scales (groups, out) fp16, g_idx (in). Reference: W[o, i] =
    scales[g[i], o] * (q[i, o] - zero[g[i], o]). `weight` (out, in): quantize it instead."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(inputs, out, generator=gen) if weight is None else weight.T.float()
    inputs, out = w.shape
    groups = math.ceil(inputs / group)
    g_idx = (torch.randperm(inputs, generator=gen) if act_order else torch.arange(inputs)) // group
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out)
    for j in range(groups):
        s, z = _asym(w[g_idx == j], bits, 0)
        if sym:
            z = torch.full_like(z, 1 << (bits - 1))
        scales[j], zeros[j] = s, z
    scales = scales.half().float()  # stored in fp16: the reference uses what is stored
    q = torch.clamp(torch.round(w / scales[g_idx]) + zeros[g_idx], 0, (1 << bits) - 1)
    stored_zeros = zeros if v2 else zeros - 1
    tensors = {
        f"{module}.qweight": _pack_words(q.T, bits).T.contiguous(),
        f"{module}.qzeros": _pack_words(stored_zeros, bits),
        f"{module}.scales": scales.half(),
        f"{module}.g_idx": g_idx.to(torch.int32),
    }
    if weight is None:
        tensors[f"{module}.bias"] = torch.zeros(out, dtype=torch.float16)
    reference = (scales[g_idx] * (q - zeros[g_idx])).T.contiguous()
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
              "desc_act": act_order, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return Quantized(tensors, config, reference, f"gptq-int{bits}-g{group}",
                     key=f"{module}.weight")


def awq(out: int = 64, inputs: int = 96, *, group: int = 32, seed: int = 0) -> Quantized:
    """AWQ GEMM (AutoAWQ): qweight (in, out/8) in AWQ_ORDER, qzeros (groups, out/8) the
    same, scales (groups, out) fp16. Reference: W[o, i] = (q[i, o] - z[i//g, o]) * s."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(inputs, out, generator=gen)
    groups = inputs // group
    scale, zero = _asym(w.unflatten(0, (groups, group)), 4, 1)
    scale = scale.half().float()
    g = torch.arange(inputs) // group
    q = torch.clamp(torch.round(w / scale[g]) + zero[g], 0, 15)
    tensors = {
        "layer.qweight": _pack_words(q, 4, AWQ_ORDER),
        "layer.qzeros": _pack_words(zero, 4, AWQ_ORDER),
        "layer.scales": scale.half(),
    }
    reference = ((q - zero[g]) * scale[g]).T.contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    return Quantized(tensors, config, reference, f"awq-int4-g{group}")


def fp8_blocks(shape: tuple[int, ...] = (300, 200), *, block: tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.float8_e4m3fn, config: bool = True,
               seed: int = 0, weight: torch.Tensor | None = None, module: str = "layer"
               ) -> Quantized:
    """DeepSeek-V3 / transformers FineGrainedFP8: weight float8, weight_scale_inv one per
    block (partial at the edges). Reference: transformers' _dequantize_fp8_weight.
    `weight`: quantize it instead."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) if weight is None else weight.float()
    shape = tuple(w.shape)
    rows, cols = shape[-2:]
    grid = (*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(*shape[:-2], grid[-2] * block[0], grid[-1] * block[1])
    padded[..., :rows, :cols] = w
    amax = padded.unflatten(-1, (grid[-1], block[1])).unflatten(-3, (grid[-2], block[0]))
    scale = amax.abs().amax(dim=(-3, -1)) / torch.finfo(dtype).max
    full = scale.repeat_interleave(block[0], -2)[..., :rows, :]
    full = full.repeat_interleave(block[1], -1)[..., :cols]
    q = (w / full).to(dtype)
    reference = _dequantize_fp8_weight(q, scale, list(block), torch.float32)
    name = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": name,
               "weight_block_size": list(block)} if config else None
    return Quantized({f"{module}.weight": q, f"{module}.weight_scale_inv": scale}, qconfig,
                     reference, f"fp8-{name}-block{block[0]}x{block[1]}",
                     key=f"{module}.weight")


def _ct_config(fmt: str, weights: dict[str, Any]) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"]}


def compressed(fmt: str, weights: dict[str, Any], shape: tuple[int, int] = (48, 96), *,
               seed: int = 0) -> Quantized:
    """compressed-tensors: the weight quantized with the library's own qparams and
    compressed by its compressor for `fmt`; reference: the library's decompression (fp4
    in float32 with its own unpack and dequantize)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    strategy = str(getattr(args.strategy, "value", args.strategy) or "tensor")
    state: dict[str, torch.Tensor] = {"weight": w}
    global_scale = None
    if strategy == "tensor_group":
        global_scale = generate_gparam(w.amin(), w.amax())
        state["weight_global_scale"] = global_scale
    if strategy in ("group", "tensor_group"):
        grouped = w.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif strategy == "block":
        bh, bw = args.block_structure
        padded = torch.nn.functional.pad(w, (0, -w.shape[1] % bw, 0, -w.shape[0] % bh))
        blocks = padded.unflatten(1, (-1, bw)).unflatten(0, (-1, bh))
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale
    if not args.symmetric:
        state["weight_zero_point"] = zero
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress(state, scheme)
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        reference = _fp4_reference(stored, args, fmt)
    else:
        reference = compressor.decompress(dict(stored), scheme)["weight"].float()
    tensors = {f"layer.{k}": v.contiguous() for k, v in stored.items()}
    return Quantized(tensors, _ct_config(fmt, weights), reference, "")


def _fp4_reference(stored: dict[str, torch.Tensor], args: Any, fmt: str) -> torch.Tensor:
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = stored["weight_packed"]
    m, n = packed.shape
    codes = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    scale = stored["weight_scale"]
    scale = (scale.float() if fmt.startswith("nv") else decompress_mx_scale(scale).float())
    return dequantize(x_q=codes, scale=scale, args=args,
                      global_scale=stored.get("weight_global_scale"), dtype=torch.float32)


def bnb4(shape: tuple[int, int] = (40, 72), *, quant_type: str = "nf4", nested: bool = False,
         blocksize: int = 64, seed: int = 0) -> Quantized:
    """bitsandbytes 4-bit as transformers saves Params4bit (weight + weight.* state);
    reference: bitsandbytes' own dequantize_4bit."""
    import bitsandbytes.functional as bnbf

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    q, state = bnbf.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                                  compress_statistics=nested)
    reference = bnbf.dequantize_4bit(q, state).float()
    tensors = {"layer.weight": q} | {
        f"layer.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    config = {"quant_method": "bitsandbytes", "load_in_4bit": True,
              "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": nested}
    return Quantized(tensors, config, reference, f"bnb-{quant_type}")


def bnb8(shape: tuple[int, int] = (40, 72), *, seed: int = 0) -> Quantized:
    """bitsandbytes LLM.int8: weight int8 + SCB; reference: int8_vectorwise_dequant."""
    import bitsandbytes.functional as bnbf

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    cb, scb, _ = bnbf.int8_vectorwise_quant(w)
    reference = bnbf.int8_vectorwise_dequant(cb, scb).float()
    tensors = {"layer.weight": cb, "layer.SCB": scb,
               "layer.weight_format": torch.tensor([0], dtype=torch.uint8)}
    return Quantized(tensors, {"quant_method": "bitsandbytes", "load_in_8bit": True},
                     reference, "bnb-int8")


def gpt_oss(experts: int = 3, rows: int = 24, groups: int = 2, *, seed: int = 0
            ) -> Quantized:
    """GPT-OSS MXFP4 experts: `<p>_blocks` (E, rows, groups, 16), `<p>_scales`
    (E, rows, groups); reference: transformers' convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(120, 132, (experts, rows, groups), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    tensors = {"mlp.experts.gate_up_proj_blocks": blocks,
               "mlp.experts.gate_up_proj_scales": scales,
               "mlp.experts.gate_up_proj_bias": torch.zeros(experts, rows)}
    return Quantized(tensors, {"quant_method": "mxfp4"}, reference, "mxfp4",
                     key="mlp.experts.gate_up_proj")


def fp8_fused_experts(experts: int = 3, *, seed: int = 0) -> Quantized:
    """transformers' FP8 fused experts: `experts.gate_up_proj` float8 (E, out, in) with
    `experts.gate_up_proj_scale_inv` (E, out/32, in/32), and a down_proj the same way."""
    gate_up = fp8_blocks((experts, 64, 48), block=(32, 32), seed=seed)
    down = fp8_blocks((experts, 48, 32), block=(32, 32), seed=seed + 1)
    tensors = {
        "mlp.experts.gate_up_proj": gate_up.tensors["layer.weight"],
        "mlp.experts.gate_up_proj_scale_inv": gate_up.tensors["layer.weight_scale_inv"],
        "mlp.experts.down_proj": down.tensors["layer.weight"],
        "mlp.experts.down_proj_scale_inv": down.tensors["layer.weight_scale_inv"],
        "mlp.experts.down_proj_bias": torch.zeros(experts, 48),
    }
    return Quantized(tensors, gate_up.config, gate_up.reference, "fp8-e4m3-block32x32",
                     key="mlp.experts.gate_up_proj", extra={"down": down.reference})


def compressed_act_order(shape: tuple[int, int] = (48, 96), *, group: int = 32,
                         seed: int = 0) -> Quantized:
    """compressed-tensors int4 with activation order (releases before 2026/08 wrote
    `weight_g_idx`, the group of each input): packed by the library's pack_to_int32;
    reference: the published formula W[o, i] = q[o, i] * scale[o, g_idx[i]]."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    out, inputs = shape
    g_idx = torch.randperm(inputs, generator=gen) // group
    scale = torch.stack([w[:, g_idx == j].abs().amax(1) / 7
                         for j in range(inputs // group)], dim=1)
    codes = torch.clamp(torch.round(w / scale[:, g_idx]), -8, 7).to(torch.int8)
    tensors = {"layer.weight_packed": pack_to_int32(codes, 4), "layer.weight_scale": scale,
               "layer.weight_shape": torch.tensor([out, inputs]),
               "layer.weight_g_idx": g_idx.to(torch.int32)}
    config = _ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                           "strategy": "group", "group_size": group,
                                           "actorder": "group"})
    return Quantized(tensors, config, codes.float() * scale[:, g_idx], f"compressed-int4-g{group}")
