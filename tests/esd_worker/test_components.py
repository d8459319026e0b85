"""esd_worker.analysis.checkpoints: a model folder's components and one Tensors over them.

Built here: a diffusers-shaped pipeline (model_index.json; unet/ and vae/ written with
safetensors directly, diffusers need not be installed; text_encoder/ a tiny CLIPTextModel's
save_pretrained; scheduler/ and tokenizer/ without weights) and a sentence-transformers model
(a tiny BertModel at the top, modules.json, 1_Pooling/ with a config only, 2_Dense/ with a
Linear's weight and its own config.json, which is no transformers config). Each is analysed
end to end; every layer's spectral norm is that of the stored weight, in float64."""

from __future__ import annotations

import json
import math
from contextlib import closing
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from esd_worker.analysis import checkpoints
from esd_worker.analysis.checkpoints import Combined, Component, combined, open_components
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.errors import PermanentModelError
from tests.support.builders import run_analysis

CONV_NORM = 0.5  # AnalysisSettings' default


def _normal(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def make_pipeline(root: Path) -> Path:
    """A diffusers-shaped folder: unet/, text_encoder/, vae/ with weights; scheduler/ and
    tokenizer/ without; a fp16 variant beside the unet's weights and a single-file checkpoint
    at the top, neither of which is read."""
    _json(root / "model_index.json", {
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "PNDMScheduler"]})
    _json(root / "unet" / "config.json", {"_class_name": "UNet2DConditionModel",
                                          "_diffusers_version": "0.30.0", "in_channels": 16})
    attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    unet = {"conv_in.weight": _normal(32, 16, 3, 3, seed=1), "conv_in.bias": _normal(32, seed=2),
            f"{attn}.to_q.weight": _normal(32, 32, seed=3),
            f"{attn}.to_k.weight": _normal(32, 32, seed=4),
            "down_blocks.0.resnets.0.norm1.weight": torch.ones(32)}
    save_file(unet, root / "unet" / "diffusion_pytorch_model.safetensors")
    save_file({k: (v * 3).half() for k, v in unet.items()},
              root / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    _json(root / "vae" / "config.json", {"_class_name": "AutoencoderKL"})
    save_file({"encoder.conv_in.weight": _normal(24, 16, 3, 3, seed=5),
               "decoder.conv_out.weight": _normal(16, 24, 3, 3, seed=6),
               "encoder.mid_block.attentions.0.to_q.weight": _normal(24, 24, seed=7),
               "encoder.mid_block.attentions.0.to_q.bias": _normal(24, seed=8)},
              root / "vae" / "diffusion_pytorch_model.safetensors")
    torch.manual_seed(9)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64, max_position_embeddings=16, projection_dim=16, bos_token_id=0,
        eos_token_id=1, pad_token_id=1))
    clip.save_pretrained(root / "text_encoder")
    _json(root / "scheduler" / "scheduler_config.json", {"_class_name": "PNDMScheduler"})
    _json(root / "tokenizer" / "vocab.json", {"a": 0})
    save_file({"model.diffusion_model.out.weight": _normal(40, 40, seed=10)},
              root / "v1-5-pruned-emaonly.safetensors")
    return root


