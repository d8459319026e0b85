"""Benchmark: many 7B-shaped models through `esd-sweep run` with long-lived workers, the worker's
peak host memory, and `--precision float64` against float32 on the same checkpoint.

The checkpoint is bench_worker.py's (written once to --ckpt); the models are N directories
whose files are symlinks to it (the sweep sees N models; the page cache holds one copy, as a
node's local cache would). Reported, with the machine:
  - sweep: wall time for N models on this machine's GPUs (one long-lived worker per GPU),
    models/hour, per-model seconds from the markers, the first model's import overhead;
  - memory: the largest VmHWM (peak resident set) and VmRSS seen of any worker process,
    sampled every 0.2 s from /proc (mapped checkpoint pages count while resident);
  - precision: one worker run per precision on the checkpoint (`analyse_s` from result.json).
Targets (issue 12, one H100): >= 150 models/hour for ten 7B-shaped models; float64 <= 1.4x
the float32 time.

  python benchmarks/bench_sweep_gpu.py --ckpt /tmp/esd-bench/llama7b [--models 10] [--json P]
  python benchmarks/bench_sweep_gpu.py --ckpt .bench/tiny --device cpu --models 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parent.parent


def links(ckpt: Path, root: Path, n: int) -> Path:
    rows = []
    for i in range(n):
        d = root / f"model-{i}"
        d.mkdir(parents=True, exist_ok=True)
        for f in ckpt.iterdir():
            if f.is_file() and not (d / f.name).exists():
                (d / f.name).symlink_to(f.resolve())
        rows.append(str(d))
    listed = root / "models.csv"
    listed.write_text("model_id\n" + "\n".join(rows) + "\n")
    return listed


class Sampler:
    """A background thread that calls `sample()` every `period_s` between enter and exit."""

    period_s = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class RssProbe(Sampler):
    """Peak VmHWM / VmRSS (KiB) over the esd-worker processes, sampled from /proc."""

    def __init__(self) -> None:
        super().__init__()
        self.hwm_kib = 0
        self.rss_kib = 0

    def sample(self) -> None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"esd_worker.cli" not in cmd and b"esd-worker" not in cmd:
                    continue
                status = (proc / "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    kib = int(value.split()[0])
                    if key == "VmHWM":
                        self.hwm_kib = max(self.hwm_kib, kib)
                    else:
                        self.rss_kib = max(self.rss_kib, kib)


def sweep(listed: Path, out: Path, device: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", "controller.cli", "run", "--model-list", str(listed),
            "--output-dir", str(out), "--device", device, "--max-checks", "1",
            "--gpu-poll-interval", "0.2"]
    with RssProbe() as probe:
        t = time.perf_counter()
        run = subprocess.run(argv, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
    if run.returncode != 0:
        raise SystemExit(f"sweep failed ({run.returncode}):\n{run.stderr[-3000:]}")
    markers = [json.loads(p.read_text()) for p in out.glob("*/result.json")]
    per_model = sorted(m["timings"]["total_s"] for m in markers)
    return {"models": len(markers), "wall_s": round(wall, 1),
            "models_per_hour": round(len(markers) / wall * 3600, 1),
            "per_model_total_s": per_model, "worker_peak_hwm_gib": round(probe.hwm_kib / 2**20, 2),
            "worker_peak_rss_gib": round(probe.rss_kib / 2**20, 2)}


def one(ckpt: Path, device: str, precision: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "esd_worker.cli", "--model", str(ckpt),
                              "--output", out, "--device", device, "--precision", precision],
                             env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"),
                             capture_output=True, text=True)
        wall = time.perf_counter() - t
        if run.returncode != 0:
            raise SystemExit(f"worker failed:\n{run.stderr[-3000:]}")
        [marker] = [json.loads(p.read_text()) for p in Path(out).glob("*/result.json")]
    return {"wall_s": round(wall, 2), **marker["timings"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ckpt", type=Path, required=True, help="bench_worker.py's checkpoint")
    p.add_argument("--models", type=int, default=10)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "esd-bench-sweep")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    report: dict[str, Any] = {"machine": {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}}
    listed = links(args.ckpt, args.work, args.models)
    out = args.work / "out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    report["sweep"] = sweep(listed, out, args.device)
    print(json.dumps(report["sweep"]), flush=True)
    f32, f64 = one(args.ckpt, args.device, "float32"), one(args.ckpt, args.device, "float64")
    report["precision"] = {"float32": f32, "float64": f64,
                           "analyse_ratio": round(f64["analyse_s"] / f32["analyse_s"], 3)}
    print(json.dumps(report["precision"]), flush=True)
    report["targets_met"] = {"models_per_hour_ge_150": report["sweep"]["models_per_hour"] >= 150,
                             "float64_le_1.4x": report["precision"]["analyse_ratio"] <= 1.4}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["targets_met"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
