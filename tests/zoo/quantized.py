"""The zoo's quantized checkpoints, written by hand in each scheme's published layout, and the
scheme's reference dequantization of what was written (what the checker compares with).

- fp8 block (DeepSeek-V3 / transformers' FineGrainedFP8): `weight` float8_e4m3fn and
  `weight_scale_inv` float32 of shape ceil(out/128) × ceil(in/128);
  W = weight · scale_inv[i // 128, j // 128]. Sizes make partial blocks (160 = 128 + 32).
  Also on a tiny DeepSeek-V3 (every expert's 2-D matrix quantized, the router not).
- MXFP4 (GPT-OSS's experts): `gate_up_proj_blocks` / `down_proj_blocks` uint8 (E, out,
  in/32, 16), two FP4 (e2m1) codes a byte, the low nibble first, and `*_scales` uint8
  (E, out, in/32), an e8m0 exponent biased by 127: W[e, o, 32b + k] = FP4[code] · 2^(s − 127).
- fp8 per tensor (AutoFP8's `quant_method: fp8`, static activations): `weight` float8_e4m3fn,
  `weight_scale` a float32 scalar, `input_scale`; W = weight · weight_scale.
- GPTQ int4 (AutoGPTQ's "gptq" checkpoint format, desc_act with a permuted g_idx,
  asymmetric): `qweight` int32 (in/8, out), eight 4-bit values per word along the input,
  lowest bits first; `qzeros` int32 (groups, out/8), the zero point minus one (the v1
  format's offset); `scales` float16 (groups, out); `g_idx` int32 (in,);
  W[o, i] = scales[g_idx[i], o] · (q[i, o] − (qzeros[g_idx[i], o] + 1)).
- compressed-tensors float-quantized (FP8 per output channel): `weight` float8_e4m3fn,
  `weight_scale` float32 (out, 1); W = weight · weight_scale.
- compressed-tensors pack-quantized (int4 W4A16, symmetric, groups of 16 inputs):
  `weight_packed` int32 (out, in/8) packed by compressed_tensors' own pack_to_int32 (values
  offset by 8), `weight_scale` bfloat16 (out, in/16), `weight_shape`; unpacked by its
  unpack_from_int32, W = q · weight_scale[o, i // 16].
- bitsandbytes nf4 with double quantization: quantized by transformers with bitsandbytes on
  the CPU and saved. `weight` uint8, two 4-bit codes a byte (the first in the high bits);
  `weight.quant_map` the 16 NF4 levels; `weight.absmax` uint8 codes of each block's absmax,
  themselves quantized: absmax = nested_quant_map[code] · nested_absmax[block //
  nested_blocksize] + nested_offset (sizes and offset in `weight.quant_state.bitsandbytes__nf4`,
  JSON); W = quant_map[q] · absmax[block], reshaped to the JSON's shape. (bitsandbytes
  0.50.2's own CPU dequantize_4bit gives other values for this checkpoint, 45% off on λ_max
  and three times further from the weights quantized than this formula: it is not used.)
Layers not quantized (embeddings, norms, lm_head) are stored in bfloat16 or float16 as the
tools leave them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.zoo.hf import spec

FP8_MAX = 448.0
BLOCK = 128
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _llama(seed: int, **overrides: Any) -> Any:
    import transformers

    torch.manual_seed(seed)
    kwargs = {**dict(spec("llama").kwargs), **overrides}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()


def _is_quantized(key: str) -> bool:
    return key.endswith(".weight") and any(f".{p}." in key for p in _QUANTIZED)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def build_mxfp4(directory: Path) -> Path:
    """A tiny GPT-OSS whose expert stacks are MXFP4 (intermediate 32: whole 32-blocks)."""
    import transformers

    from tests.zoo.hf import hf_model

    model = hf_model(replace(spec("gpt_oss"), kwargs={**spec("gpt_oss").kwargs,
                                                      "intermediate_size": 32}), seed=27)
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key] = w.to(torch.bfloat16)
            continue
        stored = w.transpose(1, 2)  # transformers holds (E, in, out); the file (E, out, in)
        blocks = stored.reshape(*stored.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(blocks.abs().amax(dim=3) / 6)).clamp(-127, 127)
        scaled = blocks / torch.exp2(exponent)[..., None]
        codes = (scaled[..., None] - FP4.float()).abs().argmin(dim=-1)  # nearest FP4 value
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        out[key + "_blocks"] = packed
        out[key + "_scales"] = (exponent + 127).to(torch.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    assert isinstance(model.config, transformers.GptOssConfig)
    return _save(directory, model, out, {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})


def _save(directory: Path, model: Any, tensors: Mapping[str, torch.Tensor],
          quantization: Mapping[str, Any]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["quantization_config"] = dict(quantization)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def _as_saved(model: Any, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as save_pretrained writes them (a MoE's experts one by one)."""
    from safetensors.torch import load_file

    model.save_pretrained(scratch)
    tensors = {}
    for path in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def build_fp8_block(directory: Path, *, scratch: Path, moe: bool = False) -> Path:
    if moe:
        from tests.zoo.hf import hf_model

        model = hf_model(spec("deepseek_v3"), seed=26)
    else:
        model = _llama(20, hidden_size=48, intermediate_size=160, num_attention_heads=2,
                       num_key_value_heads=1)
    out: dict[str, torch.Tensor] = {}
    for key, w in _as_saved(model, scratch / directory.name).items():
        if not _is_quantized(key) or w.dim() != 2:
            out[key] = w.to(torch.bfloat16)
            continue
        rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
        scale = torch.empty(rows, cols)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                scale[i, j] = block.abs().max() / FP8_MAX
                q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (
                    block / scale[i, j]).to(torch.float8_e4m3fn)
        out[key] = q
        out[key + "_scale_inv"] = scale
    return _save(directory, model, out, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]})


