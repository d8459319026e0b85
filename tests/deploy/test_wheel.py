"""The wheel a researcher (or the Dockerfile) installs: built offline from exactly the files
the Dockerfile's build stage copies, it holds every package of the source tree, the type
markers, the license and both commands, and once installed in a fresh venv it sweeps a
model with no help from this checkout.

The fresh venv gets its dependencies, without a network, from the test venv's
site-packages through a `.pth` file. Python does not process a `.pth` file found in a
directory that a `.pth` file added, so this checkout's editable install (a `.pth` in the
test venv) stays inactive there: the test asserts the code imported is the wheel's.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

TOP_PACKAGES = ("esd_worker", "controller", "esd_sweep")
SCRIPTS = {"esd-sweep": "controller.cli:main", "esd-worker": "esd_worker.cli:main"}


def build_stage_sources() -> list[str]:
    """What the Dockerfile's `build` stage copies from the build context."""
    text = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
    stage = re.search(r"^FROM \S+ AS build\n(.*?)(?=^FROM )", text, re.M | re.S)
    assert stage is not None
    sources: list[str] = []
    for line in stage[1].splitlines():
        parts = line.split()
        if parts and parts[0] == "COPY":
            sources += parts[1:-1]
    return sources


def run(argv: list[str], *, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, f"{argv[:4]}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built offline (no build isolation: the installed setuptools, which
    constraints.txt pins) from a copy of the build stage's files, outside the checkout."""
    src = tmp_path_factory.mktemp("src")
    for name in build_stage_sources():
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--wheel-dir", str(out), str(src)], cwd=src)
    (built,) = out.glob("esd_sweep-*.whl")
    return built


def source_modules() -> set[str]:
    """Every .py file of every package (a folder with __init__.py) of the source tree."""
    found: set[str] = set()
    for top in TOP_PACKAGES:
        for init in (REPO_ROOT / top).rglob("__init__.py"):
            found |= {p.relative_to(REPO_ROOT).as_posix() for p in init.parent.glob("*.py")}
    return found


def test_the_wheel_holds_every_package_the_type_markers_license_and_commands(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = archive.read(metadata).decode()
    modules = source_modules()
    assert {f"{top}/__init__.py" for top in TOP_PACKAGES} <= modules
    assert modules - names == set()  # every module of every (sub)package
    assert {f"{top}/py.typed" for top in TOP_PACKAGES} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in scripts
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/"))]


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel installed; the test venv's packages seen through a
    .pth file at the end of its sys.path."""
    root = tmp_path_factory.mktemp("venv") / "v"
    run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)])
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib.stdout.strip()) / "_test_venv_packages.pth").write_text("\n".join(sorted(ours)))
    return root


def clean_env(home: Path) -> dict[str, str]:
    """The environment of a researcher's shell: offline hub, no PYTHONPATH to this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return env | {"HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_the_installed_wheel_is_what_runs(venv: Path, tmp_path: Path) -> None:
    probe = ("import controller, esd_worker, esd_sweep, numpy; "
             "print(controller.__file__, esd_worker.__file__, esd_sweep.__file__, numpy.__file__)")
    done = run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=clean_env(tmp_path))
    *ours, numpy = done.stdout.split()
    assert all(Path(f).is_relative_to(venv) for f in ours), ours  # not this checkout's
    assert not Path(numpy).is_relative_to(venv)  # a dependency: the .pth file's


def test_the_installed_command_sweeps_a_model_outside_the_repository(
    venv: Path, tmp_path: Path
) -> None:
    """`esd-sweep run` of the wheel, cwd outside the checkout, hub offline: exit 0 and the
    model's marker written (its workers are the venv's Python running the wheel's worker)."""
    from tests.support.builders import make_gpt2

    model = make_gpt2(tmp_path / "models" / "tiny-gpt2")
    work = tmp_path / "work"
    work.mkdir()
    with open(work / "models.csv", "w", newline="") as f:
        csv.writer(f).writerows([["model_id"], [str(model)]])
    done = run([str(venv / "bin" / "esd-sweep"), "run", "--model-list", "models.csv",
                "--output-dir", "results", "--device", "cpu"],
               cwd=work, env=clean_env(tmp_path))
    assert (work / "results" / model_key(str(model)) / "result.json").is_file(), done.stderr
