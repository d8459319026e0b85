"""Benchmark: one model's layers over every visible GPU (issue 16), and the kernels that decide
how long the largest models take.

Writes (or reuses) a random bf16 Llama-shaped checkpoint, 8192-hidden by default (the 70B's
width: q, k, v, o 8192², gate and up 28672×8192, down 8192×28672, lm_head 32000×8192), a
few blocks, with benchmarks/checkpoint_7b.py (sharded safetensors, index and config.json,
written on local disk: nothing is downloaded). Then, in this process, through the worker's
own analysis (esd_worker.analysis.analyze.analyse_model_with, default settings, speculation off so
the streams do every layer):

  (a) one GPU (cuda:0, as --no-parallel-gpu) and all visible GPUs (one stream each, as
      --parallel-gpu): seconds, layers/s, the layers each stream took, the peak memory
      of each GPU, and whether the two runs wrote identical layers.csv bytes and
      eigenvalues (bit for bit); scaling = t1 / (tN × N) of the analysis phase, target
      ≥ 0.85 (issue 16);
  (b) kernels: the Gram matrix WᵀW of an n×n float32 weight and torch.linalg.eigvalsh of it
      in float32 and float64 at n = 8192 and 16384 (the estimates they replace: 4096² in
      89 ms on an H100, n³ scaling);
  (c) the peak memory of one 16384-wide layer through the worker's path (stored bf16 →
      device → work dtype → isfinite → esd_worker.analysis.spectra.compute_spectrum): 16384×16384
      and the 405B MLP's 53248×16384 in float32, 16384² in float64, against the estimate
      esd_worker.analysis.streams.layer_peak_bytes that the worker checks before each layer.

  python benchmarks/bench_multi_gpu.py --json multi_gpu.json          # GPU machine
  python benchmarks/bench_multi_gpu.py --device cpu --hidden 512 --streams 2  # CPU smoke run

On the CPU, --streams K runs K streams on the CPU ("devices" [cpu] * K): a check that the
code path works and gives identical results, not a speed measurement; (c) needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_7b import write_checkpoint

TARGET_SCALING = 0.85
MiB = 2**20


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if info["gpu_count"]:
        props = [torch.cuda.get_device_properties(i) for i in range(info["gpu_count"])]
        info["gpus"] = [p.name for p in props]
        info["gpu_memory_mib"] = [round(p.total_memory / MiB) for p in props]
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Best of `reps` runs, in seconds (the kernels were warmed up by the caller)."""
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return round(best, 4)


# --- (a) the worker on one device and on all ------------------------------------------------


def warm_up(devices: list[torch.device]) -> None:
    """CUDA context, cuBLAS and cuSOLVER handles on every device before anything is timed."""
    from esd_worker.analysis.spectra import compute_spectrum

    for device in devices:
        compute_spectrum(torch.ones(64, 32, device=device), "Linear")
        _sync(device)


def run_analysis(model_dir: Path, devices: list[torch.device], *, precision: str,
                 speculate: str) -> dict[str, Any]:
    """analyse_model_with on `devices` into a temporary store: its timings, device facts
    and what it wrote (layers.csv bytes, eigenvalues)."""
    from esd_worker.analysis.analyze import analyse_model_with
    from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings
    from esd_worker.core.store.results import eigs_from_npz

    with tempfile.TemporaryDirectory(prefix="esd-multi-gpu-") as out:
        settings = WorkerSettings(model=str(model_dir), output=out, device=devices[0].type,
                                  analysis=AnalysisSettings(precision=precision))
        t0 = time.perf_counter()
        marker = analyse_model_with(settings, speculate=speculate, devices=devices)
        wall = time.perf_counter() - t0
        folder = Path(out) / marker.model_key
        csv = (folder / "layers.csv").read_bytes()
        eigs = eigs_from_npz((folder / "eigs.npz").read_bytes())
    device = dict(marker.device or {})
    analyse_s = float(marker.timings["analyse_s"])
    layers = marker.layer_count or 0
    return {
        "streams": len(devices),
        "devices": [str(d) for d in devices],
        "wall_s": round(wall, 3),
        "analyse_s": analyse_s,
        "read_wait_s": marker.timings.get("read_wait_s"),
        "layers": layers,
        "layers_per_s": round(layers / analyse_s, 3) if analyse_s > 0 else None,
        "layers_per_stream": device.get("layers_per_stream"),
        "peak_memory_mib_per_device": device.get("peak_memory_mib_per_device"),
        "device_names": device.get("names"),
        "_csv": csv,
        "_eigs": eigs,
    }