def build_fp8_tensor(directory: Path) -> Path:
    model = _llama(21)
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        if not _is_quantized(key):
            out[key] = w.to(torch.bfloat16)
            continue
        scale = w.abs().max() / FP8_MAX
        out[key] = (w / scale).to(torch.float8_e4m3fn)
        out[key.removesuffix("weight") + "weight_scale"] = scale.reshape(())
        out[key.removesuffix("weight") + "input_scale"] = torch.tensor(0.01)
    return _save(directory, model, out, {"quant_method": "fp8", "activation_scheme": "static"})


def build_compressed_fp8(directory: Path) -> Path:
    model = _llama(22)
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        if not _is_quantized(key):
            out[key] = w.to(torch.bfloat16)
            continue
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        out[key] = (w / scale).to(torch.float8_e4m3fn)
        out[key.removesuffix("weight") + "weight_scale"] = scale
    group = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                         "symmetric": True, "dynamic": False, "group_size": None}}
    return _save(directory, model, out, {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group},
        "ignore": ["lm_head"], "kv_cache_scheme": None})


PACKED_GROUP = 16


def build_compressed_int4(directory: Path) -> Path:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    model = _llama(25)
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        if not _is_quantized(key):
            out[key] = w.to(torch.bfloat16)
            continue
        groups = w.reshape(w.shape[0], -1, PACKED_GROUP)
        scale = (groups.abs().amax(dim=2) / 7).to(torch.bfloat16)
        q = torch.clamp(torch.round(groups / scale.float()[:, :, None]), -8, 7)
        out[key + "_packed"] = pack_to_int32(q.reshape(w.shape).to(torch.int8), 4)
        out[key + "_scale"] = scale
        out[key + "_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    group = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                         "group_size": PACKED_GROUP, "symmetric": True, "dynamic": False,
                         "observer": "minmax"}}
    return _save(directory, model, out, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group},
        "ignore": ["lm_head"], "kv_cache_scheme": None})


GPTQ_GROUP = 16


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values (0..15) packed eight to an int32 along `dim`, lowest bits first."""
    v = values.to(torch.int64).movedim(dim, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    shifts = (torch.arange(8, dtype=torch.int64) * 4).reshape(1, 8, *([1] * (v.dim() - 2)))
    word = (v << shifts).sum(dim=1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # two's complement int32
    return word.to(torch.int32).movedim(0, dim).contiguous()


def unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit values of int32 words packed along `dim` (the inverse of _pack)."""
    w = words.to(torch.int64).movedim(dim, 0) & 0xFFFFFFFF
    shifts = (torch.arange(8, dtype=torch.int64) * 4).reshape(1, 8, *([1] * (w.dim() - 1)))
    v = (w.unsqueeze(1) >> shifts) & 0xF
    return v.reshape(w.shape[0] * 8, *w.shape[1:]).movedim(0, dim)


