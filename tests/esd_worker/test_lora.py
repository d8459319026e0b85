"""LoRA adapters made with peft on locally built bases: the worker's streamed, per-layer merge
gives the spectra of peft's own `merge_and_unload()`, and bad adapters are refused. The other
methods: test_adapters (merges), test_adapters_units (deltas), test_adapters_refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from esd_worker.analysis.adapters import check_supported
from esd_worker.core.errors import PermanentModelError, UnsupportedAdapterError
from tests.support.builders import (
    GPT2_TARGETS,
    WorkerResult,
    make_lora_adapter,
    make_peft_adapter,
    peft_merged_weights,
    run_analysis,
)


def svd_evals(w: torch.Tensor, *, conv_norm: float = 0.5) -> np.ndarray:
    """σ² of a weight in float64, Conv2d slices pooled as docs/metrics.md says."""
    a = w.double().numpy()
    if a.ndim == 4:
        mats = [a[:, :, i, j] * np.sqrt(conv_norm) for i in range(a.shape[2])
                for j in range(a.shape[3])]
    else:
        mats = [a]
    return np.sort(np.concatenate([np.linalg.svd(m, compute_uv=False) ** 2 for m in mats]))


def assert_matches_peft(result: WorkerResult, merged: dict[str, torch.Tensor]) -> None:
    """Every analysed layer's eigenvalues equal those of peft's merged weight, rtol 1e-5.

    The worker runs its float64 path and the reference merge is peft's in float64, so the
    two are the same arithmetic up to float64 rounding (observed ~1e-13); 1e-5 is the bound
    the issue sets. The float32 path is checked against the same reference separately.
    """
    assert result.eigs, "no layer analysed"
    for name, evals in result.eigs.items():
        np.testing.assert_allclose(evals, svd_evals(merged[name]), rtol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def lora_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain LoRA (r=4, alpha=8) on every q/k/v/o/gate/up/down of the Llama base."""
    return make_lora_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "adapter")


