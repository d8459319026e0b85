"""Every tensor a checkpoint holds is accounted for (esd_worker.analysis.modulemap,
esd_worker.analysis.accounting): a layer row, or skipped by a documented rule (embeddings
without --include-embeddings, a tied head's stored copy, a key the model class ignores on
load, vectors), as result.json's coverage records. The checkpoint is the truth: a stored
matrix no class built from config.json holds is analysed under its checkpoint name; a MoE's
experts, stored 2-D or as 3-D stacks, are rows of their own.

Small models built with transformers' config classes and save_pretrained, their config.json
or safetensors file edited afterwards; the real `esd-worker` entry point in this process."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from esd_worker.analysis.accounting import RULES, UnexplainedTensors, classify
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.errors import PermanentModelError
from tests.support.builders import make_bert, make_gpt2, make_llama, run_analysis

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


LLAMA_BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize(
    ("build", "rows", "note"),
    [
        pytest.param(lambda d: _config(make_llama(d, num_layers=2), num_hidden_layers=1),
                     {f"model.layers.1.{m}": "Matrix" for m in LLAMA_BLOCK},
                     "7 stored matrices are no parameter of LlamaForCausalLM",
                     id="llama-config-says-1-block-of-2"),
        pytest.param(lambda d: _config(make_gpt2(d, n_layer=2), n_layer=1),
                     {"transformer.h.1.attn.c_attn": "Matrix", "transformer.h.1.mlp.c_proj":
                      "Matrix"},
                     "4 stored matrices are no parameter of GPT2LMHeadModel",
                     id="gpt2-config-says-1-block-of-2"),
        pytest.param(lambda d: _config(_mixtral(d), num_hidden_layers=1),
                     {"model.layers.1.block_sparse_moe.experts.3.w2": "Expert",
                      "model.layers.1.self_attn.q_proj": "Matrix"},
                     "no parameter of MixtralForCausalLM",
                     id="mixtral-config-says-1-block-of-2"),
        pytest.param(lambda d: _add(make_llama(d), "model.extra_proj.weight",
                                    torch.randn(16, 32)),
                     {"model.extra_proj": "Matrix"}, "(e.g. model.extra_proj.weight)",
                     id="llama-stray-matrix"),
        pytest.param(lambda d: _add(make_gpt2(d), "transformer.h.0.extra_conv.weight",
                                    torch.randn(8, 8, 3, 3)),
                     {"transformer.h.0.extra_conv": "Conv2d"}, "1 stored matrices",
                     id="gpt2-stray-conv"),
        pytest.param(lambda d: _add(_t5(d), "decoder.block.0.layer.1.EncDecAttention.x.weight",
                                    torch.randn(32, 2)),
                     {"decoder.block.0.layer.1.EncDecAttention.x": "Matrix"},
                     "no parameter of T5ForConditionalGeneration", id="t5-stray-matrix"),
    ],
)
def test_a_stored_matrix_the_model_does_not_hold_is_analysed_by_its_name(
    tmp_path: Path, build: Callable[[Path], Path], rows: dict[str, str], note: str,
) -> None:
    """The checkpoint is the truth: a stored matrix that no class built from config.json
    holds (a config.json that says fewer blocks than are stored, a stray matrix) is analysed
    under its checkpoint name, the note says how many, and nothing is unexplained."""
    result = run_analysis(build(tmp_path / "model"), tmp_path / "out")
    for layer, layer_type in rows.items():
        assert result.row(layer)["layer_type"] == layer_type, layer
    assert note in result.marker["discovery_note"], result.marker["discovery_note"]
    coverage = result.marker["coverage"]
    assert coverage["analysed"]["matrices"] == len(result.rows)


def test_a_stored_matrix_named_like_a_norm_is_skipped_by_the_norm_rule(tmp_path: Path) -> None:
    result = run_analysis(_add(make_llama(tmp_path / "m"), "model.layers.0.extra_norm.weight",
                               torch.randn(16, 32)), tmp_path / "out")
    assert "model.layers.0.extra_norm" not in result.layers
    assert result.marker["coverage"]["skipped"]["norm"]["example"] == (
        "model.layers.0.extra_norm.weight")


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
    ("build", "architecture", "layers", "note", "skipped"),
    [
        pytest.param(_tied_llama_with_head_copy, "LlamaForCausalLM", LLAMA_LAYERS, "",
                     {"tied_copy": 1, "embedding": 0}, id="tied-head-stored-too"),
        pytest.param(lambda d: _add(_t5(d), "decoder.block.0.layer.1.EncDecAttention."
                                    "relative_attention_bias.weight", torch.randn(32, 2)),
                     "T5ForConditionalGeneration", None, "", {"ignored_on_load": 1},
                     id="t5-key-its-class-ignores"),
        pytest.param(lambda d: _config(make_bert(d), architectures=None), "BertModel",
                     [*[f"encoder.layer.{i}.{m}" for i in range(2) for m in (
                         "attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense")],
                      "pooler.dense"],
                     "BertLMHeadModel does not explain the checkpoint as well as BertModel "
                     "does", {"embedding": 3}, id="bert-without-architectures"),
        pytest.param(_bert_pretraining, "BertForPreTraining", None,
                     "BertForMaskedLM does not explain the checkpoint as well as "
                     "BertForPreTraining does", {},
                     id="bert-pretraining-checkpoint-named-masked-lm"),
    ],
)
def test_what_the_model_holds_and_does_not_analyse_is_skipped_by_a_rule(
    tmp_path: Path, build: Callable[[Path], Path], architecture: str,
    layers: list[str] | None, note: str, skipped: dict[str, int],
) -> None:
    """Stored tensors the model holds without analysing them (a tied head's copy, a key the
    class tells transformers to ignore, embeddings) are skipped by a named rule in
    result.json's coverage; when config.json names no class, or one without the heads the
    checkpoint holds, the class that holds the checkpoint best is the model (the bare
    BertModel of a bare checkpoint, never a head it does not store; BERT's pretraining model
    with its pooler and next-sentence head), and the note says which class did not."""
    result = run_analysis(build(tmp_path / "model"), tmp_path / "out", precision="float64")
    assert result.marker["architecture"] == architecture
    assert result.marker["layer_discovery"] == "architecture"
    if layers is not None:
        assert result.layers == layers
    assert note in result.marker["discovery_note"] if note else (
        result.marker["discovery_note"] == "")
    coverage = result.marker["coverage"]
    for rule, count in skipped.items():
        assert coverage["skipped"].get(rule, {}).get("tensors", 0) == count, coverage
    if architecture == "BertForPreTraining":
        assert {"bert.pooler.dense", "cls.seq_relationship"} <= set(result.layers)
        assert result.row("cls.seq_relationship")["status"] == "too_small"  # 2 x 32


def test_moe_experts_are_analysed_one_row_per_stored_expert_matrix(tmp_path: Path) -> None:
    """A Mixtral checkpoint stores each expert's matrices 2-D (transformers fuses them into
    3-D parameters on load): each is a row of type Expert under its checkpoint name, the
    router too, and every number is the stored matrix's."""
    folder = _mixtral(tmp_path / "model")
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    stored = load_file(folder / "model.safetensors")
    for block in range(2):
        for expert in range(4):
            for w in ("w1", "w2", "w3"):
                name = f"model.layers.{block}.block_sparse_moe.experts.{expert}.{w}"
                row = result.row(name)
                assert row["layer_type"] == "Expert"
                top = torch.linalg.svdvals(stored[f"{name}.weight"].double())[0] ** 2
                assert float(row["spectral_norm"]) == pytest.approx(float(top), rel=1e-9)
    assert result.marker["coverage"]["analysed"]["matrices"] == len(result.rows)


