"""Session fixtures: tiny local models built once per test run (see tests/support/builders.py), and
the suite's real-subprocess worker runs, all started together."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.hub import HUB_ADAPTER_REPO, HUB_MISSING_REPO, HUB_REPO, HubCache

if TYPE_CHECKING:  # builders import torch: only the tests that use them pay for it
    from tests.support.builders import BackgroundRun

# Variables that would point huggingface_hub at another cache, a token or the network.
_HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT",
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's shared models are built."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(model_root: Path) -> Path:
    """Llama-style LM, untied lm_head, one model.safetensors (support.builders.make_llama)."""
    from tests.support.builders import make_llama

    return make_llama(model_root / "llama")


@pytest.fixture(scope="session")
def llama_tied_dir(model_root: Path) -> Path:
    """Llama-style LM with tie_word_embeddings: no lm_head.weight in the checkpoint."""
    from tests.support.builders import make_llama

    return make_llama(model_root / "llama-tied", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def gpt2_dir(model_root: Path) -> Path:
    """GPT-2 LM: Conv1D layers, lm_head tied to wte (tests.support.builders.make_gpt2)."""
    from tests.support.builders import make_gpt2

    return make_gpt2(model_root / "gpt2")


@pytest.fixture(scope="session")
def resnet_dir(model_root: Path) -> Path:
    """Small ResNet image classifier: Conv2d layers (tests.support.builders.make_resnet)."""
    from tests.support.builders import make_resnet

    return make_resnet(model_root / "resnet")




@pytest.fixture(scope="session")
def hub_cache(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> HubCache:
    from tests.support.builders import fake_commit, make_hf_cache, make_lora_adapter

    root = tmp_path_factory.mktemp("hub")
    home = root / "hf"
    commit = make_hf_cache(home / "hub", HUB_REPO, llama_dir)
    adapter = make_lora_adapter(
        llama_dir, root / "adapter", target_modules=("q_proj",),
        base_model_name_or_path=HUB_REPO,
    )
    adapter_commit = make_hf_cache(
        home / "hub", HUB_ADAPTER_REPO, adapter, commit=fake_commit("lora")
    )
    env = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return HubCache(home, commit, adapter_commit, env)


@pytest.fixture(scope="session")
def worker_runs(
    hub_cache: HubCache, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, BackgroundRun]]:
    """Every run of the real `esd-worker` in a fresh interpreter that the suite needs, started
    together the first time one is asked for (each costs seconds of imports; side by side
    they use both cores). Values are tests.support.builders.BackgroundRun; call .result()."""
    from tests.support.builders import BackgroundRun, minilm_path

    out = tmp_path_factory.mktemp("runs")
    cpu = ["--device", "cpu"]
    # One BLAS/OpenMP thread each: six processes spinning two threads each on two cores
    # would mostly wait for each other.
    threads = {var: "1" for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    local = {**os.environ, **threads}
    hub = {**hub_cache.env, **threads}
    runs = {
        "minilm": BackgroundRun(["--model", str(minilm_path()), *cpu], out / "minilm", local),
        "hub-id": BackgroundRun(["--model", HUB_REPO, *cpu], out / "hub-id", hub),
        "hub-id@sha": BackgroundRun(
            ["--model", f"{HUB_REPO}@{hub_cache.commit}", *cpu], out / "hub-sha", hub
        ),
        "hub-missing": BackgroundRun(["--model", HUB_MISSING_REPO, *cpu], out / "hub-missing", hub),
        "hub-adapter": BackgroundRun(["--model", HUB_ADAPTER_REPO, *cpu], out / "hub-adapter", hub),
    }
    # While they run, this process computes with one thread too (tiny matrices gain nothing
    # from two, and two spinning OpenMP threads beside six processes slow everything down).
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(runs)
    torch.set_num_threads(threads_before)
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="session", autouse=True)
def _start_worker_runs_early(request: pytest.FixtureRequest) -> None:
    """Start worker_runs with the session's first test when any selected test needs them, so
    they run beside the in-process tests instead of after them."""
    if any("worker_runs" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("worker_runs")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo what the CLI's setup_logging does to the root logger when main() runs in-process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
