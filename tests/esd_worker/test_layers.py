"""Layer discovery and streaming on locally built checkpoints: which layers, which shapes,
which eigenvalues, and the status of every layer that cannot be analysed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from esd_worker.analysis.layers import match_by_suffix, suffix_index
from tests.support.builders import (
    WorkerResult,
    make_bert,
    make_llama,
    make_tensor_model,
    make_unknown_arch,
    run_analysis,
)

LLAMA_BLOCK = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
LLAMA_LAYERS = [f"model.layers.{i}.{m}" for i in range(2) for m in LLAMA_BLOCK] + ["lm_head"]


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files, as stored."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                out[key] = f.get_tensor(key)
    return out


def svd_evals(w: torch.Tensor) -> np.ndarray:
    return np.sort(np.linalg.svd(w.double().numpy(), compute_uv=False) ** 2)


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, which result.json must never contain."""

    def refuse(token: str) -> None:
        raise AssertionError(f"result.json contains {token}")

    return json.loads(text, parse_constant=refuse)


def assert_same_analysis(a: WorkerResult, b: WorkerResult) -> None:
    """Same layers, same eigenvalues, same metrics (model ids and keys may differ)."""
    assert a.layers == b.layers
    assert a.eigs.keys() == b.eigs.keys()
    for name in a.eigs:
        np.testing.assert_array_equal(a.eigs[name], b.eigs[name])
    skip = {"model_id", "revision"}
    assert [{k: v for k, v in r.items() if k not in skip} for r in a.rows] == [
        {k: v for k, v in r.items() if k not in skip} for r in b.rows
    ]


