"""Benchmark: the worker end to end vs the old scripts' way, on a Llama-2-7B-shaped checkpoint.

Writes (or reuses) a random bf16 checkpoint shaped like Llama-2-7B (32 blocks: q,k,v,o
4096×4096; gate, up 11008×4096; down 4096×11008; embed_tokens and lm_head 32000×4096;
norms), sharded safetensors with model.safetensors.index.json and a Llama-2-7B
config.json, tensor by tensor so host memory stays at one shard. Then, in one run:

  (a) worker: `esd-worker --model DIR --output TMP --device D` as a subprocess, default
      settings (xmin_mid, float32 Gram path, eigs.npz on), wall time as users see it;
      its own timings and peak GPU memory come from its result.json;
  (b) baseline, the way the old scripts did it: load the whole model
      (AutoModelForCausalLM.from_pretrained, bf16, onto the device), then for every
      nn.Linear `torch.linalg.svdvals(W.float())²` and the same fit
      (esd_worker.core.powerlaw.layer_metrics), so only loading and linear algebra differ.

and checks the two agree: same layers, alphas within --alpha-rtol.

  python benchmarks/bench_worker.py --json bench.json                  # the 7B run (GPU)
  python benchmarks/bench_worker.py --blocks 2 --hidden 512 --intermediate 1376 \
      --vocab 4000 --device cpu                                        # CPU smoke run

Targets on one H100 (issue 2): worker ≤ 30 s end to end, peak GPU memory ≤ 2 GiB,
≥ 8× faster than the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run as a script from anywhere: its own folder holds the helpers it imports.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_7b import write_checkpoint
from worker_report import (
    TARGET_PEAK_GPU_MIB,
    TARGET_SPEEDUP,
    TARGET_WORKER_S,
    compare_alphas,
    machine_info,
    print_report,
)

# --- (a) the worker ------------------------------------------------------------------------


class GpuSampler:
    """Device memory in use (NVML, MiB) sampled every 20 ms: the whole process's footprint,
    CUDA context included, which torch.cuda.max_memory_allocated does not count."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self.idle_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.idle_mib = self._used()
        except Exception:  # no NVML, no GPU, or a UUID in CUDA_VISIBLE_DEVICES: no sampling
            self._nvml = None

    def _used(self) -> float:
        return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            used = self._used()
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def delta_mib(self) -> float | None:
        if self.peak_mib is None or self.idle_mib is None:
            return None
        return round(self.peak_mib - self.idle_mib, 1)


def run_worker(model_dir: Path, *, worker_cmd: list[str], device: str) -> dict[str, Any]:
    """The worker as users run it, default settings; its wall time and result.json."""
    with tempfile.TemporaryDirectory(prefix="esd-bench-") as out:
        cmd = [*worker_cmd, "--model", str(model_dir), "--output", out, "--device", device]
        with GpuSampler() as sampler:
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"worker failed with exit code {proc.returncode}: {shlex.join(cmd)}")
        markers = list(Path(out).glob("*/result.json"))
        if len(markers) != 1:
            raise SystemExit(f"expected one result.json under {out}, found {len(markers)}")
        marker = json.loads(markers[0].read_text())
        rows = _read_layers(markers[0].parent / "layers.csv")
        eigs_path = markers[0].parent / "eigs.npz"
        eigs: dict[str, np.ndarray] = {}
        if eigs_path.is_file():
            with np.load(eigs_path) as npz:
                eigs = {name: npz[name] for name in npz.files}
    return {
        "cmd": shlex.join(cmd),
        "wall_s": round(wall, 3),
        "timings": marker.get("timings"),
        "device": marker.get("device"),
        "layer_count": marker.get("layer_count"),
        "status_counts": marker.get("status_counts"),
        "nvml_peak_delta_mib": sampler.delta_mib(),
        "rows": rows,
        "eigs": eigs,
    }


def _read_layers(path: Path) -> dict[str, dict[str, str]]:
    import csv

    with path.open(newline="") as f:
        return {row["layer"]: row for row in csv.DictReader(f)}


# --- (b) the baseline ----------------------------------------------------------------------


def _linear_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield name, module


def run_baseline(model_dir: Path, *, device: torch.device, max_s: float | None) -> dict[str, Any]:
    """Load everything onto the device, then svdvals per nn.Linear, as the old scripts did.

    With max_s, the SVD loop stops once it has run that long and the remaining layers'
    time is extrapolated from the measured mean of layers of the same shape (reported as
    such). One layer of every shape goes first so every shape has a measurement.
    """
    from transformers import AutoModelForCausalLM

    from esd_worker.core.powerlaw import layer_metrics

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, device_map=str(device)
    )
    model.eval()
    sync()
    t_load = time.perf_counter() - t0

    layers = list(_linear_layers(model))
    first_of_shape: dict[tuple[int, ...], int] = {}
    for i, (_, module) in enumerate(layers):
        first_of_shape.setdefault(tuple(module.weight.shape), i)
    firsts = set(first_of_shape.values())
    order = sorted(firsts) + [i for i in range(len(layers)) if i not in firsts]
    rows: dict[str, dict[str, Any]] = {}
    eigs: dict[str, np.ndarray] = {}
    per_shape: dict[tuple[int, ...], list[float]] = {}
    t_svd0 = time.perf_counter()
    with torch.no_grad():
        for i in order:
            name, module = layers[i]
            shape = tuple(module.weight.shape)
            if max_s is not None and time.perf_counter() - t_svd0 > max_s:
                break
            t = time.perf_counter()
            w = module.weight.data.clone().float()
            evals = torch.linalg.svdvals(w).square()
            lam = np.sort(evals.cpu().double().numpy())
            del w, evals
            rows[name] = layer_metrics(lam, max_dim=max(shape))
            eigs[name] = lam
            per_shape.setdefault(shape, []).append(time.perf_counter() - t)
    sync()
    measured_svd = time.perf_counter() - t_svd0
    missing = [layers[i] for i in order if layers[i][0] not in rows]
    extrapolated = sum(float(np.mean(per_shape[tuple(m.weight.shape)])) for _, m in missing)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "load_s": round(t_load, 3),
        "svd_fit_s": round(measured_svd, 3),
        "layers_total": len(layers),
        "layers_measured": len(rows),
        "svd_fit_extrapolated_s": round(extrapolated, 3),
        "extrapolated": bool(missing),
        "wall_s": round(t_load + measured_svd + extrapolated, 3),
        "per_shape_mean_s": {
            "x".join(map(str, k)): round(float(np.mean(v)), 4) for k, v in per_shape.items()
        },
        "peak_gpu_mib": None if peak is None else round(peak, 1),
        "rows": rows,
        "eigs": eigs,
    }


