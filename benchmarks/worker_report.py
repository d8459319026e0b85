"""How benchmarks/bench_worker.py compares the worker with the baseline and prints the result:
alpha agreement, the machine it ran on, the table."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import torch

TARGET_WORKER_S = 30.0
TARGET_PEAK_GPU_MIB = 2048.0
TARGET_SPEEDUP = 8.0


def compare_alphas(
    worker: tuple[dict[str, dict[str, str]], dict[str, np.ndarray]],
    baseline: tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]],
    *,
    rtol: float,
    evals_thresh: float = 1e-5,
) -> dict[str, Any]:
    """Worker (float32 Gram + eigvalsh) vs baseline (float32 svdvals) α on the same layers.

    Where α differs by more than rtol, the eigenvalues say why: the Gram path's eigenvalues
    carry an absolute error of about eps32·λ_max, so those within that of evals_thresh can
    land on the other side of it; one eigenvalue more or less in the fit moves the median
    (xmin_mid) and α by O(1/n). Such layers are listed with their counts.
    """
    (w_rows, w_eigs), (b_rows, b_eigs) = worker, baseline
    missing = sorted(set(b_rows) - set(w_rows))
    worst_rel, worst_layer = 0.0, None
    bad: list[dict[str, Any]] = []
    top500 = 0.0
    for name, base in b_rows.items():
        row = w_rows.get(name)
        if row is None:
            continue
        a_w, a_b = float(row["alpha"]), float(base["alpha"])
        lam_w, lam_b = w_eigs.get(name), b_eigs.get(name)
        if lam_w is not None and lam_b is not None and lam_w.size == lam_b.size:
            top = slice(-min(500, lam_b.size), None)
            top500 = max(top500, float(np.max(np.abs(lam_w[top] - lam_b[top]) / lam_b[top])))
        if np.isfinite(a_w) and np.isfinite(a_b):
            rel = abs(a_w - a_b) / abs(a_b)
            if rel > worst_rel:
                worst_rel, worst_layer = rel, name
            if rel <= rtol:
                continue
        elif np.isfinite(a_w) == np.isfinite(a_b):
            continue  # both failed to fit
        else:
            rel = float("nan")
        entry: dict[str, Any] = {
            "layer": name,
            "alpha_worker": a_w,
            "alpha_baseline": a_b,
            "rel_diff": rel,
        }
        if lam_w is not None and lam_b is not None:
            entry["n_fit_worker"] = int(np.count_nonzero(lam_w > evals_thresh))
            entry["n_fit_baseline"] = int(np.count_nonzero(lam_b > evals_thresh))
            entry["explained_by_thresh_count"] = entry["n_fit_worker"] != entry["n_fit_baseline"]
        bad.append(entry)
    extra = sorted(n for n, r in w_rows.items() if n not in b_rows and r["layer_type"] == "Linear")
    return {
        "layers_compared": len(b_rows) - len(missing),
        "alpha_rtol": rtol,
        "alpha_max_rel_diff": worst_rel,
        "worst_layer": worst_layer,
        "eigs_top500_max_rel_diff": top500,
        "out_of_tolerance": bad[:20],
        "out_of_tolerance_count": len(bad),
        "missing_in_worker": missing[:20],
        "worker_only_linear": extra[:20],
        "ok": not bad and not missing,
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_mib"] = round(props.total_memory / 2**20)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["torch_threads"] = torch.get_num_threads()
    return info


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def print_report(result: dict[str, Any]) -> None:
    w, b, m = result["worker"], result.get("baseline"), result["machine"]
    where = m.get("gpu") or f"CPU ({m['cpu_count']} cores)"
    ck = result["checkpoint"]
    print(f"\nmachine: {where}; torch {m['torch']}; {m['platform']}")
    how = "reused" if ck["reused"] else f"written in {ck['write_s']} s"
    print(
        f"checkpoint: {ck['params'] / 1e9:.2f}e9 params, {ck['bytes'] / 2**30:.2f} GiB bf16, "
        f"{ck['shards']} shards, {how}"
    )
    lines = [
        ("", "worker", "baseline", "target"),
        (
            "wall time (s)",
            _fmt(w["wall_s"]),
            _fmt(b and b["wall_s"]),
            f"worker <= {TARGET_WORKER_S:g}",
        ),
        ("  of which in-process (s)", _fmt(w["timings"]["total_s"]), "-", ""),
        (
            "peak GPU memory, torch (MiB)",
            _fmt(result["worker_peak_gpu_mib"]),
            _fmt(b and b["peak_gpu_mib"]),
            f"worker <= {TARGET_PEAK_GPU_MIB:g}",
        ),
        ("peak GPU memory, NVML (MiB)", _fmt(w["nvml_peak_delta_mib"]), "-", "incl. context"),
        ("layers", _fmt(w["layer_count"]), _fmt(b and b["layers_total"]), ""),
        (
            "speedup (baseline / worker wall)",
            _fmt(result["speedup"], "x"),
            "",
            f">= {TARGET_SPEEDUP:g}x",
        ),
    ]
    width = max(len(r[0]) for r in lines)
    for r in lines:
        print(f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>10}  {r[3]}")
    if b and b["extrapolated"]:
        print(
            f"baseline: {b['layers_measured']}/{b['layers_total']} layers measured, the rest "
            f"({b['svd_fit_extrapolated_s']} s) extrapolated from per-shape means"
        )
    if "agreement" in result:
        a = result["agreement"]
        print(
            f"alphas: {a['layers_compared']} layers, max rel diff {a['alpha_max_rel_diff']:.2e} "
            f"(tolerance {a['alpha_rtol']:g}) -> {'OK' if a['ok'] else 'MISMATCH'}; "
            f"eigenvalues: top-500 max rel diff {a['eigs_top500_max_rel_diff']:.2e}"
        )
        for e in a["out_of_tolerance"]:
            why = ""
            if e.get("explained_by_thresh_count"):
                why = (
                    f" ({e['n_fit_worker']} vs {e['n_fit_baseline']} eigenvalues above "
                    "evals_thresh: float32 Gram noise at the bottom of the spectrum)"
                )
            print(
                f"  {e['layer']}: alpha {e['alpha_worker']:.6f} vs {e['alpha_baseline']:.6f}{why}"
            )
    print(f"targets met: {result['targets_met']}")