def make_embedder(root: Path) -> Path:
    """A sentence-transformers folder: a BertModel at the top, 1_Pooling/ (a config only),
    2_Dense/ (its Linear's weight and bias, and the Dense module's own config.json)."""
    torch.manual_seed(11)
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        vocab_size=64, max_position_embeddings=32))
    bert.save_pretrained(root)
    _json(root / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
    _json(root / "1_Pooling" / "config.json", {"word_embedding_dimension": 32,
                                               "pooling_mode_mean_tokens": True})
    _json(root / "2_Dense" / "config.json", {
        "in_features": 32, "out_features": 24, "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh"})
    save_file({"linear.weight": _normal(24, 32, seed=12), "linear.bias": _normal(24, seed=13)},
              root / "2_Dense" / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pipeline(tmp_path_factory.mktemp("pipeline") / "tiny-sd")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedder(tmp_path_factory.mktemp("embedder") / "tiny-st")


def stored(folder: Path, prefix_to_file: dict[str, str], layer: str) -> torch.Tensor:
    """The stored weight of `layer` (a prefixed name) from its component's file."""
    for prefix, file in prefix_to_file.items():
        if layer.startswith(prefix):
            return load_file(folder / file)[layer.removeprefix(prefix) + ".weight"]
    raise KeyError(layer)


def spectral_norm(weight: torch.Tensor) -> float:
    """λ_max of the layer as the analysis defines it, from float64 singular values: a
    Conv2d's kh·kw slices (out x in) scaled by sqrt(conv_norm) and pooled."""
    w = weight.double()
    if w.dim() == 4:
        w = w.permute(2, 3, 0, 1).reshape(-1, w.shape[0], w.shape[1]) * math.sqrt(CONV_NORM)
    return float(torch.linalg.svdvals(w).max()) ** 2


def linear_names(model: torch.nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# --- components and the one Tensors over them ----------------------------------------------


def test_pipeline_components(pipeline: Path) -> None:
    """Each component folder holding weights, under its folder's name; scheduler/ and
    tokenizer/ (no weights) and the top's single-file checkpoint are not components."""
    components = open_components(pipeline)
    try:
        assert [(c.prefix, c.directory) for c in components] == [
            ("text_encoder/", pipeline / "text_encoder"), ("unet/", pipeline / "unet"),
            ("vae/", pipeline / "vae")]
        assert all(isinstance(c.tensors, Checkpoint) for c in components)
        assert [c.config() is not None for c in components] == [True, True, True]
        assert [p.name for p in components[1].tensors.files] == [  # type: ignore[attr-defined]
            "diffusion_pytorch_model.safetensors"]
    finally:
        for c in components:
            c.tensors.close()


def test_combined_keys_and_dispatch(pipeline: Path) -> None:
    """One Tensors: each component's keys under its prefix, in component order; each call
    answered by the component; close closes them all."""
    components = open_components(pipeline)
    tensors = combined(components)
    assert isinstance(tensors, Combined) and tensors.directory == pipeline
    expected = [c.prefix + k for c in components for k in c.tensors.keys()]  # noqa: SIM118
    assert tensors.keys() == expected
    key = "unet/conv_in.weight"
    assert key in tensors and "conv_in.weight" not in tensors
    unet = components[1].tensors
    assert tensors.shape(key) == (32, 16, 3, 3) == unet.shape("conv_in.weight")
    assert tensors.dtype(key) == "F32"
    assert torch.equal(tensors.read(key), unet.read("conv_in.weight"))
    assert torch.equal(tensors.read_row(key, 2), unet.read("conv_in.weight")[2])
    assert tensors.nbytes(key) == 32 * 16 * 9 * 4 and not tensors.in_memory(key)
    buffer = torch.empty(tensors.nbytes(key), dtype=torch.uint8)
    assert torch.equal(tensors.read_into(key, buffer), tensors.read(key))
    assert tensors.scheme(key) is None and tensors.refusal(key) is None
    assert tensors.folded() == {}
    tensors.close()
    assert all(c.tensors.keys() == [] for c in components)  # each Checkpoint closed


def test_a_plain_model_is_as_before(embedder: Path, tmp_path: Path) -> None:
    """A folder with one checkpoint at its top: one component under no prefix, whose
    Checkpoint `combined` hands back as it is."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors"):
        (plain / name).write_bytes((embedder / name).read_bytes())
    (plain / "onnx").mkdir()
    save_file({"w.weight": torch.ones(4, 4)}, plain / "onnx" / "model.safetensors")
    components = open_components(plain)
    assert [(c.prefix, c.directory) for c in components] == [("", plain)]
    assert isinstance(components[0].tensors, Checkpoint)
    with closing(combined(components)) as tensors:
        assert tensors is components[0].tensors


def test_no_weights_is_the_checkpoints_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PermanentModelError, match="no weights in"):
        open_components(tmp_path)


def test_what_was_opened_is_closed_when_a_later_one_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = make_pipeline(tmp_path / "broken")
    (broken / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\xff" * 64)

    class Recorded(Checkpoint):
        closed = False  # set by close

        def __init__(self, directory: Path, **kwargs: object) -> None:
            super().__init__(directory, **kwargs)  # type: ignore[arg-type]
            opened.append(self)

        def close(self) -> None:
            self.closed = True
            super().close()

    opened: list[Recorded] = []
    monkeypatch.setattr(checkpoints, "Checkpoint", Recorded)
    with pytest.raises(PermanentModelError, match="corrupt safetensors file"):
        open_components(broken)
    assert [c.directory.name for c in opened] == ["text_encoder", "unet"]
    assert all(c.closed for c in opened)


def test_a_key_in_two_components_is_refused(tmp_path: Path) -> None:
    save_file({"x.weight": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    one = Checkpoint(tmp_path)
    components = [Component("m/", tmp_path / "m", one), Component("m/", tmp_path / "m", one)]
    with pytest.raises(PermanentModelError, match="stored in two components"):
        Combined(components)
    one.close()


def test_embedder_components(embedder: Path) -> None:
    """The top's model under no prefix, then 2_Dense/ (1_Pooling holds no weights)."""
    components = open_components(embedder)
    with closing(combined(components)) as tensors:
        assert [c.prefix for c in components] == ["", "2_Dense/"]
        assert "2_Dense/linear.weight" in tensors and tensors.shape(
            "2_Dense/linear.weight") == (24, 32)
        assert tensors.directory == embedder


# --- end to end ----------------------------------------------------------------------------


def _check_rows(folder: Path, rows: dict[str, dict[str, str]], files: dict[str, str]) -> None:
    for layer, row in rows.items():
        expected = spectral_norm(stored(folder, files, layer))
        assert row["status"] == "ok", (layer, row["status"])
        assert math.isclose(float(row["spectral_norm"]), expected, rel_tol=1e-6), layer


def test_a_pipeline_analysed(pipeline: Path, tmp_path: Path) -> None:
    """Every component's layers under its prefix: the text encoder's as its architecture
    names them, unet's and vae's by their tensor names (their config.json is no
    transformers config); the fp16 variant and the top's checkpoint are not read."""
    result = run_analysis(pipeline, tmp_path / "out", precision="float64")
    clip = transformers.CLIPTextModel.from_pretrained(pipeline / "text_encoder")
    attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    expected = ({f"text_encoder/{n}" for n in linear_names(clip)}
                | {"unet/conv_in", f"unet/{attn}.to_q", f"unet/{attn}.to_k",
                   "vae/encoder.conv_in", "vae/decoder.conv_out",
                   "vae/encoder.mid_block.attentions.0.to_q"})
    assert set(result.layers) == expected
    assert result.row("unet/conv_in")["layer_type"] == "Conv2d"
    assert result.row("text_encoder/encoder.layers.0.self_attn.q_proj")[
        "layer_type"] == "Linear"
    assert result.marker["architecture"].startswith("text_encoder:CLIPTextModel+unet:")
    _check_rows(pipeline, {n: result.row(n) for n in expected}, {
        "text_encoder/": "text_encoder/model.safetensors",
        "unet/": "unet/diffusion_pytorch_model.safetensors",
        "vae/": "vae/diffusion_pytorch_model.safetensors"})


def test_an_embedder_analysed(embedder: Path, tmp_path: Path) -> None:
    """The BERT at the top as before (no prefix), and 2_Dense/linear (its config.json is the
    module's, not a transformers config: found by name)."""
    result = run_analysis(embedder, tmp_path / "out", precision="float64")
    bert = transformers.BertModel.from_pretrained(embedder)
    expected = linear_names(bert) | {"2_Dense/linear"}
    assert set(result.layers) == expected
    assert result.row("2_Dense/linear")["layer_type"] == "Matrix"
    _check_rows(embedder, {n: result.row(n) for n in expected},
                {"2_Dense/": "2_Dense/model.safetensors", "": "model.safetensors"})