@pytest.fixture(scope="module")
def llama_result(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> WorkerResult:
    return run_analysis(llama_dir, tmp_path_factory.mktemp("out"), precision="float64")


# --- architectures ---------------------------------------------------------------------------


def test_llama_layers_shapes_and_spectra(llama_dir: Path, llama_result: WorkerResult) -> None:
    """q/k/v/o/gate/up/down per block plus lm_head, M x N = out x in, eigenvalues = σ² of
    the stored weight (float64 path against numpy's SVD)."""
    result = llama_result
    assert result.layers == LLAMA_LAYERS
    assert result.marker["layer_discovery"] == "architecture"
    assert result.marker["architecture"] == "LlamaForCausalLM"
    assert result.marker["discovery_note"] == ""
    shapes = {r["layer"]: (int(r["M"]), int(r["N"])) for r in result.rows}
    assert shapes["model.layers.0.self_attn.q_proj"] == (32, 32)
    assert shapes["model.layers.0.self_attn.k_proj"] == (16, 32)  # one KV head of 16
    assert shapes["model.layers.1.mlp.up_proj"] == (64, 32)
    assert shapes["model.layers.1.mlp.down_proj"] == (32, 64)
    assert shapes["lm_head"] == (64, 32)
    assert {r["layer_type"] for r in result.rows} == {"Linear"}
    assert {r["status"] for r in result.rows} == {"ok"}
    tensors = read_tensors(llama_dir)
    for layer in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        w = tensors[f"{layer}.weight"]
        assert int(result.row(layer)["num_params"]) == w.numel()
        np.testing.assert_allclose(result.eigs[layer], svd_evals(w), rtol=1e-10)


def test_llama_tied_embeddings(llama_tied_dir: Path, tmp_path: Path) -> None:
    """tie_word_embeddings: the checkpoint has no lm_head.weight; lm_head is analysed from
    the embedding it is tied to (and the embedding itself only with include_embeddings)."""
    assert "lm_head.weight" not in read_tensors(llama_tied_dir)
    embed = read_tensors(llama_tied_dir)["model.embed_tokens.weight"]
    result = run_analysis(llama_tied_dir, tmp_path, precision="float64")
    assert result.layers == LLAMA_LAYERS
    assert result.marker["discovery_note"] == ""
    np.testing.assert_allclose(result.eigs["lm_head"], svd_evals(embed), rtol=1e-10)

    with_embeddings = run_analysis(
        llama_tied_dir, tmp_path / "emb", precision="float64", include_embeddings=True
    )
    assert with_embeddings.layers == ["model.embed_tokens", *LLAMA_LAYERS]
    assert with_embeddings.row("model.embed_tokens")["layer_type"] == "Embedding"
    np.testing.assert_array_equal(
        with_embeddings.eigs["model.embed_tokens"], with_embeddings.eigs["lm_head"]
    )


def test_gpt2_conv1d(gpt2_dir: Path, tmp_path: Path) -> None:
    """Conv1D weights are stored (in x out): the rows say out x in, the eigenvalues are those
    of the stored matrix (transposition keeps singular values); lm_head is tied to wte."""
    result = run_analysis(gpt2_dir, tmp_path, precision="float64")
    tensors = read_tensors(gpt2_dir)
    assert result.marker["architecture"] == "GPT2LMHeadModel"
    types = {r["layer"]: r["layer_type"] for r in result.rows}
    assert types == {
        **{f"transformer.h.{i}.{m}": "Conv1D" for i in range(2)
           for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
        "lm_head": "Linear",
    }
    for layer, stored, out_in in [
        ("transformer.h.0.attn.c_attn", (32, 96), (96, 32)),
        ("transformer.h.1.mlp.c_fc", (32, 128), (128, 32)),
        ("transformer.h.1.mlp.c_proj", (128, 32), (32, 128)),
    ]:
        w = tensors[f"{layer}.weight"]
        assert tuple(w.shape) == stored
        row = result.row(layer)
        assert (int(row["M"]), int(row["N"])) == out_in
        np.testing.assert_allclose(result.eigs[layer], svd_evals(w), rtol=1e-10)
    np.testing.assert_allclose(
        result.eigs["lm_head"], svd_evals(tensors["transformer.wte.weight"]), rtol=1e-10
    )


def test_bert_encoder(tmp_path: Path) -> None:
    """BertModel (tests.support.builders.make_bert): 6 Linear layers per block plus the pooler."""
    result = run_analysis(make_bert(tmp_path / "bert"), tmp_path / "out")
    assert result.marker["architecture"] == "BertModel"
    assert len(result.layers) == 2 * 6 + 1
    assert result.layers[-1] == "pooler.dense"
    assert result.row("encoder.layer.1.intermediate.dense")["M"] == "64"


def test_resnet_conv2d(resnet_dir: Path, tmp_path: Path) -> None:
    """Conv2d: kh·kw slices (out x in) scaled by sqrt(conv_norm), eigenvalues pooled (compared
    with numpy); the 7x7 stem has 3 input channels, fewer than min_evals: too_small."""
    tensors = read_tensors(resnet_dir)
    result = run_analysis(resnet_dir, tmp_path, precision="float64", conv_norm=0.5)
    stem = result.row("resnet.embedder.embedder.convolution")
    assert (stem["layer_type"], stem["M"], stem["N"], stem["status"]) == (
        "Conv2d", "16", "3", "too_small"
    )
    assert result.row("classifier.1")["layer_type"] == "Linear"
    conv = "resnet.encoder.stages.1.layers.0.layer.0.convolution"
    w = tensors[f"{conv}.weight"].double().numpy()
    assert w.shape == (24, 16, 3, 3)
    expected = np.sort(np.concatenate([
        0.5 * np.linalg.svd(w[:, :, i, j], compute_uv=False) ** 2
        for i in range(3) for j in range(3)
    ]))
    row = result.row(conv)
    assert (row["layer_type"], row["M"], row["N"], row["status"]) == ("Conv2d", "24", "16", "ok")
    assert int(row["num_evals"]) == 16 * 9
    np.testing.assert_allclose(result.eigs[conv], expected, rtol=1e-10)
    shortcut = "resnet.encoder.stages.1.layers.0.shortcut.convolution"  # 1x1
    np.testing.assert_allclose(
        result.eigs[shortcut], 0.5 * svd_evals(tensors[f"{shortcut}.weight"][:, :, 0, 0]),
        rtol=1e-10,
    )
    doubled = run_analysis(resnet_dir, tmp_path / "norm1", precision="float64", conv_norm=1.0)
    np.testing.assert_allclose(doubled.eigs[conv], 2 * result.eigs[conv], rtol=1e-12)
    np.testing.assert_array_equal(doubled.eigs["classifier.1"], result.eigs["classifier.1"])


# --- checkpoint formats ----------------------------------------------------------------------


def test_sharded_checkpoint(llama_result: WorkerResult, tmp_path: Path) -> None:
    """save_pretrained with a small max_shard_size: an index and several shards, read as one."""
    sharded = make_llama(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    assert not (sharded / "model.safetensors").exists()
    assert_same_analysis(run_analysis(sharded, tmp_path / "out", precision="float64"),
                         llama_result)


def test_bin_only_checkpoint(llama_result: WorkerResult, tmp_path: Path) -> None:
    """pytorch_model.bin only (what safe_serialization=False wrote): loaded weights_only."""
    binary = make_llama(tmp_path / "bin", weights_format="bin")
    assert not list(binary.glob("*.safetensors"))
    assert_same_analysis(run_analysis(binary, tmp_path / "out", precision="float64"),
                         llama_result)


def test_sharded_bin_checkpoint(
    llama_dir: Path, llama_result: WorkerResult, tmp_path: Path
) -> None:
    """pytorch_model.bin.index.json with two .bin shards (what older transformers wrote)."""
    tensors = read_tensors(llama_dir)
    model = tmp_path / "bin-shards"
    model.mkdir()
    (model / "config.json").write_text((llama_dir / "config.json").read_text())
    keys = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2],
              "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in shards.items():
        torch.save({k: tensors[k] for k in part}, model / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_analysis(run_analysis(model, tmp_path / "out", precision="float64"),
                         llama_result)


def test_fp16_checkpoint_is_upcast(tmp_path: Path) -> None:
    """An fp16 checkpoint gives exactly the spectra of the float32 copy of the same values."""
    half = make_llama(tmp_path / "fp16", dtype=torch.float16)
    config = json.loads((half / "config.json").read_text())
    copy = make_tensor_model(
        tmp_path / "fp32", {k: v.float() for k, v in read_tensors(half).items()}, config=config
    )
    a = run_analysis(half, tmp_path / "a")
    b = run_analysis(copy, tmp_path / "b")
    assert_same_analysis(a, b)


# --- discovery without an architecture --------------------------------------------------------


def test_unknown_architecture_falls_back(tmp_path: Path) -> None:
    """A model_type transformers does not know: 2-D *.weight tensors by name, embeddings and
    norms and biases skipped, and result.json says so."""
    model = make_unknown_arch(tmp_path / "unknown")
    result = run_analysis(model, tmp_path / "out")
    assert result.marker["layer_discovery"] == "fallback"
    assert result.marker["architecture"] is None
    assert "architecture unknown to transformers" in result.marker["discovery_note"]
    assert result.layers == [
        f"backbone.blocks.{i}.mixer.{p}" for i in range(2) for p in ("in_proj", "out_proj")
    ]
    assert {r["layer_type"] for r in result.rows} == {"Matrix"}
    assert result.row("backbone.blocks.0.mixer.in_proj")["M"] == "48"

    with_embeddings = run_analysis(model, tmp_path / "emb", include_embeddings=True)
    assert set(with_embeddings.layers) == {"backbone.embeddings", *result.layers}
    assert with_embeddings.row("backbone.embeddings")["layer_type"] == "Embedding"


def test_no_config_falls_back(tmp_path: Path) -> None:
    model = make_tensor_model(tmp_path / "bare", {"enc.0.proj.weight": torch.randn(20, 12)})
    result = run_analysis(model, tmp_path / "out")
    assert (result.marker["layer_discovery"], result.layers) == ("fallback", ["enc.0.proj"])


def test_module_weights_missing_from_the_checkpoint_are_noted(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A Llama checkpoint without lm_head: the layers found are analysed, and the note names
    the gap instead of hiding it (a stored weight the model lacks fails the model instead:
    tests/esd_worker/test_accounted_weights.py)."""
    tensors = read_tensors(llama_dir)
    del tensors["lm_head.weight"]
    config = json.loads((llama_dir / "config.json").read_text())
    model = make_tensor_model(tmp_path / "odd", tensors, config=config)
    result = run_analysis(model, tmp_path / "out")
    assert result.layers == LLAMA_LAYERS[:-1]
    note = result.marker["discovery_note"]
    assert note == "1 module weights not in the checkpoint (e.g. lm_head.weight)"


def test_checkpoint_prefixes_are_mapped(llama_dir: Path, tmp_path: Path) -> None:
    """Checkpoints saved from the bare model (no "model." prefix) or through peft
    ("base_model.model.") map to the same layers."""
    tensors = read_tensors(llama_dir)
    config = json.loads((llama_dir / "config.json").read_text())
    for prefix in ("base_model.model.", "transformer."):
        renamed = {prefix + k: v for k, v in tensors.items()}
        model = make_tensor_model(tmp_path / prefix.strip("."), renamed, config=config)
        result = run_analysis(model, tmp_path / f"out-{prefix}")
        assert result.layers == LLAMA_LAYERS, prefix
        assert result.marker["discovery_note"] == ""


@pytest.mark.parametrize(
    ("name", "keys", "expected"),
    [
        pytest.param("model.layers.0.q.weight", ["model.layers.0.q.weight"],
                     "model.layers.0.q.weight", id="exact"),
        pytest.param("model.layers.0.q.weight", ["layers.0.q.weight"], "layers.0.q.weight",
                     id="checkpoint-without-prefix"),
        pytest.param("layers.0.q.weight", ["base_model.model.model.layers.0.q.weight"],
                     "base_model.model.model.layers.0.q.weight", id="checkpoint-with-prefix"),
        pytest.param("pooler.dense.weight", ["a.dense.weight", "b.dense.weight"], None,
                     id="ambiguous"),
        pytest.param("model.language_model.layers.0.q.weight",
                     ["vision_tower.vision_model.encoder.layers.0.q.weight",
                      "language_model.model.layers.0.q.weight"],
                     "language_model.model.layers.0.q.weight", id="by-its-sub-model"),
        pytest.param("model.text.layers.0.q.weight",
                     ["a.text.layers.0.q.weight", "b.text.layers.0.q.weight"], None,
                     id="sub-models-tie"),
        pytest.param("model.layers.5.q.weight", ["model.layers.0.q.weight"], None,
                     id="never-across-block-index"),
        pytest.param("lm_head.weight", ["model.embed.weight"], None, id="absent"),
    ],
)
def test_match_by_suffix(name: str, keys: list[str], expected: str | None) -> None:
    assert match_by_suffix(name, suffix_index(keys)) == expected


# --- edge cases end in a status -----------------------------------------------------------


def test_edge_cases_end_in_a_status(tmp_path: Path) -> None:
    """All-zero, NaN, inf, tiny and integer weights each get a status; nothing crashes, the
    marker is written, its summary counts only what was fitted, and has no NaN."""
    gen = torch.Generator().manual_seed(0)
    good = torch.randn(40, 24, generator=gen)
    nan = good.clone()
    nan[3, 4] = math.nan
    inf = good.clone()
    inf[0, 0] = math.inf
    tensors = {
        "net.0.good.weight": good,
        "net.1.zero.weight": torch.zeros(40, 24),
        "net.2.nan.weight": nan,
        "net.3.inf.weight": inf.half(),
        "net.4.tiny.weight": torch.randn(5, 64, generator=gen),
        "net.5.int8.weight": torch.randint(-8, 8, (40, 24), dtype=torch.int8, generator=gen),
        "net.6.half.weight": good.half(),
    }
    model = make_tensor_model(tmp_path / "edge", tensors)
    result = run_analysis(model, tmp_path / "out")
    statuses = {r["layer"]: r["status"] for r in result.rows}
    assert statuses == {
        "net.0.good": "ok",
        "net.1.zero": "fit_failed",
        "net.2.nan": "nonfinite_weights",
        "net.3.inf": "nonfinite_weights",
        "net.4.tiny": "too_small",
        "net.5.int8": "unsupported_dtype",
        "net.6.half": "ok",
    }
    zero = result.row("net.1.zero")
    assert (zero["alpha"], zero["num_evals"], zero["spectral_norm"]) == ("nan", "24", "0.0")
    assert np.all(result.eigs["net.1.zero"] == 0)
    assert set(result.eigs) == {"net.0.good", "net.1.zero", "net.6.half"}
    tiny = result.row("net.4.tiny")
    assert (tiny["M"], tiny["N"], tiny["num_params"]) == ("5", "64", "320")

    marker = strict_json((tmp_path / "out" / result.marker["model_key"] / "result.json")
                         .read_text())
    assert marker["status_counts"] == {
        "fit_failed": 1, "nonfinite_weights": 2, "ok": 2, "too_small": 1,
        "unsupported_dtype": 1,
    }
    summary = marker["summary"]
    assert (summary["layers"], summary["layers_ok"]) == (7, 2)
    alphas = [float(result.row(n)["alpha"]) for n in ("net.0.good", "net.6.half")]
    assert summary["alpha_mean"] == pytest.approx(sum(alphas) / 2)


def test_no_fitted_layer_gives_null_summary(tmp_path: Path) -> None:
    model = make_tensor_model(tmp_path / "zeros", {"a.0.p.weight": torch.zeros(16, 16)})
    result = run_analysis(model, tmp_path / "out")
    marker = strict_json(
        (tmp_path / "out" / result.marker["model_key"] / "result.json").read_text()
    )
    assert marker["summary"]["layers_ok"] == 0
    assert marker["summary"]["alpha_mean"] is None
    assert marker["summary"]["alpha_in_2_6_share"] is None


def test_weight_of_unexpected_rank_is_a_status(llama_dir: Path, tmp_path: Path) -> None:
    """A Linear whose stored weight is not 2-D (e.g. a packed quantised tensor) and one that
    is int8: the other layers are analysed."""
    tensors = read_tensors(llama_dir)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors[
        "model.layers.0.self_attn.q_proj.weight"
    ].flatten()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 32, dtype=torch.int8)
    config = json.loads((llama_dir / "config.json").read_text())
    model = make_tensor_model(tmp_path / "packed", tensors, config=config)
    result = run_analysis(model, tmp_path / "out")
    assert result.row("model.layers.0.self_attn.q_proj")["status"] == "unsupported_shape"
    assert result.row("model.layers.0.mlp.up_proj")["status"] == "unsupported_dtype"
    assert result.marker["status_counts"] == {
        "ok": 13, "unsupported_dtype": 1, "unsupported_shape": 1
    }


# --- analysis settings and the marker -------------------------------------------------------


@pytest.mark.parametrize("fix_fingers", ["xmin_peak", "DKS"])
def test_fix_fingers_recorded(llama_dir: Path, tmp_path: Path, fix_fingers: str) -> None:
    result = run_analysis(llama_dir, tmp_path, fix_fingers=fix_fingers, save_eigs=False)
    assert {r["fix_fingers"] for r in result.rows} == {fix_fingers}
    assert result.marker["parameters"]["fix_fingers"] == fix_fingers
    assert result.marker["outputs"]["eigs"] is None
    assert result.eigs == {}
    assert all(math.isfinite(float(r["alpha"])) for r in result.rows)


def test_float32_and_float64_paths_agree_end_to_end(
    llama_dir: Path, llama_result: WorkerResult, tmp_path: Path
) -> None:
    """Same layers, eigenvalues to the fast path's tolerance (see test_spectra), and norms."""
    fast = run_analysis(llama_dir, tmp_path)
    assert fast.marker["parameters"]["precision"] == "float32"
    for name, exact in llama_result.eigs.items():
        np.testing.assert_allclose(fast.eigs[name], exact, rtol=0, atol=1e-5 * exact[-1])
    for a, b in zip(fast.rows, llama_result.rows, strict=True):
        assert float(a["spectral_norm"]) == pytest.approx(float(b["spectral_norm"]), rel=1e-5)
        assert float(a["norm"]) == pytest.approx(float(b["norm"]), rel=1e-5)


def test_marker_is_complete(llama_result: WorkerResult) -> None:
    marker = llama_result.marker
    for field in ("schema", "model", "model_id", "revision", "resolved_revision", "source",
                  "model_key", "parameters", "layer_discovery", "layer_count", "status_counts",
                  "summary", "timings", "device", "versions", "started_at", "finished_at"):
        assert field in marker, field
    assert marker["layer_count"] == len(LLAMA_LAYERS)
    assert marker["source"] == "local"
    assert marker["device"]["type"] == "cpu"
    assert {"torch", "transformers", "safetensors", "numpy"} <= set(marker["versions"])
    assert marker["summary"]["layers_ok"] == len(LLAMA_LAYERS)