def build_gptq(directory: Path) -> Path:
    model = _llama(23, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1)
    gen = torch.Generator().manual_seed(23)
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        if not _is_quantized(key):
            out[key] = w.to(torch.float16)
            continue
        n_out, n_in = w.shape
        groups = n_in // GPTQ_GROUP
        order = torch.randperm(n_in, generator=gen)  # desc_act: groups follow an order
        g_idx = torch.empty(n_in, dtype=torch.int32)
        g_idx[order] = (torch.arange(n_in) // GPTQ_GROUP).to(torch.int32)
        scales = torch.empty(groups, n_out)
        zeros = torch.empty(groups, n_out, dtype=torch.int64)
        q = torch.empty(n_in, n_out, dtype=torch.int64)
        wt = w.t()  # (in, out)
        for g in range(groups):
            rows = g_idx == g
            lo, hi = wt[rows].amin(dim=0), wt[rows].amax(dim=0)
            scale = ((hi - lo) / 15).to(torch.float16).float()
            zero = torch.clamp(torch.round(-lo / scale), 1, 15).to(torch.int64)
            scales[g], zeros[g] = scale, zero
            q[rows] = torch.clamp(torch.round(wt[rows] / scale) + zero, 0, 15).to(torch.int64)
        prefix = key.removesuffix("weight")
        out[prefix + "qweight"] = _pack(q, 0)
        out[prefix + "qzeros"] = _pack(zeros - 1, 1)
        out[prefix + "scales"] = scales.to(torch.float16)
        out[prefix + "g_idx"] = g_idx
    return _save(directory, model, out, {
        "quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": True,
        "sym": False, "checkpoint_format": "gptq", "damp_percent": 0.01,
        "static_groups": False, "true_sequential": True})


def build_bnb_nf4(directory: Path, *, scratch: Path) -> Path:
    import transformers

    from tests.zoo.hf import build_hf

    base = build_hf(spec("llama"), scratch / "bnb-base", seed=24)
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(base), quantization_config=config, device_map="cpu")
    model.save_pretrained(directory)
    return directory


# --- the reference dequantization of what was written ---------------------------------------

def dequantized(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored tensors of a quantized checkpoint as float64 weights, each by its scheme's
    formula (the scheme told by the companions stored beside it, which are folded away);
    other tensors as stored."""
    out: dict[str, torch.Tensor] = {}
    companions = ("_scale_inv", "_scale", "input_scale", "qzeros", "scales", "g_idx",
                  "weight_shape", "_scales")
    for key, value in tensors.items():
        if key.endswith(companions) or ".weight." in key:
            continue
        if key + ".quant_map" in tensors:
            out[key] = _nf4(tensors, key)
            continue
        prefix = key.removesuffix("qweight")
        if key.endswith(".qweight"):
            out[prefix + "weight"] = _gptq(tensors, prefix)
        elif key.endswith("_blocks") and key.removesuffix("blocks") + "scales" in tensors:
            out[key.removesuffix("_blocks")] = _mxfp4(tensors, key.removesuffix("_blocks"))
        elif key.endswith(".weight_packed"):
            out[key.removesuffix("_packed")] = _packed(tensors, key.removesuffix("_packed"))
        elif value.dtype == torch.float8_e4m3fn:
            out[key] = _fp8(tensors, key)
        else:
            out[key] = value.to(torch.float64)
    return out


def _fp8(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    w = tensors[key].to(torch.float64)
    if key + "_scale_inv" in tensors:
        s = tensors[key + "_scale_inv"].to(torch.float64)
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return w * s[: w.shape[0], : w.shape[1]]
    s = tensors[key + "_scale"].to(torch.float64)
    return w * (s if s.dim() == 2 else s.reshape(()))


def _gptq(tensors: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    q = unpack(tensors[prefix + "qweight"], 0)  # (in, out)
    zeros = unpack(tensors[prefix + "qzeros"], 1) + 1  # (groups, out)
    scales = tensors[prefix + "scales"].to(torch.float64)
    g = tensors[prefix + "g_idx"].to(torch.int64)
    return (scales[g] * (q - zeros[g]).to(torch.float64)).t().contiguous()  # (out, in)



def _nf4(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    state_key = next(k for k in tensors if k.startswith(key + ".quant_state."))
    state = json.loads(bytes(tensors[state_key].tolist()).decode())
    packed = tensors[key].flatten().to(torch.int64)
    codes = torch.stack([(packed >> 4) & 0xF, packed & 0xF], dim=1).flatten()
    levels = tensors[key + ".quant_map"].to(torch.float64)
    absmax = tensors[key + ".absmax"]
    if key + ".nested_absmax" in tensors:
        nested = tensors[key + ".nested_absmax"].to(torch.float64)
        blocks = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        absmax = (tensors[key + ".nested_quant_map"].to(torch.float64)[absmax.to(torch.int64)]
                  * nested[blocks] + float(state["nested_offset"]))
    shape = [int(n) for n in state["shape"]]
    count = math.prod(shape)
    values = levels[codes[:count]].reshape(-1, int(state["blocksize"]))
    return (values * absmax.to(torch.float64)[:, None]).reshape(shape)


def _packed(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = torch.Size(int(n) for n in tensors[key + "_shape"].tolist())
    q = unpack_from_int32(tensors[key + "_packed"], 4, shape).to(torch.float64)
    scale = tensors[key + "_scale"].to(torch.float64)
    return q * scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


def _mxfp4(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    packed = tensors[key + "_blocks"].to(torch.int64)
    values = torch.stack([FP4[packed & 0xF], FP4[packed >> 4]], dim=-1).flatten(-2)
    scale = torch.exp2(tensors[key + "_scales"].to(torch.float64) - 127)
    return (values * scale[..., None]).flatten(-2)  # (E, out, in)