@pytest.fixture(scope="module")
def lora_result(lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> WorkerResult:
    return run_analysis(lora_dir, tmp_path_factory.mktemp("out"), precision="float64")


# --- merges equal peft's -------------------------------------------------------------------


def test_lora_merge_equals_peft(
    llama_dir: Path, lora_dir: Path, lora_result: WorkerResult
) -> None:
    """Plain LoRA: W + (alpha/r)·B@A on every targeted layer; the base from adapter_config."""
    assert_matches_peft(lora_result, peft_merged_weights(llama_dir, lora_dir))
    marker = lora_result.marker
    assert marker["base_model"]["model"] == str(llama_dir)
    assert marker["adapter"]["r"] == 4
    assert marker["adapter"]["lora_alpha"] == 8.0
    assert marker["adapter"]["merged_modules"] == 14
    assert marker["model_id"] == str(lora_dir)


def test_lora_changes_targeted_layers_only(
    llama_dir: Path, lora_result: WorkerResult, tmp_path: Path
) -> None:
    """lm_head is not targeted: exactly the base's spectrum; every targeted layer differs."""
    base = run_analysis(llama_dir, tmp_path, precision="float64")
    np.testing.assert_array_equal(lora_result.eigs["lm_head"], base.eigs["lm_head"])
    for name in lora_result.eigs:
        if name != "lm_head":
            assert not np.allclose(lora_result.eigs[name], base.eigs[name]), name


def test_float32_path_close_to_peft(
    llama_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    """The default fast path on the same adapter: within its tolerance (see test_spectra)."""
    result = run_analysis(lora_dir, tmp_path)
    merged = peft_merged_weights(llama_dir, lora_dir)
    for name, evals in result.eigs.items():
        ref = svd_evals(merged[name])
        np.testing.assert_allclose(evals, ref, rtol=0, atol=1e-5 * ref[-1], err_msg=name)


def test_rslora_merge_equals_peft(llama_dir: Path, tmp_path: Path) -> None:
    """rsLoRA: scale alpha/sqrt(r), not alpha/r (r=16 makes the two differ by 4x)."""
    adapter = make_lora_adapter(
        llama_dir, tmp_path / "rslora", r=16, lora_alpha=4, use_rslora=True,
        target_modules=("q_proj", "down_proj"), seed=3,
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert result.marker["adapter"]["use_rslora"] is True
    assert_matches_peft(result, peft_merged_weights(llama_dir, adapter))


def test_fan_in_fan_out_merge_equals_peft(gpt2_dir: Path, tmp_path: Path) -> None:
    """GPT-2 Conv1D layers store (in x out): peft transposes B@A (fan_in_fan_out=True); the
    untargeted, tied lm_head keeps the base spectrum."""
    adapter = make_lora_adapter(
        gpt2_dir, tmp_path / "gpt2-lora", target_modules=GPT2_TARGETS, fan_in_fan_out=True,
        seed=4,
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert result.marker["adapter"]["fan_in_fan_out"] is True
    assert result.marker["adapter"]["merged_modules"] == 8
    assert_matches_peft(result, peft_merged_weights(gpt2_dir, adapter))


def test_rank_and_alpha_patterns(llama_dir: Path, tmp_path: Path) -> None:
    """rank_pattern / alpha_pattern, by module-name suffix and by full path, as peft applies
    them; layers the adapter does not touch are exactly the base model's."""
    adapter = make_lora_adapter(
        llama_dir, tmp_path / "patterns", r=4, lora_alpha=8,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 32, "model.layers.0.mlp.down_proj": 1},
        seed=5,
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["rank_pattern"] and config["alpha_pattern"]
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert_matches_peft(result, peft_merged_weights(llama_dir, adapter))
    base = run_analysis(llama_dir, tmp_path / "base", precision="float64")
    untouched = [n for n in result.eigs
                 if not n.endswith(("q_proj", "v_proj", "down_proj"))]
    assert len(untouched) == 9  # k, o, gate, up per block, and lm_head
    for name in untouched:
        np.testing.assert_array_equal(result.eigs[name], base.eigs[name], err_msg=name)


def test_conv2d_lora_merge_equals_peft(resnet_dir: Path, tmp_path: Path) -> None:
    """LoRA on Conv2d (3x3 and 1x1 kernels): the convolution of A by B, as peft merges it."""
    adapter = make_lora_adapter(
        resnet_dir, tmp_path / "conv-lora", target_modules=("convolution",), r=4, seed=6
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    merged = peft_merged_weights(resnet_dir, adapter)
    for name, evals in result.eigs.items():
        np.testing.assert_allclose(evals, svd_evals(merged[name]), rtol=1e-5, err_msg=name)


def test_embedding_lora_reaches_tied_lm_head(llama_tied_dir: Path, tmp_path: Path) -> None:
    """LoRA on embed_tokens of a tied model: peft's merge changes the shared weight, so
    lm_head changes too; the embedding itself is not analysed (no --include-embeddings)."""
    adapter = make_lora_adapter(
        llama_tied_dir, tmp_path / "emb-lora", target_modules=("embed_tokens", "q_proj"),
        seed=7,
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    merged = peft_merged_weights(llama_tied_dir, adapter)
    assert torch.equal(merged["lm_head"], merged["model.embed_tokens"])
    assert_matches_peft(result, merged)
    base = run_analysis(llama_tied_dir, tmp_path / "base", precision="float64")
    assert not np.allclose(result.eigs["lm_head"], base.eigs["lm_head"])

    with_embeddings = run_analysis(
        adapter, tmp_path / "emb", precision="float64", include_embeddings=True
    )
    assert_matches_peft(with_embeddings, merged)
    assert "model.embed_tokens" in with_embeddings.eigs


def test_embedding_lora_on_untied_model_is_not_analysed(
    llama_dir: Path, tmp_path: Path
) -> None:
    """An embedding update on an untied model changes no analysed layer: counted, not an
    error."""
    adapter = make_lora_adapter(
        llama_dir, tmp_path / "emb-lora", target_modules=("embed_tokens", "o_proj"), seed=8
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert result.marker["adapter"]["unanalysed_modules"] == 1
    assert result.marker["adapter"]["merged_modules"] == 2
    assert_matches_peft(result, peft_merged_weights(llama_dir, adapter))


def test_modules_to_save_replace_the_base_layer(llama_dir: Path, tmp_path: Path) -> None:
    """modules_to_save=["lm_head"]: the adapter's own trained copy is analysed."""
    adapter = make_lora_adapter(
        llama_dir, tmp_path / "mts", target_modules=("q_proj",), modules_to_save=["lm_head"],
        seed=9,
    )
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert result.marker["adapter"]["replaced_layers"] == 1
    merged = peft_merged_weights(llama_dir, adapter)
    assert_matches_peft(result, merged)
    base = run_analysis(llama_dir, tmp_path / "base", precision="float64")
    assert not np.allclose(result.eigs["lm_head"], base.eigs["lm_head"])


# --- where the base comes from ------------------------------------------------------------


def test_base_model_flag_overrides_adapter_config(
    llama_dir: Path, lora_dir: Path, lora_result: WorkerResult, tmp_path: Path
) -> None:
    """adapter_config.json names a base that does not exist here; --base-model wins."""
    moved = make_lora_adapter(
        llama_dir, tmp_path / "moved", base_model_name_or_path="/nonexistent/llama"
    )
    with pytest.raises(PermanentModelError, match="pass --base-model"):
        run_analysis(moved, tmp_path / "fail")
    result = run_analysis(moved, tmp_path / "out", precision="float64",
                          base_model=str(llama_dir))
    assert result.marker["base_model"]["model"] == str(llama_dir)
    for name, evals in lora_result.eigs.items():
        np.testing.assert_array_equal(result.eigs[name], evals)


def test_adapter_without_base_needs_base_model(llama_dir: Path, tmp_path: Path) -> None:
    adapter = make_lora_adapter(llama_dir, tmp_path / "orphan", base_model_name_or_path=None)
    with pytest.raises(PermanentModelError, match="names no base_model_name_or_path; pass "
                       "--base-model"):
        run_analysis(adapter, tmp_path / "out")


def test_wrong_base_model(gpt2_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    """A Llama adapter on a GPT-2 base: its modules match no weight."""
    with pytest.raises(PermanentModelError, match="wrong base model"):
        run_analysis(lora_dir, tmp_path, base_model=str(gpt2_dir))


def test_adapter_relation_without_adapter(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PermanentModelError, match="listed as an adapter"):
        run_analysis(llama_dir, tmp_path, relation="lora")


# --- refused adapters (every other method: test_adapters_refusals) ------------------------


@pytest.mark.parametrize(
    "option",
    ["layer_replication", "target_parameters", "use_bdlora", "use_qalora",
     "kasa_config", "alora_invocation_tokens", "trainable_token_indices"],
)
def test_lora_options_that_change_the_merge_are_refused(option: str) -> None:
    check_supported({"peft_type": "LORA", option: None})  # unset: fine
    with pytest.raises(UnsupportedAdapterError, match="not supported"):
        check_supported({"peft_type": "LORA", option: [1]})


def test_adapter_bin_equals_safetensors(
    lora_dir: Path, lora_result: WorkerResult, tmp_path: Path
) -> None:
    """An older adapter saved as adapter_model.bin (torch.save) merges the same."""
    from safetensors.torch import load_file

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "adapter_config.json").write_text((lora_dir / "adapter_config.json").read_text())
    torch.save(load_file(str(lora_dir / "adapter_model.safetensors")),
               legacy / "adapter_model.bin")
    result = run_analysis(legacy, tmp_path / "out", precision="float64")
    for name, evals in lora_result.eigs.items():
        np.testing.assert_array_equal(result.eigs[name], evals)


def test_bin_base_is_not_modified_by_the_merge(llama_tied_dir: Path, tmp_path: Path) -> None:
    """A .bin base hands out its (memory-mapped) float32 tensors as they are, already in the
    analysis device and dtype, and a tied weight is read twice (embedding, then lm_head):
    merging into the tensor itself would give lm_head the embedding's update twice."""
    from tests.support.builders import make_llama

    binary = make_llama(tmp_path / "bin", tie_word_embeddings=True, weights_format="bin")
    adapter = make_lora_adapter(
        llama_tied_dir, tmp_path / "emb-lora", target_modules=("embed_tokens", "q_proj"),
        seed=10,
    )
    # float32, the checkpoint's dtype: .to() hands back the checkpoint tensor itself.
    result = run_analysis(adapter, tmp_path / "out", base_model=str(binary),
                          include_embeddings=True)
    merged = peft_merged_weights(llama_tied_dir, adapter)
    assert {"model.embed_tokens", "lm_head"} <= set(result.eigs)
    for name, evals in result.eigs.items():
        ref = svd_evals(merged[name])
        np.testing.assert_allclose(evals, ref, rtol=0, atol=1e-5 * ref[-1], err_msg=name)


@pytest.mark.parametrize(
    ("target", "embedding", "fan_in_fan_out", "shape"),
    [
        pytest.param("Linear", False, False, (12, 8), id="linear"),
        pytest.param("Linear", False, True, (12, 8), id="linear-ignores-fan-in-fan-out"),
        pytest.param("Conv1D", False, False, (8, 12), id="conv1d-always-transposed"),
        pytest.param("Embedding", True, False, (8, 12), id="embedding"),
        pytest.param("Matrix", False, True, (8, 12), id="unknown-type-follows-config"),
        pytest.param(None, False, False, (12, 8), id="checkpoint-only-match"),
    ],
)
def test_in_place_merge_equals_delta(
    target: str | None, embedding: bool, fan_in_fan_out: bool, shape: tuple[int, int]
) -> None:
    """add_lora_ (one addmm) and lora_delta (B @ A, then added) give the same weight."""
    from esd_worker.analysis.adapters import LoraModule, add_lora_, lora_delta

    gen = torch.Generator().manual_seed(0)
    module = LoraModule("m", torch.randn(3, 8, generator=gen), torch.randn(12, 3, generator=gen),
                        0.7, embedding, target)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    expected = w + lora_delta(module, shape, fan_in_fan_out=fan_in_fan_out, dtype=w.dtype)
    add_lora_(w, module, fan_in_fan_out=fan_in_fan_out)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(PermanentModelError, match="wrong base model"):
        add_lora_(torch.zeros(shape[::-1] if shape[0] != shape[1] else (5, 5),
                              dtype=torch.float64), module, fan_in_fan_out=fan_in_fan_out)


def test_lora_bias_in_a_bin_adapter_is_not_taken_for_lora_b(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    """lora_bias=True saves `…lora_B.bias` next to `…lora_B.weight`. In a .bin adapter the
    bias comes last; read as a LoRA part it replaced B by a vector and the merge crashed.
    A bias does not change the weight matrix, so the spectra must equal peft's merge."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from tests.support.builders import make_peft_adapter

    adapter = make_peft_adapter(  # GPT-2's layers have biases, which lora_bias needs
        gpt2_dir, tmp_path / "bias",
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                   lora_bias=True), seed=5,
    )
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.bias") for k in tensors)
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[0].endswith(".bias")))
    torch.save(ordered, adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    assert_matches_peft(result, peft_merged_weights(gpt2_dir, adapter))


# --- bad and disguised adapters ------------------------------------------------------------

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
EMBED = "base_model.model.model.embed_tokens"


def _edit_weights(adapter: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """The adapter with its adapter_model.safetensors changed by `edit` (in place)."""
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    return adapter


@pytest.mark.parametrize(
    ("target", "key", "shape", "message"),
    [
        pytest.param("q_proj", f"{Q0}.lora_B.weight", (32, 3),
                     "lora_A of shape (4, 32) and lora_B of shape (32, 3)", id="lora-B-rank-3"),
        pytest.param("q_proj", f"{Q0}.lora_B.weight", (32,),
                     "lora_A of shape (4, 32) and lora_B of shape (32,)", id="lora-B-a-vector"),
        pytest.param("embed_tokens", f"{EMBED}.lora_embedding_B", (32, 2),
                     "lora_embedding_A of shape (4, 64) and lora_embedding_B of shape (32, 2)",
                     id="embedding-B-rank-2"),
    ],
)
def test_ranks_that_disagree_are_a_bad_adapter(
    llama_dir: Path, tmp_path: Path, target: str, key: str, shape: tuple[int, ...],
    message: str,
) -> None:
    """lora_A (r, in) and lora_B (out, r) must share r for B @ A to exist (r=4 here, as the
    config says). A mismatch is the adapter's fault: a permanent error naming the module
    and both shapes, not a crash in the merge (nor, for an embedding left out of the
    analysis, silence)."""
    adapter = make_lora_adapter(llama_dir, tmp_path / "bad", target_modules=(target,))
    _edit_weights(adapter, lambda t: t.__setitem__(key, torch.randn(shape)))
    module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    with pytest.raises(PermanentModelError) as info:
        run_analysis(adapter, tmp_path / "out")
    assert f"bad adapter: module {module} has {message}" in str(info.value)
    assert "ranks disagree" in str(info.value)


def _drop_use_dora(config: dict[str, Any]) -> None:
    del config["use_dora"]


def _use_dora_false(config: dict[str, Any]) -> None:
    config["use_dora"] = False


@pytest.mark.parametrize(
    ("edit_config", "key_suffix"),
    [
        pytest.param(_drop_use_dora, "", id="config-without-use_dora"),
        pytest.param(_use_dora_false, ".weight", id="use_dora-false-older-peft-key"),
    ],
)
def test_dora_weights_without_use_dora_are_a_bad_adapter(
    llama_dir: Path, tmp_path: Path, edit_config: Callable[[dict[str, Any]], None],
    key_suffix: str,
) -> None:
    """A DoRA adapter (made with peft) whose adapter_config.json lost use_dora still holds
    lora_magnitude_vector weights (peft saves `<module>.lora_magnitude_vector`, older
    versions `….weight`): merged as plain LoRA, as peft would with that config, the
    magnitudes would be dropped silently; config and weights disagree, a bad adapter."""
    import peft

    adapter = make_peft_adapter(llama_dir, tmp_path / "dora", peft.LoraConfig(
        r=2, target_modules=["q_proj"], use_dora=True))
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    edit_config(config)
    config_path.write_text(json.dumps(config))

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith("lora_magnitude_vector")]:
            tensors[key + key_suffix] = tensors.pop(key)

    _edit_weights(adapter, rename)
    with pytest.raises(PermanentModelError,
                       match=r"bad adapter: its weights hold DoRA magnitudes \(model\.layers\.0"
                             r"\.self_attn\.q_proj\.lora_magnitude_vector\) though "
                             r"adapter_config\.json does not set use_dora: config and weights "
                             r"disagree"):
        run_analysis(adapter, tmp_path / "out")