def differences(one: dict[str, Any], many: dict[str, Any]) -> list[str]:
    """Layers whose eigenvalues differ in any bit, or 'layers.csv' when the tables differ."""
    diff = [] if one["_csv"] == many["_csv"] else ["layers.csv"]
    a, b = one["_eigs"], many["_eigs"]
    if list(a) != list(b):
        diff.append("eigs.npz layer list")
    diff += [name for name in a if name in b and a[name].tobytes() != b[name].tobytes()]
    return diff


# --- (b) kernels ----------------------------------------------------------------------------


def kernel_timings(device: torch.device, sizes: list[int], reps: int) -> dict[str, Any]:
    """Gram of an n×n float32 weight and eigvalsh of that Gram in float32 and float64."""
    out: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    # 1024: through syevd as the timed sizes (torch takes syevj for float32 up to 512).
    small = torch.randn(1024, 1024, generator=gen, device=device)
    for dtype in (torch.float32, torch.float64):  # kernels loaded, handles created
        torch.linalg.eigvalsh((small.T @ small).to(dtype))
    for n in sizes:
        runs = reps if n <= 8192 else 1
        try:
            w = torch.randn(n, n, generator=gen, device=device).mul_(0.02)
            out[f"gram_{n}"] = timed(partial(torch.matmul, w.T, w), device, runs)
            gram = w.T @ w
            del w
            out[f"eigvalsh_f32_{n}"] = timed(partial(torch.linalg.eigvalsh, gram), device, runs)
            gram64 = gram.double()
            del gram
            out[f"eigvalsh_f64_{n}"] = timed(partial(torch.linalg.eigvalsh, gram64), device, runs)
            del gram64
        except Exception as e:  # out of memory on a small GPU: say so, keep the rest
            out[f"error_{n}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"kernels n={n}: " + ", ".join(f"{k}={v}" for k, v in out.items()
                                             if k.endswith(f"_{n}")), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# --- (c) the peak memory of one wide layer --------------------------------------------------

PEAK_CASES = [((16384, 16384), "float32"), ((53248, 16384), "float32"),
              ((16384, 16384), "float64")]


def layer_peak(device: torch.device, shape: tuple[int, int], precision: str) -> dict[str, Any]:
    """Peak allocated memory of one bf16 layer through the worker's path on `device`, as
    esd_worker.analysis.analyze._Analysis._weight and analyse_layer take it, and the estimate."""
    from esd_worker.analysis.spectra import compute_spectrum
    from esd_worker.analysis.streams import layer_peak_bytes

    work = torch.float64 if precision == "float64" else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)
    host = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)
    host = host.cpu()  # the checkpoint's tensor, read into host memory
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    weight = host.to(device, non_blocking=True).to(work)
    finite = bool(torch.isfinite(weight).all())
    spectrum = compute_spectrum(weight, "Linear", precision=precision)
    del weight
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) - before
    estimate = layer_peak_bytes(shape, "Linear", precision, torch.bfloat16)
    torch.cuda.empty_cache()
    return {"shape": list(shape), "precision": precision, "finite": finite,
            "evals": len(spectrum.evals), "seconds": round(seconds, 3),
            "peak_mib": round(peak / MiB, 1), "estimate_mib": round(estimate / MiB, 1),
            "estimate_covers_peak": estimate >= peak}


