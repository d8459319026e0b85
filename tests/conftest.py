"""Session fixtures: tiny local models built once per test run (see tests/builders.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's shared models are built."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(model_root: Path) -> Path:
    """Llama-style LM, untied lm_head, single model.safetensors (tests.builders.make_llama)."""
    from tests.builders import make_llama

    return make_llama(model_root / "llama")


@pytest.fixture(scope="session")
def llama_tied_dir(model_root: Path) -> Path:
    """Llama-style LM with tie_word_embeddings: no lm_head.weight in the checkpoint."""
    from tests.builders import make_llama

    return make_llama(model_root / "llama-tied", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def gpt2_dir(model_root: Path) -> Path:
    """GPT-2 LM: Conv1D layers, lm_head tied to wte (tests.builders.make_gpt2)."""
    from tests.builders import make_gpt2

    return make_gpt2(model_root / "gpt2")


@pytest.fixture(scope="session")
def resnet_dir(model_root: Path) -> Path:
    """Small ResNet image classifier: Conv2d layers (tests.builders.make_resnet)."""
    from tests.builders import make_resnet

    return make_resnet(model_root / "resnet")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo what the CLI's setup_logging does to the root logger when main() runs in-process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
