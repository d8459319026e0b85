"""Every peft method that changes weights, made with peft on locally built bases and analysed
by the worker's streamed, per-layer merge: each layer's spectrum, spectral norm and alpha
equal those of peft's own `merge_and_unload()` (float64 SVD of the merged weight)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from esd_worker.core.powerlaw import layer_metrics
from tests.esd_worker.test_lora import svd_evals
from tests.support.builders import WorkerResult, peft_merged_weights, run_analysis

NOISE = 0.05  # added to every trainable adapter parameter, so that no update is zero


def make_method_adapter(base: Path, directory: Path, config: Any, *, seed: int = 0,
                        edit: Callable[[Any], None] | None = None) -> Path:
    """`config`'s adapter made with peft on `base`, every trainable parameter moved off its
    initial value (peft starts most methods as the identity), saved to `directory`."""
    from peft import get_peft_model

    from tests.support.builders import _finish_adapter, _load_base, _quiet_warnings

    torch.manual_seed(seed)
    with _quiet_warnings():
        model = get_peft_model(_load_base(base), config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=gen) * NOISE)
        if edit is not None:
            edit(model)
        model.save_pretrained(str(directory))
    _finish_adapter(directory, str(base))
    return directory


def assert_layers_match(result: WorkerResult, merged: dict[str, torch.Tensor]) -> None:
    """Every analysed layer: eigenvalues, spectral_norm and (where fitted) alpha equal those
    of peft's merged weight in float64, rtol 1e-5 (the worker runs its float64 path)."""
    assert result.eigs, "no layer analysed"
    for name, evals in result.eigs.items():
        ref = svd_evals(merged[name])
        np.testing.assert_allclose(evals, ref, rtol=1e-5, err_msg=name)
        row = result.row(name)
        expected = layer_metrics(ref, max_dim=max(merged[name].shape[:2]))
        assert float(row["spectral_norm"]) == pytest.approx(expected["spectral_norm"],
                                                            rel=1e-5), name
        if row["status"] == "ok":
            assert float(row["alpha"]) == pytest.approx(expected["alpha"], rel=1e-5), name
        else:
            assert not math.isfinite(float(expected["alpha"])) or expected["status"] != "ok"


@dataclass(frozen=True)
class Case:
    """One adapter: the base fixture, the peft config, what result.json must say."""

    base: str
    config: Callable[[], Any]
    peft_type: str
    merged_modules: int
    settings: dict[str, Any] = field(default_factory=dict)
    edit: Callable[[Any], None] | None = None
    changes_spectrum: bool = True


def _peft() -> Any:
    import peft

    return peft


CONVS = r".*encoder.*\.convolution"  # ResNet's 3x3 and 1x1 convolutions (5), not the 7x7 stem
LLAMA_QKD = ["q_proj", "k_proj", "down_proj"]


def _adalora_pruned(model: Any) -> None:
    """As AdaLoRA's rank allocator leaves it: rank_pattern masks, the saved tensors pruned
    to the ranks kept; ranknum (the scaling's divisor) stays init_r."""
    masks = {}
    for name, _ in model.named_parameters():
        if name.endswith("lora_E.default"):
            key = name.removeprefix("base_model.model.")
            masks[key] = [True, False, True, True] if "q_proj" in key else [False, True, True, True]
    model.peft_config["default"].rank_pattern = masks