# --- agreement and report ------------------------------------------------------------------


# --- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--blocks", type=int, default=32, help="decoder blocks (default 32)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--intermediate", type=int, default=11008, help="MLP size (default 11008)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=int, default=2000, help="shard size in MiB (default 2000)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(".bench/llama7b"),
        help="checkpoint directory, reused when it matches (default .bench/llama7b)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--worker-cmd",
        default=f"{shlex.quote(sys.executable)} -m esd_worker.cli",
        help="how to start the worker (default: this python -m esd_worker.cli)",
    )
    p.add_argument("--skip-baseline", action="store_true", help="measure the worker only")
    p.add_argument(
        "--baseline-max-s",
        type=float,
        default=None,
        help="stop the baseline's SVD loop after this many seconds and extrapolate "
        "the remaining layers from per-shape means (default: run every layer)",
    )
    p.add_argument(
        "--alpha-rtol",
        type=float,
        default=1e-3,
        help="worker vs baseline alpha tolerance, relative (default 1e-3)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but CUDA is not available")
    device = torch.device("cuda:0" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    worker_device = "cuda" if device.type == "cuda" else "cpu"
    print(f"device: {device}", flush=True)

    ckpt = write_checkpoint(
        args.out,
        blocks=args.blocks,
        hidden=args.hidden,
        intermediate=args.intermediate,
        vocab=args.vocab,
        seed=args.seed,
        shard_mb=args.shard_mb,
        device=device,
    )
    gib = ckpt["bytes"] / 2**30
    if ckpt["reused"]:
        print(f"checkpoint: reusing {args.out} ({gib:.2f} GiB)", flush=True)
    else:
        rate = gib / max(ckpt["write_s"], 1e-9)
        print(
            f"checkpoint: wrote {gib:.2f} GiB to {args.out} in {ckpt['write_s']} s "
            f"({rate:.2f} GiB/s)",
            flush=True,
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the generator's blocks: not ours to count against the worker

    print("worker: running ...", flush=True)
    worker = run_worker(
        args.out.resolve(), worker_cmd=shlex.split(args.worker_cmd), device=worker_device
    )
    print(
        f"worker: {worker['wall_s']} s wall, {worker['timings']['total_s']} s in-process",
        flush=True,
    )
    worker_rows = worker.pop("rows")
    worker_eigs = worker.pop("eigs")

    result: dict[str, Any] = {
        "benchmark": "bench_worker",
        "shape": {
            "blocks": args.blocks,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
        },
        "checkpoint": ckpt,
        "machine": machine_info(device),
        "worker": worker,
        "worker_s": worker["wall_s"],
        "worker_inprocess_s": worker["timings"]["total_s"],
        "worker_peak_gpu_mib": (worker["device"] or {}).get("peak_memory_mib"),
    }
    speedup = None
    if not args.skip_baseline:
        print("baseline: loading the whole model, svdvals per layer ...", flush=True)
        baseline = run_baseline(args.out.resolve(), device=device, max_s=args.baseline_max_s)
        baseline_rows = baseline.pop("rows")
        baseline_eigs = baseline.pop("eigs")
        print(f"baseline: {baseline['wall_s']} s (load {baseline['load_s']} s)", flush=True)
        result["baseline"] = baseline
        result["baseline_s"] = baseline["wall_s"]
        result["baseline_peak_gpu_mib"] = baseline["peak_gpu_mib"]
        speedup = round(baseline["wall_s"] / worker["wall_s"], 2)
        result["speedup_inprocess"] = round(baseline["wall_s"] / worker["timings"]["total_s"], 2)
        result["agreement"] = compare_alphas(
            (worker_rows, worker_eigs), (baseline_rows, baseline_eigs), rtol=args.alpha_rtol
        )
    result["speedup"] = speedup

    targets: dict[str, bool | None] = {
        "worker_s": worker["wall_s"] <= TARGET_WORKER_S,
        "peak_gpu_mib": None
        if result["worker_peak_gpu_mib"] is None
        else result["worker_peak_gpu_mib"] <= TARGET_PEAK_GPU_MIB,
        "speedup": None if speedup is None else speedup >= TARGET_SPEEDUP,
    }
    if device.type != "cuda" or args.blocks != 32 or args.hidden != 4096:
        targets = {k: None for k in targets}  # the targets are for the 7B shape on a GPU
    result["targets_met"] = targets
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
