"""What the fault tests share: tiny models, a model list, the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import check_files, read_marker
from esd_worker.core.store.stores import LocalStore, Store
from tests.controller.test_sweep import make_tiny_gpt2, write_model_list
from tests.support import REPO_ROOT

ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("fault-models")
    return [make_tiny_gpt2(base / f"gpt2-{i}", seed=i) for i in range(3)]


@pytest.fixture
def model_list(tiny_models: list[Path], tmp_path: Path) -> Path:
    return write_model_list(tmp_path / "models.csv", [(str(p), "", "") for p in tiny_models])


@pytest.fixture
def keys(tiny_models: list[Path]) -> list[str]:
    return [model_key(str(p)) for p in tiny_models]


def esd_sweep_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "controller.cli", *args]


def run_args(model_list: Path, output: str, *extra: str) -> list[str]:
    """`esd-sweep run`'s arguments for the list and output, on the CPU, quick retries."""
    return ["run", "--model-list", str(model_list), "--output-dir", output,
            "--device", "cpu", "--retry-backoff", "0.1", *extra]


def esd_sweep(*args: str, env: Mapping[str, str] | None = None,
              preexec_fn: Callable[[], None] | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(esd_sweep_argv(*args), capture_output=True, text=True,
                          env=os.environ | ENV | dict(env or {}), cwd=REPO_ROOT,
                          timeout=timeout, preexec_fn=preexec_fn)


def status(model_list: Path, output: str, env: Mapping[str, str] | None = None) -> Any:
    done = esd_sweep("status", "--model-list", str(model_list), "--output-dir", output,
                     env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def whole(store: Store, key: str) -> bool:
    """The model's marker is there and the files it seals are listed at their sizes."""
    marker = read_marker(store, key)
    return marker is not None and check_files(store, marker) is None


def all_whole(out: Path, keys: Sequence[str]) -> bool:
    store = LocalStore(out)
    return all(whole(store, key) for key in keys)
