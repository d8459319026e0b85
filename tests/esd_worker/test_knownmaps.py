"""Layer maps of known architectures without transformers (esd_worker.analysis.knownmaps):
for every entry of the table, small models built with transformers' own config classes and
saved with save_pretrained (untied and tied heads, embeddings in and out) get exactly the map
that transformers' meta model gives (esd_worker.analysis.layers.discover_layers); a checkpoint
the table does not describe whole gets None, so the model path decides; and a worker that
finds a known map never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from esd_worker.analysis.knownmaps import KNOWN, known_layer_map
from esd_worker.analysis.metamodel import discover_layers
from esd_worker.analysis.weights import Checkpoint
from tests.support import REPO_ROOT

CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
           "Qwen2ForCausalLM": "Qwen2Config"}


def saved(folder: Path, arch: str, *, tie: bool, blocks: int = 2) -> Path:
    import transformers

    config = getattr(transformers, CONFIGS[arch])(
        hidden_size=32, intermediate_size=48, num_hidden_layers=blocks, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config)
    model.save_pretrained(folder)
    return folder


def test_every_known_architecture_is_tested() -> None:
    assert set(CONFIGS) == set(KNOWN)


@pytest.mark.parametrize("embeddings", [False, True], ids=["no-embeddings", "embeddings"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", sorted(KNOWN))
def test_the_known_map_is_the_models_map(tmp_path: Path, arch: str, tie: bool,
                                         embeddings: bool) -> None:
    folder = saved(tmp_path / "m", arch, tie=tie)
    with Checkpoint(folder) as ckpt:
        known = known_layer_map(folder, ckpt, include_embeddings=embeddings)
        built = discover_layers(folder, ckpt, include_embeddings=embeddings)
    assert known is not None
    assert known == built
    assert built.discovery == "architecture" and built.architecture == arch


def _rewrite(folder: Path, change: dict[str, object]) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))


def _add_tensor(folder: Path, key: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[key] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["extra-matrix", "extra-matrix-named-like-a-norm",
                                  "missing-head", "tied-head-stored",
                                  "quantized", "remote-code", "two-architectures",
                                  "unknown-architecture", "more-blocks-than-stored",
                                  "fewer-blocks-than-stored"])
def test_what_the_table_does_not_describe_whole_goes_to_the_model(tmp_path: Path,
                                                                  case: str) -> None:
    folder = saved(tmp_path / "m", "LlamaForCausalLM", tie=case == "tied-head-stored")
    if case == "extra-matrix":
        _add_tensor(folder, "model.layers.0.mlp.extra.weight", torch.ones(4, 4))
    elif case == "extra-matrix-named-like-a-norm":
        # Every stored matrix counts, whatever its name says.
        _add_tensor(folder, "model.layers.0.extra_norm.weight", torch.ones(4, 4))
    elif case == "missing-head":
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        del tensors["lm_head.weight"]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    elif case == "tied-head-stored":
        _add_tensor(folder, "lm_head.weight", torch.ones(64, 32))
    elif case == "quantized":
        _rewrite(folder, {"quantization_config": {"quant_method": "bitsandbytes"}})
    elif case == "remote-code":
        _rewrite(folder, {"auto_map": {"AutoModelForCausalLM": "x.Y"}})
    elif case == "two-architectures":
        _rewrite(folder, {"architectures": ["LlamaForCausalLM", "LlamaModel"]})
    elif case == "unknown-architecture":
        _rewrite(folder, {"architectures": ["GPT2LMHeadModel"]})
    elif case == "fewer-blocks-than-stored":
        _rewrite(folder, {"num_hidden_layers": 1})
    else:
        _rewrite(folder, {"num_hidden_layers": 3})
    with Checkpoint(folder) as ckpt:
        assert known_layer_map(folder, ckpt, include_embeddings=False) is None


def test_a_known_model_is_analysed_without_importing_transformers(tmp_path: Path) -> None:
    folder = saved(tmp_path / "m", "LlamaForCausalLM", tie=False)
    script = (
        "import sys\n"
        "from esd_worker.analysis.analyze import analyse_model\n"
        "from esd_worker.core.command.settings import WorkerSettings\n"
        "m = analyse_model(WorkerSettings(model=sys.argv[1], output=sys.argv[2], "
        "device='cpu'))\n"
        "print(m.layer_discovery, m.architecture, m.layer_count, "
        "'transformers' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1",
                              "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["architecture", "LlamaForCausalLM", "15", "False"]
