"""Benchmark: feeding the GPU (issue 31). A long-lived worker over N links to one 7B-shaped
checkpoint with host eigensolvers on and off, a cold `esd-worker --model`, and the accuracy of
the worker's path against float64 on every layer.

Reported, with the machine (GPU, CPUs the worker may use, torch):
  - batch: `esd-worker --models` over N links to --ckpt (page cache warm after the first),
    once per --host-eigensolvers value (default: auto and 0): each model's total_s and
    analyse_s from its result.json, the steady state (models 2..N: imports and the meta
    model are paid once), models/hour from it, the layers the host solved, peak GPU memory
    (result.json) and the worker's peak resident memory (VmHWM from /proc);
  - cold: one `esd-worker --model` process, wall time as a user sees it;
  - accuracy: for each 2-D layer of the checkpoint (--accuracy-layers: the first K, 0 all),
    α (xmin_mid and DKS) of (a) the float32 Gram with a float32 eigensolver (the path before
    issue 31), (b) the worker's path: float32 Gram, float64 eigensolver, on the device and on
    the host, against (c) float64 Gram + float64 eigvalsh (within ~1e-12 of float64 SVD,
    docs/metrics.md): the largest |Δα|/α of (a) and (b), and of (b) device against (b) host.
Targets (one H100, 16 cores): ≤ 14 s a model with host eigensolvers (≥ 250 models/hour),
≤ 21 s without; cold --model ≤ 28 s; peak host memory ≤ 4 GiB, GPU ≤ 2 GiB; |Δα|/α ≤ 1e-6
on every layer and host vs device ≤ 1e-9.

  python benchmarks/bench_feed.py --ckpt /tmp/esd-bench/llama7b --json feed.json        # GPU
  python benchmarks/bench_feed.py --ckpt .bench/tiny --device cpu --models 2 \\
      --host-eigensolvers 1,0 --blocks 2 --hidden 256 --intermediate 688 --vocab 1000    # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_sweep_gpu import RssProbe, links, one  # noqa: E402


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


def batch(listed: Path, out: Path, device: str, host: str) -> dict[str, Any]:
    """One long-lived worker over the list; per-model figures from the markers."""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    argv = [sys.executable, "-m", "esd_worker.cli", "--models", str(listed), "--output",
            str(out), "--device", device]
    argv += [] if host == "auto" else ["--host-eigensolvers", host]
    with RssProbe() as probe:
        t = time.perf_counter()
        run = subprocess.run(argv, env=_env(), capture_output=True, text=True)
        wall = time.perf_counter() - t
    if run.returncode != 0:
        raise SystemExit(f"worker failed ({run.returncode}):\n{run.stderr[-3000:]}")
    markers = sorted((json.loads(p.read_text()) for p in out.glob("*/result.json")),
                     key=lambda m: int(m["model"].rsplit("-", 1)[-1]))  # list order
    steady = [m["timings"]["total_s"] for m in markers[1:]] or [markers[0]["timings"]["total_s"]]
    mean = sum(steady) / len(steady)
    return {
        "host_eigensolvers": host, "models": len(markers), "wall_s": round(wall, 1),
        "total_s": [m["timings"]["total_s"] for m in markers],
        "analyse_s": [m["timings"]["analyse_s"] for m in markers],
        "steady_s_per_model": round(mean, 2), "models_per_hour": round(3600 / mean, 1),
        "host_eigensolvers_used": markers[0]["device"].get("host_eigensolvers"),
        "host_solved_layers": [m["device"].get("host_solved_layers") for m in markers],
        "peak_gpu_mib": max(m["device"].get("peak_memory_mib", 0) for m in markers),
        "worker_peak_hwm_gib": round(probe.hwm_kib / 2**20, 2),
    }


def accuracy(ckpt: Path, device: str, layers: int, host_layers: int) -> dict[str, Any]:
    """|Δα|/α of the old and the new float32 path against float64, layer by layer; the host's
    solve (LAPACK, minutes for all of a 7B model) on the first `host_layers` only."""
    import numpy as np
    import torch

    from esd_worker.analysis.layers import LINEAR
    from esd_worker.analysis.spectra import gram_matrices, solve_gram, sorted_evals
    from esd_worker.analysis.weights import Checkpoint
    from esd_worker.core.powerlaw import layer_metrics

    dev = torch.device(device)
    worst: dict[str, float] = {}
    rows = []
    with Checkpoint(ckpt) as c:
        keys = [k for k in c.keys() if len(c.shape(k)) == 2]  # noqa: SIM118 - not a Mapping
        for i, key in enumerate(keys[:layers] if layers else keys):
            w = c.read(key).to(dev)
            g32 = gram_matrices(w, LINEAR)
            spectra = {
                "f32eig": np.sort(torch.linalg.eigvalsh(g32.gram).clamp_min(0)
                                  .reshape(-1).double().cpu().numpy()),
                "device": sorted_evals(solve_gram(g32.gram)),
            }
            if i < host_layers:
                spectra["host"] = sorted_evals(solve_gram(g32.gram.cpu()))
            g64 = gram_matrices(w, LINEAR, precision="float64")
            ref = sorted_evals(solve_gram(g64.gram))
            row: dict[str, Any] = {"key": key, "shape": list(c.shape(key))}
            for ff in ("xmin_mid", "DKS"):
                a64 = float(layer_metrics(ref, max_dim=g32.max_dim, fix_fingers=ff)["alpha"])
                got = {name: float(layer_metrics(lam, max_dim=g32.max_dim,
                                                 fix_fingers=ff)["alpha"])
                       for name, lam in spectra.items()}
                diffs = {f"{ff}_{name}_rel": abs(a - a64) / abs(a64) for name, a in got.items()}
                if "host" in got:
                    diffs[f"{ff}_host_vs_device"] = abs(got["host"] - got["device"])
                row |= {f"{ff}_alpha_float64": a64, **diffs}
                for name, value in diffs.items():
                    worst[name] = max(worst.get(name, 0.0), float(value))
            rows.append(row)
    return {"layers": len(rows), "worst": worst, "rows": rows,
            "target_rel": 1e-6, "target_host_vs_device": 1e-9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ckpt", type=Path, required=True, help="written here when missing")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--host-eigensolvers", default="auto,0",
                   help="comma-separated values to run the batch with (auto: the default)")
    p.add_argument("--accuracy-layers", type=int, default=0, help="first K 2-D layers (0: all)")
    p.add_argument("--host-check-layers", type=int, default=16,
                   help="layers whose host solve is compared with the device's")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: batch,cold,accuracy")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "esd-bench-feed")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from esd_worker.core.cpus import usable_cpus

    skip = set(filter(None, args.skip.split(",")))
    if not (args.ckpt / "config.json").exists():
        from checkpoint_7b import write_checkpoint

        write_checkpoint(args.ckpt, blocks=args.blocks, hidden=args.hidden,
                         intermediate=args.intermediate, vocab=args.vocab, seed=0,
                         shard_mb=2000, device=torch.device(args.device))
    report: dict[str, Any] = {"machine": {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(), "usable_cpus": usable_cpus(), "platform": platform.platform(),
        "torch": torch.__version__}}
    if "batch" not in skip:
        work = args.work / args.ckpt.resolve().name  # links to this checkpoint only
        subprocess.run(["rm", "-rf", str(work)], check=True)
        listed = links(args.ckpt, work, args.models)
        report["batch"] = []
        for host in args.host_eigensolvers.split(","):
            report["batch"].append(batch(listed, work / f"out-{host}", args.device, host))
            print(json.dumps(report["batch"][-1]), flush=True)
    if "cold" not in skip:
        report["cold"] = one(args.ckpt, args.device, "float32")  # a cold --model process
        print(json.dumps({"cold": report["cold"]}), flush=True)
    if "accuracy" not in skip:
        report["accuracy"] = accuracy(args.ckpt, args.device, args.accuracy_layers,
                                      args.host_check_layers)
        print(json.dumps({"accuracy_worst": report["accuracy"]["worst"],
                          "layers": report["accuracy"]["layers"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
