"""What can be checked of the image without a Docker engine: paths it copies, its entrypoint.

No Docker engine runs on the development or CI machines, so `docker build` itself is not
run here (docs/operations.md: "What was checked where"); hadolint lints the Dockerfile in
`make lint`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

ROOT = REPO_ROOT


def copy_sources() -> list[str]:
    """Every build-context source of a COPY (not --from=stage) in the Dockerfile."""
    sources: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if not parts or parts[0] != "COPY" or any(p.startswith("--from") for p in parts):
            continue
        sources += [p for p in parts[1:-1] if not p.startswith("--")]
    return sources


def test_dockerfile_copies_only_existing_paths() -> None:
    sources = copy_sources()
    assert "image/entrypoint.sh" in sources and "pyproject.toml" in sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert missing == []


def test_dockerfile_pins_base_image_and_runs_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim", text)
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    finals = [s for s in stages if s.split()[2] in ("controller", "worker")]
    assert len(finals) == 2
    for stage in finals:
        assert "USER 1000" in stage
        assert "gcc" not in stage and "build-essential" not in stage


def stage_env(stage: str) -> dict[str, str]:
    """The ENV a Dockerfile stage sets (KEY=VALUE pairs, continuation lines joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages = {s.split()[2]: s for s in re.split(r"^FROM ", text, flags=re.M)[1:]}
    env: dict[str, str] = {}
    for line in stages[stage].splitlines():
        if line.startswith("ENV "):
            env |= dict(pair.split("=", 1) for pair in line.split()[1:])
    return env


def test_worker_image_leaves_gpu_visibility_to_the_pod() -> None:
    """The worker image does not bake NVIDIA_VISIBLE_DEVICES: as "all", a pod asking for no
    GPU on a node whose default runtime is nvidia would see every GPU. The driver
    capabilities the worker needs (compute, NVML) stay."""
    env = stage_env("worker")
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["HF_HOME"] == "/cache/hf"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["esd-worker", "--version"], "esd-worker"),
        (["esd-sweep", "--version"], "esd-sweep"),
        (["gpu-exporter", "--help"], "gpu-exporter"),
    ],
    ids=["worker", "controller", "exporter"],
)
def test_entrypoint_starts_each_program(args: list[str], expected: str) -> None:
    """The entrypoint execs the program named first, with the rest as its argv."""
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([str(ROOT / "image" / "entrypoint.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout


def test_entrypoint_without_arguments_is_a_usage_error() -> None:
    done = subprocess.run([str(ROOT / "image" / "entrypoint.sh")], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr
