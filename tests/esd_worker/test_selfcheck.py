"""esd_worker.serve.selfcheck and `esd-worker --self-check`: the device the analysis picks, one
Gram +
eigvalsh on it, checked against float64 LAPACK, as one JSON line (what `esd-sweep doctor`
reads). This machine has a CPU-only torch: --device cuda must be refused in the report, not
fall back to the CPU."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from esd_worker import cli
from esd_worker.analysis.spectra import Spectrum, compute_spectrum
from esd_worker.serve.selfcheck import (
    SHAPE,
    TOLERANCE,
    max_relative_error,
    probe_matrix,
    reference_eigenvalues,
    run_self_check,
    self_check,
)
from tests.support import REPO_ROOT

NO_CUDA = not torch.cuda.is_available()


def test_reference_is_the_squared_singular_values() -> None:
    """The ground truth is right: WᵀW's eigenvalues are W's singular values squared."""
    weight = probe_matrix()
    singular = np.linalg.svd(weight.astype(np.float64), compute_uv=False)
    assert np.allclose(reference_eigenvalues(weight), np.sort(singular**2), rtol=1e-12)
    assert reference_eigenvalues(weight).shape == (min(SHAPE),)


@pytest.mark.parametrize(
    ("found", "expected", "error"),
    [
        pytest.param([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], 0.0, id="equal"),
        pytest.param([1.0, 2.0, 4.4], [1.0, 2.0, 4.0], 0.1, id="largest-off-by-a-tenth"),
        pytest.param([1.2, 2.0, 4.0], [1.0, 2.0, 4.0], 0.05, id="smallest-scaled-by-largest"),
        pytest.param([1.0, 2.0], [1.0, 2.0, 4.0], float("inf"), id="missing-eigenvalue"),
        pytest.param([0.0, 0.0], [0.0, 0.0], float("inf"), id="all-zero-reference"),
    ],
)
def test_max_relative_error(found: list[float], expected: list[float], error: float) -> None:
    assert max_relative_error(np.array(found), np.array(expected)) == pytest.approx(error)


def test_cpu_check_passes_and_reports_what_torch_says() -> None:
    """On the CPU the analysis' own path (compute_spectrum: float32 Gram, float64 eigvalsh)
    lands far inside the tolerance; the report carries torch's own facts."""
    code, report = self_check("cpu")
    assert code == 0, report
    assert report["ok"] is True and report["error"] is None
    assert report["device"] == "cpu"
    assert 0 <= report["max_rel_error"] <= TOLERANCE
    assert report["torch"] == torch.__version__
    assert report["torch_cuda"] == torch.version.cuda
    assert report["cuda_available"] is torch.cuda.is_available()
    assert report["shape"] == list(SHAPE)
    assert report["seconds"] >= 0


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_not_run_on_the_cpu() -> None:
    """The old scripts' bug was a silent CPU fallback: --device cuda on a CPU-only torch
    reports no device, the reason, and exits 6 (the device: not usable on this node)."""
    code, report = self_check("cuda")
    assert code == 6
    assert report["ok"] is False
    assert report["device"] is None
    assert "CUDA is not available" in report["error"]
    assert report["cuda_available"] is False


def test_wrong_numbers_fail_the_check() -> None:
    """An eigensolver off by 1e-3 (what TF32 matmuls give) is caught: exit 3, the error
    says by how much."""

    def tf32_like(weight: torch.Tensor, layer_type: str, **kwargs: Any) -> Spectrum:
        good = compute_spectrum(weight, layer_type, **kwargs)
        return Spectrum(good.evals * (1 + 1e-3), good.M, good.N, good.max_dim)

    code, report = self_check("cpu", compute=tf32_like)
    assert code == 3
    assert report["ok"] is False
    assert report["max_rel_error"] == pytest.approx(1e-3, rel=1e-3)
    assert "eigenvalues off by" in report["error"]


def test_report_is_one_json_line() -> None:
    out = io.StringIO()
    assert run_self_check("cpu", out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["selfcheck"] == "esd-worker"


def test_cli_self_check_needs_no_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--self-check", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["ok"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--model", "org/m"], "the following arguments are required: "
                     "--output/--output-dir", id="model-without-output"),
        pytest.param(["--serve"], "the following arguments are required: "
                     "--output/--output-dir", id="serve-without-output"),
        pytest.param(["--self-check", "--model", "org/m"], "not allowed with argument",
                     id="self-check-is-its-own-mode"),
    ],
)
def test_other_modes_still_need_output(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_subprocess_sees_the_environment_it_is_given() -> None:
    """Started as the local backend starts a CPU worker (no GPU visible), the report says
    so: the controller can tell which GPU, if any, the worker saw."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    proc = subprocess.run(
        [sys.executable, "-m", "esd_worker.cli", "--self-check", "--device", "cpu"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cuda_visible_devices"] == ""
    assert report["device"] == "cpu"
    assert "self-check passed on cpu" in proc.stderr