CASES = {
    "dora": Case("llama_dir", lambda: _peft().LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True),
        "DORA", 6),
    "dora-rslora-embedding": Case("llama_dir", lambda: _peft().LoraConfig(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["embed_tokens", "o_proj"],
        use_dora=True), "DORA", 3, {"include_embeddings": True}),
    "dora-conv1d": Case("gpt2_dir", lambda: _peft().LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
        use_dora=True), "DORA", 4),
    "dora-conv2d": Case("resnet_dir", lambda: _peft().LoraConfig(
        r=4, lora_alpha=8, target_modules=CONVS, use_dora=True), "DORA", 5),
    # tied embedding and lm_head both adapted: peft merges both into the one weight, in the
    # model's order (which matters when the updates multiply)
    "dora-tied": Case("llama_tied_dir", lambda: _peft().LoraConfig(
        r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"], use_dora=True),
        "DORA", 2),
    "oft-tied-embeddings": Case("llama_tied_dir", lambda: _peft().OFTConfig(
        r=4, oft_block_size=0, target_modules=["embed_tokens", "lm_head"]), "OFT", 2,
        {"include_embeddings": True}),
    "adalora": Case("llama_dir", lambda: _peft().AdaLoraConfig(
        init_r=4, target_r=2, total_step=10, lora_alpha=16, target_modules=LLAMA_QKD),
        "ADALORA", 6),
    "adalora-pruned": Case("llama_dir", lambda: _peft().AdaLoraConfig(
        init_r=4, target_r=2, total_step=10, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "ADALORA", 4, edit=_adalora_pruned),
    "adalora-conv1d": Case("gpt2_dir", lambda: _peft().AdaLoraConfig(
        init_r=4, target_r=2, total_step=10, target_modules=["c_attn", "c_proj"],
        fan_in_fan_out=True), "ADALORA", 6),
    "adalora-conv2d": Case("resnet_dir", lambda: _peft().AdaLoraConfig(
        init_r=4, target_r=2, total_step=10, target_modules=CONVS), "ADALORA", 5),
    "ia3": Case("llama_dir", lambda: _peft().IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "IA3", 6),
    "ia3-conv1d": Case("gpt2_dir", lambda: _peft().IA3Config(
        target_modules=["c_attn", "c_fc"], feedforward_modules=["c_fc"], fan_in_fan_out=True),
        "IA3", 4),
    "ia3-conv2d": Case("resnet_dir", lambda: _peft().IA3Config(
        target_modules=CONVS, feedforward_modules=r".*layer\.1\.convolution"), "IA3", 5),
    "loha": Case("llama_dir", lambda: _peft().LoHaConfig(
        r=2, alpha=4, target_modules=LLAMA_QKD, rank_pattern={"down_proj": 4},
        alpha_pattern={"model.layers.1.self_attn.q_proj": 16}), "LOHA", 6),
    "loha-conv2d": Case("resnet_dir", lambda: _peft().LoHaConfig(
        r=2, alpha=4, target_modules=CONVS, use_effective_conv2d=True), "LOHA", 5),
    "lokr": Case("llama_dir", lambda: _peft().LoKrConfig(
        r=2, alpha=4, target_modules=LLAMA_QKD, decompose_both=True,
        rank_pattern={"k_proj": 8}), "LOKR", 6),
    "lokr-conv2d": Case("resnet_dir", lambda: _peft().LoKrConfig(
        r=2, alpha=4, target_modules=CONVS, use_effective_conv2d=True), "LOKR", 5),
    "vera": Case("llama_dir", lambda: _peft().VeraConfig(
        r=4, target_modules=["q_proj", "k_proj", "down_proj"], save_projection=True),
        "VERA", 6),
    "vera-conv1d": Case("gpt2_dir", lambda: _peft().VeraConfig(
        r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True), "VERA", 4),
    "oft": Case("llama_dir", lambda: _peft().OFTConfig(
        r=4, oft_block_size=0, target_modules=LLAMA_QKD), "OFT", 6),
    "oft-exact-cayley-coft": Case("llama_dir", lambda: _peft().OFTConfig(
        r=0, oft_block_size=8, target_modules=LLAMA_QKD, use_cayley_neumann=False, coft=True,
        eps=1e-3), "OFT", 6, changes_spectrum=False),
    "oft-block-share-embedding": Case("llama_dir", lambda: _peft().OFTConfig(
        r=4, oft_block_size=0, target_modules=["embed_tokens", "v_proj"], block_share=True,
        num_cayley_neumann_terms=7), "OFT", 3, {"include_embeddings": True}),
    "oft-conv2d": Case("resnet_dir", lambda: _peft().OFTConfig(
        r=0, oft_block_size=4, target_modules=CONVS), "OFT", 5),
    "boft": Case("llama_dir", lambda: _peft().BOFTConfig(
        boft_block_size=4, target_modules=LLAMA_QKD), "BOFT", 6),
    "boft-conv2d": Case("resnet_dir", lambda: _peft().BOFTConfig(
        boft_block_size=0, boft_block_num=4, target_modules=CONVS), "BOFT", 5),
}


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")
@pytest.mark.parametrize("case_id", list(CASES))
def test_merge_equals_peft(case_id: str, request: pytest.FixtureRequest,
                           tmp_path: Path) -> None:
    case = CASES[case_id]
    base: Path = request.getfixturevalue(case.base)
    adapter = make_method_adapter(base, tmp_path / case_id, case.config(), seed=len(case_id),
                                  edit=case.edit)
    result = run_analysis(adapter, tmp_path / "out", precision="float64", **case.settings)
    merged = peft_merged_weights(base, adapter)
    assert_layers_match(result, merged)
    marker = result.marker["adapter"]
    assert marker["peft_type"] == case.peft_type
    assert marker["merged_modules"] == case.merged_modules

    # the adapter changes what it targets, and nothing else
    plain = run_analysis(base, tmp_path / "base", precision="float64", **case.settings)
    base_weights = _base_weights(base)
    targeted = [n for n in result.eigs if not torch.equal(merged[n], base_weights[n])]
    assert targeted
    for name in set(result.eigs) - set(targeted):
        np.testing.assert_array_equal(result.eigs[name], plain.eigs[name], err_msg=name)
    changed = [n for n in targeted if not np.allclose(result.eigs[n], plain.eigs[n])]
    # an exact Cayley rotation is orthogonal: the spectrum stays (the merge itself is
    # checked weight by weight in test_adapters_units)
    assert changed if case.changes_spectrum else not changed


_BASES: dict[Path, dict[str, torch.Tensor]] = {}


def _base_weights(base: Path) -> dict[str, torch.Tensor]:
    """{module name: float64 weight} of the base, as peft_merged_weights names them."""
    if base not in _BASES:
        from transformers.pytorch_utils import Conv1D

        from tests.support.builders import _load_base

        kinds = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding, Conv1D)
        model = _load_base(base, torch.float64)
        _BASES[base] = {n: m.weight.detach() for n, m in model.named_modules()
                        if isinstance(m, kinds)}
    return _BASES[base]