# --- main -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--blocks", type=int, default=None,
                   help="decoder blocks (default 4, or 2 per GPU with more than 2 GPUs: "
                        "enough layers per stream that the last ones do not decide the time)")
    p.add_argument("--hidden", type=int, default=8192, help="hidden size (default 8192)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP size (default 3.5 × hidden: 28672 at 8192, as Llama-70B)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary (default 32000; 8 × hidden below 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=int, default=2000, help="shard size in MiB")
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint folder (default .bench/llama-h<hidden>-b<blocks>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--streams", type=int, default=None,
                   help="streams of the parallel run: GPUs to use (default all visible); "
                        "on the CPU, CPU streams (default 2)")
    p.add_argument("--precision", choices=("float32", "float64"), default="float32")
    p.add_argument("--speculate", choices=("off", "on", "auto"), default="off",
                   help="the worker's speculation (default off: the streams do every layer)")
    p.add_argument("--kernel-sizes", default=None,
                   help="comma-separated n for (b) (default 8192,16384 on CUDA, the hidden size "
                        "on the CPU; empty: skip)")
    p.add_argument("--reps", type=int, default=2, help="timed runs per kernel up to n = 8192")
    p.add_argument("--skip-peaks", action="store_true", help="skip (c)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def _devices(args: argparse.Namespace) -> tuple[torch.device, list[torch.device]]:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda, but CUDA is not available")
    if not cuda:
        return torch.device("cpu"), [torch.device("cpu")] * (args.streams or 2)
    count = torch.cuda.device_count()
    streams = min(args.streams or count, count)
    return torch.device("cuda:0"), [torch.device(f"cuda:{i}") for i in range(streams)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    first, many = _devices(args)
    if first.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the worker (select_devices)
    info = machine()
    print(json.dumps(info), flush=True)
    blocks = args.blocks or (4 if len(many) <= 2 else 2 * len(many))
    intermediate = args.intermediate or int(round(3.5 * args.hidden / 64) * 64)
    vocab = args.vocab or (32000 if args.hidden >= 4096 else 8 * args.hidden)
    out = args.out or Path(f".bench/llama-h{args.hidden}-b{blocks}")
    ckpt = write_checkpoint(out, blocks=blocks, hidden=args.hidden, intermediate=intermediate,
                            vocab=vocab, seed=args.seed, shard_mb=args.shard_mb, device=first)
    how = "reused" if ckpt["reused"] else f"written in {ckpt['write_s']} s"
    print(f"checkpoint: {out} ({ckpt['bytes'] / 2**30:.2f} GiB, {how})", flush=True)
    if first.type == "cuda":
        torch.cuda.empty_cache()
    warm_up(list(dict.fromkeys(many)))

    result: dict[str, Any] = {
        "benchmark": "bench_multi_gpu",
        "machine": info,
        "shape": {"blocks": blocks, "hidden": args.hidden, "intermediate": intermediate,
                  "vocab": vocab},
        "checkpoint": ckpt,
        "precision": args.precision,
        "speculate": args.speculate,
    }
    runs = [run_analysis(out.resolve(), [first], precision=args.precision,
                         speculate=args.speculate)]
    print(f"1 stream on {first}: analyse {runs[0]['analyse_s']} s "
          f"({runs[0]['layers_per_s']} layers/s)", flush=True)
    if len(many) > 1:
        runs.append(run_analysis(out.resolve(), many, precision=args.precision,
                                 speculate=args.speculate))
        print(f"{len(many)} streams: analyse {runs[1]['analyse_s']} s "
              f"({runs[1]['layers_per_s']} layers/s), layers per stream "
              f"{runs[1]['layers_per_stream']}", flush=True)
    diff = differences(runs[0], runs[-1])
    result["layers"] = runs[0]["layers"]
    result["identical"] = not diff
    result["differences"] = diff[:20]
    t1, tn, n = runs[0]["analyse_s"], runs[-1]["analyse_s"], len(many)
    result["scaling"] = round(t1 / (tn * n), 3) if n > 1 and tn > 0 else None
    result["scaling_target"] = TARGET_SCALING
    result["scaling_met"] = None if result["scaling"] is None else (
        result["scaling"] >= TARGET_SCALING)
    result["seconds_per_layer_one_stream"] = round(t1 / max(1, runs[0]["layers"]), 4)
    result["runs"] = [{k: v for k, v in run.items() if not k.startswith("_")} for run in runs]
    print(f"identical: {result['identical']}; scaling t1/(tN×N) = {result['scaling']} "
          f"(target ≥ {TARGET_SCALING})", flush=True)

    sizes = args.kernel_sizes
    if sizes is None:
        sizes = "8192,16384" if first.type == "cuda" else str(args.hidden)
    result["kernels_s"] = kernel_timings(first, [int(s) for s in sizes.split(",") if s], args.reps)

    peaks: list[dict[str, Any]] = []
    if first.type == "cuda" and not args.skip_peaks:
        for shape, precision in PEAK_CASES:
            try:
                peaks.append(layer_peak(first, shape, precision))
            except Exception as e:
                peaks.append({"shape": list(shape), "precision": precision,
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
            print(f"peak: {json.dumps(peaks[-1])}", flush=True)
    result["layer_peaks"] = peaks

    text = json.dumps(result, indent=2, default=_plain)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0 if result["identical"] else 1


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
