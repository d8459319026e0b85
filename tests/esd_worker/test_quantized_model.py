"""A tiny quantized Llama-style model folder (config.json with quantization_config beside
quantized safetensors) analysed end to end: each quantized layer's spectrum is that of its
dequantized weight, and a weight that cannot be dequantized gets a status row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.esd_worker import quantizing as q
from tests.support.builders import make_llama, run_analysis

REFUSED = "model.layers.1.mlp.down_proj"  # stored float8 with no scale


def _quantized_llama(directory: Path, scheme: str) -> tuple[Path, dict[str, q.Quantized]]:
    """make_llama's model with every block projection quantized by `scheme` (embeddings,
    norms and lm_head kept in float32, as quantizers leave them), one projection of the
    FP8 model stored with no scale; the quantized layers by name."""
    base = make_llama(directory / "base")
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    stored: dict[str, torch.Tensor] = {}
    layers: dict[str, q.Quantized] = {}
    qconfig: dict[str, Any] | None = None
    for key, weight in tensors.items():
        module = key.removesuffix(".weight")
        if not (key.startswith("model.layers.") and key.endswith("_proj.weight")):
            stored[key] = weight
        elif scheme == "fp8" and module == REFUSED:
            stored[key] = weight.to(torch.float8_e4m3fn)
        else:
            case = (q.fp8_blocks(weight=weight, block=(16, 16), module=module) if scheme == "fp8"
                    else q.gptq(weight=weight, group=16, sym=False, module=module))
            stored |= case.tensors
            layers[module] = case
            qconfig = case.config
    folder = directory / scheme
    folder.mkdir()
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": qconfig}))
    return folder, layers


@pytest.mark.parametrize("scheme, name", [("fp8", "fp8-e4m3-block16x16"),
                                          ("gptq", "gptq-int4-g16")])
def test_quantized_layers_have_the_spectra_of_their_dequantized_weights(
        scheme: str, name: str, tmp_path: Path) -> None:
    folder, layers = _quantized_llama(tmp_path, scheme)
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    assert result.marker["layer_discovery"] == "architecture"
    assert len(layers) == (13 if scheme == "fp8" else 14)
    for layer, case in layers.items():
        row = result.row(layer)
        assert row["status"] == "ok", row
        weight = case.reference.double()
        assert (int(row["M"]), int(row["N"])) == tuple(weight.shape)
        top = float(torch.linalg.svdvals(weight)[0]) ** 2
        assert float(row["spectral_norm"]) == pytest.approx(top, rel=1e-4)
        np.testing.assert_allclose(
            result.eigs[layer], np.sort(torch.linalg.svdvals(weight).numpy() ** 2),
            rtol=1e-6, atol=1e-9 * top)
        if "quantization" in row:  # the lead's column (modellayers.py), when it is there
            assert row["quantization"] == name
    head = result.row("lm_head")
    assert head["status"] == "ok" and not head.get("quantization")
    if scheme == "fp8":
        refused = result.row(REFUSED)
        # Never analysed raw: unsupported_quantization with the lead's status, else the
        # placeholder's unsupported_dtype.
        assert refused["status"] in ("unsupported_quantization", "unsupported_dtype")
        assert REFUSED not in result.eigs
        assert (int(refused["M"]), int(refused["N"])) == (32, 64)


def test_gpt_oss_mxfp4_experts_are_analysed_expert_by_expert(tmp_path: Path) -> None:
    """A tiny GPT-OSS whose experts are stored as MXFP4 blocks and scales: each expert's
    row has the spectrum of transformers' dequantization of its slice."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=3, num_experts_per_tok=1,
        vocab_size=64, layer_types=["full_attention"])
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in GptOssForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    references = {}
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{name}"
        experts, inputs, outputs = state.pop(key).shape  # held (E, in, out)
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen,
                               dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(120, 130, (experts, outputs, inputs // 32), generator=gen,
                               dtype=torch.int32).to(torch.uint8)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        references[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_dict() | {
        "architectures": ["GptOssForCausalLM"], "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens",
                                                                "lm_head"]}}))
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    for name, reference in references.items():
        for expert in range(reference.shape[0]):
            row = result.row(f"model.layers.0.mlp.experts.{expert}.{name}")
            weight = reference[expert].double()
            assert row["status"] == "ok"
            assert (int(row["M"]), int(row["N"])) == tuple(weight.shape)
            top = float(torch.linalg.svdvals(weight)[0]) ** 2
            assert float(row["spectral_norm"]) == pytest.approx(top, rel=1e-4)
            if "quantization" in row:
                assert row["quantization"] == "mxfp4"
