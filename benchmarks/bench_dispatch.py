"""Dispatch overhead of the local backend per model, next to the cost of starting a worker.

Runs N trivial tasks (`python -S -c pass`) three ways: directly one after another, through
LocalBackend in CPU mode (one slot), and through LocalBackend on fake GPUs (NVML faked at
the pynvml function boundary, the real tracker rule, 1 s polls, max_checks 10). The
difference per task is what the controller adds; for scale, also times one real worker
start (`python -m esd_worker.cli --help` imports nothing heavy; the analysis of a small
model costs seconds, mostly imports).

    python benchmarks/bench_dispatch.py [--tasks 50] [--gpus 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.backends.base import Task
from controller.backends.local.backend import LocalBackend, LocalSettings
from controller.gpu.gpus import GpuSettings, GpuTracker, Nvml

TRIVIAL = (sys.executable, "-S", "-c", "pass")


class IdlePynvml:
    """pynvml at its function boundary: `count` GPUs, each always using 100 MiB of 80 GiB."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int) -> None:
        self.count = count

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: Any = None) -> Any:
        class Memory:
            used = 100 * 2**20
            total = 80 * 2**30
            free = total - used

        return Memory()


def time_direct(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        subprocess.run(TRIVIAL, check=True)
    return time.perf_counter() - t


def time_backend(n: int, tracker: GpuTracker | None) -> tuple[float, float]:
    tasks = [Task(key=f"t{i}", argv=TRIVIAL, label=f"t{i}") for i in range(n)]
    backend = LocalBackend(LocalSettings(cpu_workers=1), tracker)
    t = time.perf_counter()
    outcomes = backend.run(tasks)
    wall = time.perf_counter() - t
    assert all(o.status == "done" for o in outcomes)
    first_start = min(o.wait_s for o in outcomes)
    return wall, first_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=4)
    n = parser.parse_args().tasks
    gpus = parser.parse_args().gpus
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, python {platform.python_version()}")
    direct = time_direct(n)
    cpu_wall, _ = time_backend(n, None)
    tracker = GpuTracker(Nvml(IdlePynvml(gpus)), GpuSettings(max_checks=10, poll_interval_s=1.0))
    gpu_wall, first = time_backend(n, tracker)
    per_direct = direct / n * 1000
    print(f"{n} trivial tasks")
    print(f"  direct, one after another      {per_direct:7.1f} ms/task")
    print(f"  LocalBackend, CPU, 1 slot      {cpu_wall / n * 1000:7.1f} ms/task "
          f"(overhead {(cpu_wall - direct) / n * 1000:+.1f} ms)")
    print(f"  LocalBackend, {gpus} fake GPUs     {gpu_wall / n * 1000:7.1f} ms/task wall, "
          f"first start after {first:.1f} s (max_checks 10 × 1 s polls)")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "esd_worker.cli", "--help"], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"  for scale: esd-worker --help   {(time.perf_counter() - t) * 1000:7.1f} ms; "
          "analysing a model costs seconds (imports alone 5-8 s on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
