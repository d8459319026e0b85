"""Benchmark and check: watching a sweep on a real GPU (issue 33).

Two things an operator reads while a sweep runs, measured against the GPU itself:

  - shard: one pod's `esd-worker --shards` (its supervisor and a worker child) over N links to
    one Llama-shaped bf16 checkpoint, as an Indexed Job's pod runs it. Its progress document
    (`<shard folder>/0.progress.json`, what the controller reads for per-model progress and
    the device-busy metric) is polled every 0.5 s while NVML samples the GPU's utilisation:
    reported are the document's updates (how many, how stale at most), its final counts, its
    device_busy_s / worker_s share, and NVML's mean utilisation over the same time, so the
    two "busy" figures can be compared;
  - metrics: `esd-sweep run --metrics-port` (the local backend, this machine's GPU) over the
    same links, its /metrics scraped every 0.5 s over HTTP and parsed with Prometheus' own
    parser: the last scrape's models by state, the models-done counter, failures, and the
    run's wall time.

  python benchmarks/bench_watch_gpu.py --json watch.json                       # GPU
  python benchmarks/bench_watch_gpu.py --device cpu --models 2 --blocks 2 --hidden 256 \\
      --intermediate 688 --vocab 1000 --ckpt .bench/watch-tiny                # smoke, CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_sweep_gpu import Sampler, links  # noqa: E402


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


class GpuSampler(Sampler):
    """NVML's utilisation of GPU 0 every 0.5 s (none on a machine without NVML)."""

    period_s = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[int] = []
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML: the CPU smoke run
            self._handle = None

    def sample(self) -> None:
        if self._handle is not None:
            import pynvml

            self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples) / 100, 3) if self.samples else None


def shard(listed: Path, root: Path, device: str) -> dict[str, Any]:
    """One shard pod over the list, its progress document polled as the controller would."""
    store = root / "shard-store"
    folder = store / "_shards" / "watch" / "gpu"
    subprocess.run(["rm", "-rf", str(store)], check=True)
    folder.mkdir(parents=True)
    (folder / "0.csv").write_text(listed.read_text())
    doc_path = folder / "0.progress.json"
    argv = [sys.executable, "-m", "esd_worker.cli", "--shards", str(folder), "--shard-index",
            "0", "--output", str(store), "--device", device, "--run-id", "watch"]
    updates: list[dict[str, Any]] = []
    last_text = ""
    t0 = time.perf_counter()
    log_path = root / "shard.log"
    # The log goes to a file: a pipe read only once the child exits fills up (64 KiB) and
    # blocks the child's next log line for good.
    with GpuSampler() as gpu, log_path.open("w") as log_file:
        proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=log_file, text=True)
        while proc.poll() is None:
            time.sleep(0.5)
            try:
                text = doc_path.read_text()
            except FileNotFoundError:
                continue
            if text != last_text:
                last_text = text
                doc = json.loads(text)
                updates.append({"t_s": round(time.perf_counter() - t0, 2),
                                "done": doc["done"], "in_progress": doc["in_progress"],
                                "device_busy_s": doc["device_busy_s"],
                                "worker_s": doc["worker_s"]})
                print(f"shard: {updates[-1]}", flush=True)
    stderr = log_path.read_text()
    wall = time.perf_counter() - t0
    final = json.loads(doc_path.read_text()) if doc_path.exists() else {}
    gaps = [b["t_s"] - a["t_s"] for a, b in itertools.pairwise(updates)]
    share = (round(final["device_busy_s"] / final["worker_s"], 3)
             if final.get("worker_s") else None)
    return {
        "exit_code": proc.returncode, "wall_s": round(wall, 2),
        "stderr_tail": stderr.strip().splitlines()[-3:] if proc.returncode else [],
        "final_document": final, "updates_seen": len(updates),
        "largest_gap_between_updates_s": round(max(gaps), 2) if gaps else None,
        "updates": updates, "device_busy_share_from_document": share,
        "nvml_mean_utilisation": gpu.mean(), "nvml_samples": len(gpu.samples),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_until_exit(proc: subprocess.Popen[str], port: int, scraped: list[str]) -> None:
    """/metrics every 0.5 s while `proc` runs (the texts that answered, in order)."""
    while proc.poll() is None:
        time.sleep(0.5)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                scraped.append(r.read().decode())
        except OSError:
            continue
        if len(scraped) % 20 == 1:
            print(f"metrics: scrape {len(scraped)} answered", flush=True)


def metrics(listed: Path, root: Path, device: str) -> dict[str, Any]:
    """A local `esd-sweep run --metrics-port` over the list, scraped while it runs."""
    from prometheus_client.parser import text_string_to_metric_families

    out = root / "metrics-store"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    port = _free_port()
    argv = [sys.executable, "-m", "controller.cli", "run", "--model-list", str(listed),
            "--output-dir", str(out), "--device", device, "--metrics-port", str(port)]
    t0 = time.perf_counter()
    log_path = root / "metrics-run.log"
    scraped: list[str] = []
    with log_path.open("w") as log_file:  # a file, not a pipe: see shard()
        proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=log_file, text=True)
        _scrape_until_exit(proc, port, scraped)
    scrapes, last = len(scraped), (scraped[-1] if scraped else "")
    stderr = log_path.read_text()
    wall = time.perf_counter() - t0
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(last):
        for sample in family.samples:
            if sample.name in ("esd_sweep_models", "esd_sweep_models_done_total",
                               "esd_sweep_failures_total", "esd_sweep_run_models"):
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                seen[f"{sample.name}{{{label}}}"] = sample.value
    return {"exit_code": proc.returncode, "wall_s": round(wall, 2), "scrapes": scrapes,
            "last_scrape": seen,
            "stderr_tail": stderr.strip().splitlines()[-3:] if proc.returncode else []}


def _gpu_name() -> str | None:
    """GPU 0's name from NVML (not torch: no CUDA context in this process, see main)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/esd-bench/watch"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import torch
    from checkpoint_7b import write_checkpoint

    # Written on the CPU: a CUDA context in this process would hold ~500 MiB of the GPU for
    # good, and `esd-sweep run` (the gputracker rule: a GPU is free under 500 MiB) would
    # then wait for it forever (seen on the H100: the metrics run never started a model).
    facts = write_checkpoint(args.ckpt, blocks=args.blocks, hidden=args.hidden,
                             intermediate=args.intermediate, vocab=args.vocab, seed=0,
                             shard_mb=1024, device=torch.device("cpu"))
    root = args.ckpt.parent / (args.ckpt.name + "-watch")
    listed = links(args.ckpt, root, args.models)
    print(f"checkpoint {facts}; {args.models} links in {root}", flush=True)
    report = {
        "machine": {"gpu": _gpu_name(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "checkpoint": facts, "models": args.models, "device": args.device,
        "shard": shard(listed, root, args.device),
        "metrics": metrics(listed, root, args.device),
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    ok = report["shard"]["exit_code"] == 0 and report["metrics"]["exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