def test_a_stack_of_experts_stored_3d_is_analysed_expert_by_expert(tmp_path: Path) -> None:
    """A 3-D expert tensor as GPT-OSS and Llama 4 store it: one row per expert, named after
    the experts part, each read alone (the slice, not the tensor)."""
    folder = _mixtral(tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    stack = torch.randn(4, 24, 32, dtype=torch.float32)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = stack
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    for expert in range(4):
        row = result.row(f"model.layers.0.mlp.experts.{expert}.gate_up_proj")
        assert row["layer_type"] == "Expert"
        assert (int(row["M"]), int(row["N"])) == (24, 32)
        top = torch.linalg.svdvals(stack[expert].double())[0] ** 2
        assert float(row["spectral_norm"]) == pytest.approx(float(top), rel=1e-9)


@pytest.mark.parametrize(("key", "shape"), [
    ("model.layers.0.mlp.odd_table.weight", (3, 16, 32)),  # 3-D, no module, no experts
    ("model.layers.0.odd.weight", (2, 2, 2, 4, 8, 8)),  # 6-D
], ids=["3d-untyped", "6d"])
def test_a_tensor_no_rule_explains_fails_the_model_naming_it(
    tmp_path: Path, key: str, shape: tuple[int, ...]) -> None:
    """Neither a layer nor skipped by a documented rule: the model fails for good, before
    any layer is computed, with one line naming the tensor; no result says it is done."""
    folder = _add(make_llama(tmp_path / "model"), key, torch.randn(*shape))
    with pytest.raises(UnexplainedTensors) as failed:
        run_analysis(folder, tmp_path / "out")
    assert key in str(failed.value)
    assert "not marked done" in str(failed.value)
    assert not list((tmp_path / "out").rglob("result.json"))


def test_docs_list_every_skip_rule() -> None:
    """docs/metrics.md's table of skip rules is the code's (accounting.RULES), no more."""
    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    section = text.split("- Skipped, by rule", 1)[1].split("\n\n", 2)[1]
    documented = re.findall(r"^\s*\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert documented == list(RULES)


@pytest.mark.parametrize(("key", "shape", "expected"), [
    ("transformer.wte.weight", (64, 32), "embedding"),
    ("token_embd.weight", (64, 32), "embedding"),  # GGUF
    ("vit.embeddings.position_embeddings", (1, 17, 32), "embedding"),
    ("vit.embeddings.cls_token", (1, 1, 32), "vector"),
    ("model.layers.0.mlp.experts.down_proj_bias", (4, 32), "vector"),
    ("model.layers.0.input_layernorm.weight", (32,), "vector"),
    ("model.layers.0.q_norm.weight", (4, 8), "norm"),
    ("embeddings.position_ids", (1, 16), "vector"),  # one dimension once its 1 goes
    ("relative_position_index", (16, 16), "integer"),
    ("unet.time_embedding.linear_1.weight", (64, 32), "Matrix"),  # under an embedding: a map
    ("vision.patch_embed.proj.weight", (32, 3, 4, 4), "Conv2d"),
    ("gpt_neox.embed_out.weight", (64, 32), "Matrix"),  # a head, not an embedding
    ("visual.attnpool.in_proj_weight", (96, 32), "Matrix"),
    ("model.layers.0.mlp.experts.3.w1.weight", (16, 32), "Expert"),
    ("blk.0.ffn_up_exps.weight", (4, 16, 32), "Expert"),  # GGUF expert stack
    ("model.layers.0.mystery.weight", (4, 16, 32), None),  # 3-D, no module, no experts
])
def test_what_a_tensor_no_module_types_is(key: str, shape: tuple[int, ...],
                                          expected: str | None) -> None:
    """By its name, shape and dtype alone (the map without an architecture): a rule, a row
    type, or None (unexplained: the model would fail naming it)."""
    dtype = torch.int64 if key.endswith(("position_ids", "_index")) else torch.float32
    tensors = Checkpoint.of_tensors({key: torch.zeros(shape, dtype=dtype)}, name="t")
    what = classify(tensors, key, name=key, include_embeddings=False, stack=False)
    got = what.rule or (what.rows[0][2] if what.rows else None)
    assert got == expected
    if got == "Expert" and len(shape) == 3:
        assert [row[1] for row in what.rows] == [f"{key}[{i}]" for i in range(shape[0])]


def test_an_integer_matrix_of_an_unknown_quantization_is_a_row_not_skipped() -> None:
    """HQQ stores its codes as `W_q` (uint8, 2-D): not a weight any view dequantizes, so a
    row that says unsupported_dtype, never a skip."""
    key = "model.layers.0.self_attn.q_proj.W_q"
    tensors = Checkpoint.of_tensors({key: torch.zeros(16, 32, dtype=torch.uint8)}, name="t")
    what = classify(tensors, key, name=key, include_embeddings=False, stack=False)
    assert what.rule is None and what.rows[0][1:3] == (key, "Matrix")


def test_a_stored_head_that_differs_from_the_tied_embedding_is_its_own(tmp_path: Path) -> None:
    """tie_word_embeddings, yet the checkpoint stores an lm_head of other values: transformers
    does not tie them, and neither does the analysis (the head's own numbers, no tied_copy)."""
    folder = make_llama(tmp_path / "model", tie_word_embeddings=True)
    head = torch.randn(64, 32) * 3
    _add(folder, "lm_head.weight", head)
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    top = float(torch.linalg.svdvals(head.double())[0] ** 2)
    assert float(result.row("lm_head")["spectral_norm"]) == pytest.approx(top, rel=1e-9)
    assert "tied_copy" not in result.marker["coverage"]["skipped"]


def test_a_3d_parameter_that_is_no_stack_of_experts_fails_the_model(tmp_path: Path) -> None:
    """XLNet's (d_model, heads, d_head) projections are 3-D parameters whose first axis is no
    expert count: never sliced into rows (that would be wrong numbers), the model fails
    naming them."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    torch.manual_seed(0)
    XLNetLMHeadModel(XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2, d_inner=64)
                     ).save_pretrained(tmp_path / "model")
    with pytest.raises(UnexplainedTensors, match="rel_attn"):
        run_analysis(tmp_path / "model", tmp_path / "out")


def test_scales_of_one_axis_are_vectors_whatever_their_rank(tmp_path: Path) -> None:
    """WavLM's (1, heads, 1, 1) constant: one axis longer than 1 is a vector, not a model
    failure (nor a row per head)."""
    from transformers import WavLMConfig, WavLMModel

    torch.manual_seed(0)
    WavLMModel(WavLMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                           conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                           num_conv_pos_embedding_groups=2)).save_pretrained(tmp_path / "model")
    result = run_analysis(tmp_path / "model", tmp_path / "out")
    assert not [n for n in result.layers if "gru_rel_pos_const" in n]
    assert result.marker["coverage"]["skipped"]["conv"]["tensors"] >= 2


def test_a_lora_on_a_stored_expert_matrix_is_merged(tmp_path: Path) -> None:
    """A LoRA made where each Mixtral expert was an nn.Linear (transformers 4), on a
    checkpoint storing the experts 2-D: the update merges into that expert's row."""
    base = _mixtral(tmp_path / "base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["w1"],
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM"}))
    a, b = torch.randn(2, 32), torch.randn(48, 2)
    module = "base_model.model.model.layers.0.block_sparse_moe.experts.1.w1"
    save_file({f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b},
              adapter / "adapter_model.safetensors")
    result = run_analysis(adapter, tmp_path / "out", precision="float64")
    name = "model.layers.0.block_sparse_moe.experts.1.w1"
    merged = load_file(base / "model.safetensors")[f"{name}.weight"].double() + (
        2.0 * b.double() @ a.double())
    top = float(torch.linalg.svdvals(merged)[0] ** 2)
    assert float(result.row(name)["spectral_norm"]) == pytest.approx(top, rel=1e-9)
    assert result.marker["adapter"]["merged_modules"] == 1


def test_a_tensor_stored_twice_fails_the_model(tmp_path: Path) -> None:
    """Two weight files holding the same tensor (two copies of one checkpoint): which is the
    model's cannot be told, so the model fails, naming the tensor, never last-one-wins."""
    folder = make_llama(tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").rename(folder / "model-a.safetensors")
    save_file({"lm_head.weight": tensors["lm_head.weight"] * 2}, folder / "model-b.safetensors")
    with pytest.raises(PermanentModelError, match=re.escape("'lm_head.weight' is stored twice")):
        run_analysis(folder, tmp_path / "out")
