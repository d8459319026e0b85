"""docs/api.md documents the API as it is: every public name, every argument of analyze, load
and plot_esd, every Sweep method and the WeightWatcher columns the frames add; and importing
the API imports no torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import esd_sweep
from esd_sweep.results import Sweep
from tests.support import REPO_ROOT

DOC = (REPO_ROOT / "docs" / "api.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(set(esd_sweep.__all__) - {"Sweep", "analyse"}))
def test_every_public_name_is_documented(name: str) -> None:
    assert f"esd_sweep.{name}" in DOC


@pytest.mark.parametrize(("function", "argument"), [
    (function, argument)
    for function in ("analyze", "load", "plot_esd")
    for argument in inspect.signature(getattr(esd_sweep, function)).parameters
])
def test_every_argument_is_documented(function: str, argument: str) -> None:
    assert f"`{argument}`" in DOC or f"{argument}=" in DOC or f"({argument}," in DOC, argument


@pytest.mark.parametrize("method", [m for m in vars(Sweep) if not m.startswith("_")])
def test_every_sweep_method_is_documented(method: str) -> None:
    assert f"`{method}(" in DOC


@pytest.mark.parametrize("column", ["layer_id", "longname", "lambda_max", "sv_max", "warning"])
def test_the_added_columns_are_documented(column: str) -> None:
    assert f"| `{column}` |" in DOC


def test_importing_the_api_imports_no_torch() -> None:
    code = ("import sys, esd_sweep; esd_sweep.load; esd_sweep.plot_esd; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
