"""Adapters the merge refuses: methods that change no weight matrix (nothing to analyse but
the base), methods and options not merged, and adapters whose config and weights disagree.
Each is a permanent error (exit 3) with one clear line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from esd_worker.analysis.adapters import check_supported
from esd_worker.core.errors import EXIT_PERMANENT, PermanentModelError, UnsupportedAdapterError
from tests.esd_worker.test_adapters import make_method_adapter
from tests.support.builders import BackgroundRun, run_analysis

NO_WEIGHT = "changes no weight matrix of its base model, so there is nothing to analyse"


def _prompt_configs() -> dict[str, Any]:
    import peft

    task = {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}
    return {
        "PROMPT_TUNING": peft.PromptTuningConfig(**task),
        "PREFIX_TUNING": peft.PrefixTuningConfig(**task),
        "P_TUNING": peft.PromptEncoderConfig(**task, encoder_hidden_size=8),
        "MULTITASK_PROMPT_TUNING": peft.MultitaskPromptTuningConfig(**task, num_tasks=2),
        "LN_TUNING": peft.LNTuningConfig(target_modules=["input_layernorm"]),
    }


@pytest.mark.parametrize("peft_type", list(_prompt_configs()))
def test_methods_that_change_no_weight_are_refused(peft_type: str, llama_dir: Path,
                                                   tmp_path: Path) -> None:
    """Made with peft: a permanent refusal that says why there is nothing to analyse."""
    adapter = make_method_adapter(llama_dir, tmp_path / "adapter", _prompt_configs()[peft_type])
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == peft_type
    with pytest.raises(UnsupportedAdapterError, match=f"adapter type {peft_type} is .*"
                       f"{NO_WEIGHT} beyond the base model \\({llama_dir}\\) itself"):
        run_analysis(adapter, tmp_path / "out")


def test_prompt_tuning_exits_3_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    """The real worker: exit 3 (permanent: not retried) and the reason on one line."""
    adapter = make_method_adapter(llama_dir, tmp_path / "adapter",
                                  _prompt_configs()["PROMPT_TUNING"])
    result = BackgroundRun(["--model", str(adapter), "--device", "cpu"], tmp_path / "out"
                           ).result()
    assert result.code == EXIT_PERMANENT
    (line,) = result.errors
    assert "adapter type PROMPT_TUNING is prompt tuning" in line
    assert NO_WEIGHT in line


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param({"peft_type": None}, "adapter type 'unknown' is not supported: merged are "
                     "LoRA, AdaLoRA, IA3, LoHa, LoKr, VeRA, OFT, BOFT", id="no-type"),
        pytest.param({"peft_type": "FOURIERFT"}, "'FOURIERFT' is not supported", id="fourierft"),
        pytest.param({"peft_type": "XLORA"}, r"'XLORA' \(X-LoRA \(mixes LoRA experts per "
                     r"token: no single merged weight\)\) is not supported", id="xlora"),
        pytest.param({"peft_type": "LORA", "target_parameters": ["experts.gate_up_proj"]},
                     "LoRA on target_parameters .*MoE experts.* is not supported",
                     id="lora-target-parameters"),
        pytest.param({"peft_type": "ADALORA", "layer_replication": [[0, 2]]},
                     "layer_replication .* is not supported", id="adalora-layer-replication"),
        pytest.param({"peft_type": "VERA", "save_projection": False},
                     r"VeRA saved without its shared projections \(save_projection=false\) is "
                     "not supported: peft regenerates vera_A and vera_B from "
                     "projection_prng_key", id="vera-without-projections"),
    ],
)
def test_not_merged_is_refused_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedAdapterError, match=message):
        check_supported(config)


@pytest.mark.parametrize("peft_type", ["LORA", "ADALORA", "IA3", "LOHA", "LOKR", "VERA",
                                       "OFT", "BOFT", "lora"])
def test_merged_methods_pass(peft_type: str) -> None:
    check_supported({"peft_type": peft_type})


def test_vera_without_projections_made_with_peft(llama_dir: Path, tmp_path: Path) -> None:
    import peft

    adapter = make_method_adapter(llama_dir, tmp_path / "vera", peft.VeraConfig(
        r=4, target_modules=["q_proj"], save_projection=False))
    with pytest.raises(UnsupportedAdapterError, match="save_projection=false"):
        run_analysis(adapter, tmp_path / "out")


# --- config and weights that disagree ------------------------------------------------------


def _edit(adapter: Path, *, config: Callable[[dict[str, Any]], None] | None = None,
          weights: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    if config is not None:
        path = adapter / "adapter_config.json"
        doc = json.loads(path.read_text())
        config(doc)
        path.write_text(json.dumps(doc))
    if weights is not None:
        path = adapter / "adapter_model.safetensors"
        tensors = load_file(str(path))
        weights(tensors)
        save_file(tensors, str(path))
    return adapter


def _as_ia3(doc: dict[str, Any]) -> None:
    doc["peft_type"] = "IA3"


def _not_feedforward(doc: dict[str, Any]) -> None:
    doc["feedforward_modules"] = []


def _drop(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(suffix)]:
            del tensors[key]
    return edit


def _old_oft(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if k.endswith("oft_R.weight")]:
        tensors[key] = torch.zeros(4, 8, 8)


def _configs() -> dict[str, Any]:
    import peft

    return {
        "lora": peft.LoraConfig(r=2, target_modules=["q_proj"]),
        "ia3": peft.IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]),
        "loha": peft.LoHaConfig(r=2, target_modules=["q_proj"]),
        "vera": peft.VeraConfig(r=4, target_modules=["q_proj"]),
        "oft": peft.OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj"]),
    }


@pytest.mark.parametrize(
    ("kind", "config", "weights", "error", "message"),
    [
        pytest.param("lora", _as_ia3, None, PermanentModelError,
                     r"adapter_config\.json says IA3, but its weights hold .*lora_A\.weight, a "
                     "part of another method", id="lora-weights-ia3-config"),
        pytest.param("ia3", _not_feedforward, None, PermanentModelError,
                     r"IA3 module model\.layers\.0\.mlp\.down_proj has ia3_l of shape \(1, 64\), "
                     "but feedforward_modules does not name it", id="ia3-feedforward-disagrees"),
        pytest.param("loha", None, _drop("layers.0.self_attn.q_proj.hada_w2_b"),
                     PermanentModelError, r"LoHa module model\.layers\.0\.self_attn\.q_proj has "
                     "no hada_w2_b", id="loha-part-missing"),
        pytest.param("vera", None, _drop("vera_A"), PermanentModelError,
                     "holds no base_model.vera_A", id="vera-projection-missing"),
        pytest.param("oft", None, _old_oft, UnsupportedAdapterError,
                     r"OFT as older peft versions saved it .*\(4, 8, 8\)", id="oft-before-0.15"),
    ],
)
def test_disagreeing_adapters_are_refused(
    kind: str, config: Callable[[dict[str, Any]], None] | None,
    weights: Callable[[dict[str, torch.Tensor]], None] | None, error: type[Exception],
    message: str, llama_dir: Path, tmp_path: Path,
) -> None:
    adapter = make_method_adapter(llama_dir, tmp_path / kind, _configs()[kind])
    _edit(adapter, config=config, weights=weights)
    with pytest.raises(error, match=message):
        run_analysis(adapter, tmp_path / "out")


def test_wrong_base_for_a_method(gpt2_dir: Path, llama_dir: Path, tmp_path: Path) -> None:
    """A LoHa adapter (peft adapts Linear and Conv2d only) matched to GPT-2's Conv1D layers:
    a wrong base model, said before any layer is analysed."""
    import peft

    adapter = make_method_adapter(llama_dir, tmp_path / "loha", peft.LoHaConfig(
        r=2, target_modules=["q_proj"]))
    _edit(adapter, weights=lambda t: t.update(
        {k.replace("model.layers.", "transformer.h.").replace("self_attn.q_proj", "attn.c_proj"):
         t.pop(k) for k in list(t)}))
    with pytest.raises(PermanentModelError, match="a LoHa update of a Conv1D layer, which "
                       "peft's LoHa never adapts"):
        run_analysis(adapter, tmp_path / "out", base_model=str(gpt2_dir))