def test_float32_path_close_to_peft(llama_dir: Path, tmp_path: Path) -> None:
    """The default fast path, on the multiplicative methods: within its tolerance."""
    for name in ("dora", "oft", "boft", "ia3"):
        adapter = make_method_adapter(llama_dir, tmp_path / name, CASES[name].config())
        result = run_analysis(adapter, tmp_path / f"out-{name}")
        merged = peft_merged_weights(llama_dir, adapter)
        for layer, evals in result.eigs.items():
            ref = svd_evals(merged[layer])
            np.testing.assert_allclose(evals, ref, rtol=0, atol=1e-5 * ref[-1],
                                       err_msg=f"{name} {layer}")


def test_analysis_does_not_import_peft(llama_dir: Path, tmp_path: Path) -> None:
    """peft is slow to import: the worker merges with its own code."""
    import subprocess
    import sys

    adapter = make_method_adapter(llama_dir, tmp_path / "boft", CASES["boft"].config())
    code = ("import sys; from pathlib import Path; "
            "from tests.support.builders import run_analysis; "
            f"run_analysis(Path({str(adapter)!r}), Path({str(tmp_path / 'out')!r})); "
            "sys.exit('peft' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-2000:]


def test_info_records_the_method(llama_dir: Path, tmp_path: Path) -> None:
    """result.json's adapter: r and alpha where the method has them."""
    from esd_worker.analysis.adapters import PeftAdapter

    expected = {
        "adalora": ("ADALORA", 4, 16.0), "loha": ("LOHA", 2, 4.0), "vera": ("VERA", 4, None),
        "ia3": ("IA3", None, None), "boft": ("BOFT", None, None), "oft": ("OFT", 4, None),
        "dora": ("DORA", 4, 8.0),
    }
    for name, (peft_type, r, alpha) in expected.items():
        adapter = make_method_adapter(llama_dir, tmp_path / name, CASES[name].config())
        info = PeftAdapter(adapter).info
        assert (info.peft_type, info.r, info.lora_alpha) == (peft_type, r, alpha), name
