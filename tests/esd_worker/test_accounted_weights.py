"""Every weight matrix a checkpoint holds is accounted for (esd_worker.analysis.layers.map_modules):
analysed, or a weight of the model that is not analysed by a documented rule (embeddings
without --include-embeddings, a tied head's stored copy, a MoE's experts that transformers
fuses, a key the model class ignores on load). A stored matrix the model built from
config.json does not account for, such as the second block of a checkpoint whose config.json
says one, fails the model with one clear line; it is never marked done without it.

Small models built with transformers' config classes and save_pretrained, their config.json
or safetensors file edited afterwards; the real `esd-worker` entry point in this process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from esd_worker import cli
from esd_worker.core.errors import EXIT_PERMANENT
from esd_worker.core.models.naming import model_key
from tests.support.builders import CliResult, make_bert, make_gpt2, make_llama, run_analysis

pytestmark = pytest.mark.usefixtures("restore_logging")


def _config(folder: Path, **change: object) -> Path:
    """config.json with `change` applied (a key set to None is removed)."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) | change
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


def _add(folder: Path, key: str, value: torch.Tensor) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[key] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _mixtral(folder: Path) -> Path:
    """A Mixtral MoE of 2 blocks, 4 experts each: saved as per-expert 2-D matrices, which
    transformers fuses into 3-D parameters when it loads them."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                           num_local_experts=4)
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def _t5(folder: Path) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=48, num_layers=2, num_heads=2, d_kv=16, vocab_size=64)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _bert_pretraining(folder: Path) -> Path:
    """A BERT saved from pretraining (pooler and next-sentence head included) whose
    config.json names BertForMaskedLM, which has neither: how bert-base-uncased is stored."""
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    BertForPreTraining(config).save_pretrained(folder)
    return _config(folder, architectures=["BertForMaskedLM"])


def run_main(capsys: pytest.CaptureFixture[str], model: Path, output: Path) -> CliResult:
    code = cli.main(["--device", "cpu", "--model", str(model), "--output", str(output)])
    return CliResult(code, capsys.readouterr().err, output)


@pytest.mark.parametrize(
    ("build", "fragments"),
    [
        pytest.param(lambda d: _config(make_llama(d, num_layers=2), num_hidden_layers=1),
                     ("7 weight matrices", "LlamaForCausalLM", "model.layers.1.mlp.down_proj",
                      "and 4 more"),
                     id="llama-config-says-1-block-of-2"),
        pytest.param(lambda d: _config(make_gpt2(d, n_layer=2), n_layer=1),
                     ("4 weight matrices", "GPT2LMHeadModel", "transformer.h.1."),
                     id="gpt2-config-says-1-block-of-2"),
        pytest.param(lambda d: _config(_mixtral(d), num_hidden_layers=1),
                     ("MixtralForCausalLM", "model.layers.1.block_sparse_moe.experts.0.w1"),
                     id="mixtral-config-says-1-block-of-2"),
        pytest.param(lambda d: _add(make_llama(d), "model.extra_proj.weight",
                                    torch.randn(16, 32)),
                     ("1 weight matrix ", "(model.extra_proj.weight)"),
                     id="llama-stray-matrix"),
        pytest.param(lambda d: _add(make_llama(d), "model.layers.0.extra_norm.weight",
                                    torch.randn(16, 32)),
                     ("1 weight matrix ", "(model.layers.0.extra_norm.weight)"),
                     id="llama-stray-matrix-named-like-a-norm"),
        pytest.param(lambda d: _add(make_gpt2(d), "transformer.h.0.extra_conv.weight",
                                    torch.randn(8, 8, 3, 3)),
                     ("1 weight matrix ", "(transformer.h.0.extra_conv.weight)"),
                     id="gpt2-stray-conv"),
        pytest.param(lambda d: _add(_t5(d), "decoder.block.0.layer.1.EncDecAttention.x.weight",
                                    torch.randn(32, 2)),
                     ("1 weight matrix ", "T5ForConditionalGeneration"),
                     id="t5-stray-matrix"),
    ],
)
def test_a_stored_matrix_the_model_does_not_account_for_fails_the_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, build: Callable[[Path], Path],
    fragments: tuple[str, ...],
) -> None:
    """Neither the known-architecture map nor any class built from config.json places the
    matrix: the model fails for good (exit 3) with one line naming the first few and how
    many, and no result says it is done."""
    model = build(tmp_path / "model")
    run = run_main(capsys, model, tmp_path / "out")
    assert run.code == EXIT_PERMANENT, run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.errors) == 1, run.stderr
    for fragment in ("not part of", "config.json does not describe this checkpoint",
                     *fragments):
        assert fragment in run.errors[0], run.errors[0]
    assert not (tmp_path / "out" / model_key(str(model)) / "result.json").exists()


def _tied_llama_with_head_copy(folder: Path) -> Path:
    """Tied embeddings, and the checkpoint holds the head's copy anyway (torch.save'd state
    dicts do)."""
    make_llama(folder, tie_word_embeddings=True)
    return _add(folder, "lm_head.weight", load_file(folder / "model.safetensors")
                ["model.embed_tokens.weight"].clone())


LLAMA_LAYERS = [f"model.layers.{i}.{m}" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


@pytest.mark.parametrize(
    ("build", "architecture", "layers", "note"),
    [
        pytest.param(_tied_llama_with_head_copy, "LlamaForCausalLM", LLAMA_LAYERS,
                     "(e.g. lm_head.weight)", id="tied-head-stored-too"),
        pytest.param(lambda d: _add(_t5(d), "decoder.block.0.layer.1.EncDecAttention."
                                    "relative_attention_bias.weight", torch.randn(32, 2)),
                     "T5ForConditionalGeneration", None, "", id="t5-key-its-class-ignores"),
        pytest.param(_mixtral, "MixtralForCausalLM", None, "experts.0.w1.weight",
                     id="mixtral-experts-fused-on-load"),
        pytest.param(lambda d: _config(make_bert(d), architectures=None), "BertModel",
                     [*[f"encoder.layer.{i}.{m}" for i in range(2) for m in (
                         "attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense")],
                      "pooler.dense"],
                     "BertLMHeadModel does not account for 1 weight matrix of the checkpoint "
                     "(e.g. pooler.dense.weight); BertModel does",
                     id="bert-without-architectures"),
        pytest.param(_bert_pretraining, "BertForPreTraining", None,
                     "BertForMaskedLM does not account for 2 weight matrices of the "
                     "checkpoint (e.g. bert.pooler.dense.weight); BertForPreTraining does",
                     id="bert-pretraining-checkpoint-named-masked-lm"),
    ],
)
def test_what_the_model_accounts_for_is_not_a_failure(
    tmp_path: Path, build: Callable[[Path], Path], architecture: str,
    layers: list[str] | None, note: str,
) -> None:
    """Stored matrices the model accounts for without analysing them (a tied head's copy,
    a key the class tells transformers to ignore, a MoE's experts fused on load, said in
    the note) leave the model done; when config.json names no class, or one without the
    heads the checkpoint holds, the first class that accounts for every stored matrix is
    the model (the bare BertModel of a bare checkpoint, BERT's pretraining model with its
    pooler and next-sentence head), and the note says which class did not."""
    result = run_analysis(build(tmp_path / "model"), tmp_path / "out", precision="float64")
    assert result.marker["architecture"] == architecture
    assert result.marker["layer_discovery"] == "architecture"
    if layers is not None:
        assert result.layers == layers
    assert note in result.marker["discovery_note"] if note else (
        result.marker["discovery_note"] == "")
    if architecture == "BertForPreTraining":
        assert {"bert.pooler.dense", "cls.seq_relationship"} <= set(result.layers)
        assert result.row("cls.seq_relationship")["status"] == "too_small"  # 2 x 32

