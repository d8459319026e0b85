"""Benchmark: refit a Llama-2-7B-sized model's stored eigenvalues on the CPU (no model, no torch).

The issue's target: seconds on the 2-core development machine. A synthetic result stands in
for the worker's: Llama-2-7B's analysed layers (32 blocks × q, k, v, o (4096 × 4096), gate,
up (11008 × 4096), down (4096 × 11008), plus lm_head (32000 × 4096)), i.e. 225 layers of
min(M, N) = 4096 eigenvalues each. Each spectrum is a Marchenko–Pastur bulk with the layer's
aspect ratio plus a Pareto tail above the bulk edge (α drawn from 2..5), so the fits behave
as on a trained model. The layers.csv, eigs.npz and result.json are written as the worker
writes them (layers.csv from layer_metrics with the worker's defaults, xmin_mid), then
`controller.results.refit.refit_store` is timed with DKS and xmin_mid at 1 thread and at one
thread per CPU. Wall and CPU seconds include reading eigs.npz and writing the tables.

  python benchmarks/bench_refit.py [--runs 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.results.refit import RefitSettings, refit_store  # noqa: E402
from esd_worker.core.command.settings import AnalysisSettings  # noqa: E402
from esd_worker.core.models.naming import model_key  # noqa: E402
from esd_worker.core.powerlaw import layer_metrics  # noqa: E402
from esd_worker.core.store.layout import EIGS_NAME, write_model_result  # noqa: E402
from esd_worker.core.store.marker import LAYERS_NAME, Marker  # noqa: E402
from esd_worker.core.store.opener import open_store  # noqa: E402
from esd_worker.core.store.results import (  # noqa: E402
    eigs_to_npz,
    layers_to_csv,
    summarize_layers,
)

MODEL = "meta-llama/Llama-2-7b-hf"
HIDDEN, INTERMEDIATE, VOCAB, BLOCKS = 4096, 11008, 32000, 32
# (name, M = out, N = in) per block, as the worker reports Linear layers.
BLOCK_LAYERS = (
    ("self_attn.q_proj", HIDDEN, HIDDEN),
    ("self_attn.k_proj", HIDDEN, HIDDEN),
    ("self_attn.v_proj", HIDDEN, HIDDEN),
    ("self_attn.o_proj", HIDDEN, HIDDEN),
    ("mlp.gate_proj", INTERMEDIATE, HIDDEN),
    ("mlp.up_proj", INTERMEDIATE, HIDDEN),
    ("mlp.down_proj", HIDDEN, INTERMEDIATE),
)


def llama_layers() -> list[tuple[str, int, int]]:
    layers = [(f"model.layers.{b}.{name}", M, N) for b in range(BLOCKS)
              for name, M, N in BLOCK_LAYERS]
    return [*layers, ("lm_head", VOCAB, HIDDEN)]


def synthetic_spectrum(rng: np.random.Generator, M: int, N: int) -> np.ndarray:
    """min(M, N) eigenvalues: a Marchenko–Pastur bulk (ratio min/max, variance σ² per entry
    scaled so λ ~ 1) with its top 5–15 % replaced by a Pareto tail starting at the bulk edge."""
    n, q = min(M, N), min(M, N) / max(M, N)
    lo, hi = (1 - np.sqrt(q)) ** 2, (1 + np.sqrt(q)) ** 2
    grid = np.linspace(lo, hi, 20001)[1:-1]
    density = np.sqrt((hi - grid) * (grid - lo)) / grid
    bulk = rng.choice(grid, size=n, p=density / density.sum())
    tail_n = int(n * rng.uniform(0.05, 0.15))
    alpha = rng.uniform(2.0, 5.0)
    tail = hi * (1.0 + rng.pareto(alpha - 1.0, tail_n))  # pdf ∝ λ^-α above the edge
    lam = np.sort(np.concatenate([bulk[: n - tail_n], tail]))
    return lam * rng.uniform(0.5, 50.0)  # layers differ in scale


def write_result(store_dir: Path, seed: int = 0) -> tuple[str, int]:
    """The synthetic 7B result (worker layout) in store_dir; returns its model_key and layers."""
    rng = np.random.default_rng(seed)
    store = open_store(str(store_dir))
    key = model_key(MODEL)
    settings = AnalysisSettings()
    rows, eigs = [], {}
    for name, M, N in llama_layers():
        lam = synthetic_spectrum(rng, M, N)
        eigs[name] = lam
        rows.append({
            "model_id": MODEL, "revision": "", "layer": name, "layer_type": "Linear",
            "M": M, "N": N, "num_params": M * N, "fix_fingers": settings.fix_fingers,
        } | layer_metrics(lam, max_dim=max(M, N), fix_fingers=settings.fix_fingers,
                          evals_thresh=settings.evals_thresh, bins=settings.bins))
    marker = Marker(
        model=MODEL, model_id=MODEL, revision=None, model_key=key, relation="base",
        parameters=settings.as_dict(), summary=summarize_layers(rows),
        layers_name=LAYERS_NAME, eigs_name=EIGS_NAME,
    )
    write_model_result(store, marker, layers=layers_to_csv(rows), eigs=eigs_to_npz(eigs))
    return key, len(rows)


def time_refit(store_dir: Path, fix_fingers: str, threads: int, runs: int) -> dict[str, Any]:
    walls, cpus = [], []
    result = None
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        result = refit_store(RefitSettings(results=str(store_dir), fix_fingers=fix_fingers,
                                           threads=threads))
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    assert result is not None
    return {"fix_fingers": fix_fingers, "threads": threads, "layers": result.counts.refit,
            "wall_s": round(min(walls), 3), "cpu_s": round(min(cpus), 3),
            "tag": result.tag}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=1, help="timed runs per setting (best kept)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"machine": machine(), "model": MODEL}
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "results"
        t = time.perf_counter()
        key, layers = write_result(store_dir)
        out["setup_s"] = round(time.perf_counter() - t, 2)
        out["layers"] = layers
        out["eigs_npz_mib"] = round((store_dir / key / "eigs.npz").stat().st_size / 2**20, 1)
        cpus = os.cpu_count() or 1
        out["refits"] = [
            time_refit(store_dir, ff, threads, args.runs)
            for ff in ("xmin_mid", "DKS") for threads in dict.fromkeys((1, cpus))
        ]
    out["machine"]["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    for r in out["refits"]:
        print(f"refit {r['fix_fingers']:8s} threads={r['threads']}: {r['layers']} layers in "
              f"{r['wall_s']:.2f}s wall, {r['cpu_s']:.2f}s CPU")
    print(json.dumps(out["machine"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
