"""`esd-worker --self-check`: one small Gram + eigvalsh on the device the analysis would pick,
checked against float64 LAPACK, reported as one JSON line on stdout.

Owns the self-check's computation and its report (the fields `esd-sweep doctor` reads: the
device used, what torch and CUDA say, the error against float64). The device is picked by
esd_worker.analysis.analyze.select_device and the spectrum computed by
esd_worker.analysis.spectra.compute_spectrum, exactly as for a model's layer, so a worker that would
analyse on the CPU although it was given a GPU (the old scripts' silent fallback) reports
"cpu" here. Does not judge whether that device is the right one: the controller knows
which GPU it gave the worker (controller.doctor.doctor).

Exit status: 0 the spectrum matched within TOLERANCE; 6 the device asked for cannot be
used (--device cuda without CUDA, a CUDA error: esd_worker.core.errors.device_fault); 3 the
numbers are wrong.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import torch

from esd_worker.analysis.analyze import select_device
from esd_worker.analysis.layers import LINEAR
from esd_worker.analysis.spectra import Spectrum, compute_spectrum
from esd_worker.core.errors import EXIT_OK, EXIT_PERMANENT, exit_code_for
from esd_worker.core.redact import redact

log = logging.getLogger(__name__)

# A layer small enough to take well under a second anywhere, big enough that its Gram
# matrix (256 x 256) goes through the device's real eigensolver rather than a toy path.
SHAPE = (512, 256)
SEED = 20260516
# Largest eigenvalue error allowed, relative to the largest eigenvalue: float32 round-off
# of a 256 x 256 Gram is ~1e-6 of λ_max; a wrong kernel, a broken driver or TF32 matmuls
# (~1e-3) are far above this.
TOLERANCE = 1e-4


def probe_matrix() -> np.ndarray:
    """The self-check's weight: float32 Gaussian, fixed seed, scaled so that λ_max ≈ 3."""
    rng = np.random.default_rng(SEED)
    rows = SHAPE[0]
    return (rng.standard_normal(SHAPE) / np.sqrt(rows)).astype(np.float32)


def reference_eigenvalues(weight: np.ndarray) -> np.ndarray:
    """Eigenvalues of WᵀW from float64 LAPACK (numpy), ascending: the ground truth."""
    w64 = weight.astype(np.float64)
    small = w64.T @ w64 if w64.shape[0] >= w64.shape[1] else w64 @ w64.T
    return np.sort(np.clip(np.linalg.eigvalsh(small), 0.0, None))


def max_relative_error(found: np.ndarray, expected: np.ndarray) -> float:
    """max |found - expected| / max(expected); inf when the shapes differ."""
    if found.shape != expected.shape:
        return float("inf")
    scale = float(expected.max()) if expected.size else 0.0
    return float(np.max(np.abs(found - expected)) / scale) if scale > 0 else float("inf")


def _torch_facts() -> dict[str, Any]:
    """What torch says about CUDA, whatever device ends up used."""
    available = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _device_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": "cpu", "device_name": platform.processor() or platform.machine(),
                "device_uuid": None, "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device),
            "device_uuid": str(uuid) if uuid is not None else None}


def self_check(
    requested: str, *, compute: Callable[..., Spectrum] = compute_spectrum,
) -> tuple[int, dict[str, Any]]:
    """(exit status, report): the device `requested` resolves to, and the check on it.

    compute: the analysis' spectrum function (a parameter so that tests can hand in a wrong
    one and see it caught)."""
    report: dict[str, Any] = {"selfcheck": "esd-worker", "requested": requested,
                              "shape": list(SHAPE), "ok": False, "device": None,
                              "max_rel_error": None, "seconds": None, "error": None}
    try:
        report.update(_torch_facts())
        device = select_device(requested)
        report.update(_device_facts(device))
        weight = probe_matrix()
        expected = reference_eigenvalues(weight)
        started = time.perf_counter()
        spectrum = compute(torch.from_numpy(weight).to(device), LINEAR)
        report["seconds"] = round(time.perf_counter() - started, 4)
        error = max_relative_error(spectrum.evals, expected)
        report["max_rel_error"] = error
    except Exception as e:  # a report is the point: every failure goes into it
        report["error"] = redact(f"{type(e).__name__}: {e}".splitlines()[0])
        return exit_code_for(e), report
    if not error <= TOLERANCE:
        report["error"] = (f"eigenvalues off by {error:.3g} of the largest (allowed "
                           f"{TOLERANCE:g}) on {report['device']}")
        return EXIT_PERMANENT, report
    report["ok"] = True
    return EXIT_OK, report


def run_self_check(requested: str, out: IO[str] | None = None) -> int:
    """Print the report as one JSON line on `out` (stdout); the exit status."""
    code, report = self_check(requested)
    if report["error"]:
        log.error("self-check failed: %s", report["error"])
    else:
        log.info("self-check passed on %s (%s): max relative error %.2g in %.3f s",
                 report["device"], report["device_name"], report["max_rel_error"],
                 report["seconds"])
    stream = out or sys.stdout
    stream.write(json.dumps(report, sort_keys=True) + "\n")
    stream.flush()
    return code
