"""Benchmark: plan a 10,000-row model list against a LocalStore holding 5,000 done models.

Target (issue 3): read_model_list + plan_run in <= 3 s on the 2-core development machine.
The store is built with the store API: for each done model a layers.csv and a result.json
marker shaped like the worker's, with AnalysisSettings().as_dict() as its parameters.
Building it is not timed. Run: `.venv/bin/python benchmarks/bench_plan.py [--dir DIR]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from controller.run.plan import plan_run
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.stores import LocalStore

RELATIONS = ("", "base", "finetune", "adapter", "lora", "quantized", "merge")


def model_ref(i: int) -> tuple[str, str, str]:
    """(ref, relation, source_model) of the i-th model: a mix of ids, revisions and adapters."""
    ref = f"org{i % 97}/model-{i:05d}"
    if i % 5 == 0:
        ref += "@main" if i % 10 else f"@{i:040x}"[-41:]
    relation = RELATIONS[i % len(RELATIONS)]
    source = f"org{i % 13}/base-{i % 50}" if relation in ("adapter", "lora") else ""
    return ref, relation, source


def write_list(path: Path, n: int) -> None:
    lines = ["full_name,source_model,base_model_relation,downloads,pipeline_tag"]
    for i in range(n):
        ref, relation, source = model_ref(i)
        lines.append(f"{ref},{source},{relation},{i * 7},text-generation")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def fake_marker(ref: str, key: str, relation: str, parameters: dict[str, Any]) -> dict[str, Any]:
    model_id, _, revision = ref.partition("@")
    return {
        "schema": 1, "model": ref, "model_id": model_id, "revision": revision or None,
        "resolved_revision": "0" * 40, "source": "hub", "model_key": key, "relation": relation,
        "base_model": None, "adapter": None, "parameters": parameters,
        "layer_discovery": "config", "architecture": "LlamaForCausalLM", "discovery_note": "",
        "layer_count": 225, "status_counts": {"ok": 224, "fit_failed": 1},
        "outputs": {"layers": "layers.csv", "eigs": "eigs.npz"},
        "timings": {"resolve_s": 1.2, "discover_s": 0.3, "analyse_s": 41.0, "read_wait_s": 2.0,
                    "write_s": 0.4, "total_s": 43.1},
        "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "host": "node-1",
                   "cuda_visible_devices": "3", "peak_memory_mib": 1234.5},
        "versions": {"esd_worker": "0.1.0", "torch": "2.13.0", "transformers": "5.23.0"},
        "summary": {"layers": 225, "layers_ok": 224, "alpha_mean": 3.9, "alpha_median": 3.7,
                    "alpha_std": 1.1, "alpha_in_2_6_share": 0.86, "stable_rank_mean": 20.0,
                    "log_spectral_norm_mean": 1.3, "log_norm_mean": 2.4, "entropy_mean": 0.9,
                    "alpha_weighted_mean": 5.0, "log_alpha_norm_mean": 6.0},
        "started_at": "2026-11-23T07:00:00+00:00", "finished_at": "2026-11-23T07:00:43+00:00",
    }


def build(root: Path, n_rows: int, n_done: int) -> tuple[Path, float]:
    """The list and the store under root (reused when already there); seconds spent."""
    t0 = time.perf_counter()
    csv_path = root / "models.csv"
    store_root = root / "store"
    stamp = root / f"built-{n_rows}-{n_done}"
    if stamp.exists():
        return csv_path, 0.0
    write_list(csv_path, n_rows)
    models = read_model_list(csv_path).rows
    store = LocalStore(store_root)
    params = AnalysisSettings().as_dict()
    layers = b"model_id,revision,layer,alpha\n" + b"m,,layer,3.5\n" * 20
    # Every second listed model is done, so done and todo interleave as in a resumed sweep.
    for row in models[::2][:n_done]:
        store.put_bytes(f"{row.key}/layers.csv", layers)
        store.put_bytes(
            f"{row.key}/result.json", Marker.from_dict(
                fake_marker(row.ref, row.key, row.relation, params)).to_json()
        )
    stamp.write_text("ok\n")
    return csv_path, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, help="keep the generated list and store here")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--done", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--target-s", type=float, default=3.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        csv_path, build_s = build(root, args.rows, args.done)
        store = LocalStore(root / "store")
        params = AnalysisSettings().as_dict()
        timings: list[tuple[float, float]] = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            models = read_model_list(csv_path)
            t1 = time.perf_counter()
            plan = plan_run(models.rows, store, params, threads=args.threads)
            t2 = time.perf_counter()
            timings.append((t1 - t0, t2 - t1))
        assert len(models.rows) == args.rows and not models.problems, models.problems[:3]
        assert len(plan.done) == args.done and len(plan.todo) == args.rows - args.done
        totals = [a + b for a, b in timings]

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"list: {args.rows} rows; store: {args.done} done models "
          f"(result.json + layers.csv each); built in {build_s:.1f} s (not timed)")
    print(f"runs: {args.repeat}, threads={args.threads}")
    print(f"  read_model_list  first {timings[0][0]:.3f} s  median "
          f"{statistics.median(a for a, _ in timings):.3f} s")
    print(f"  plan_run         first {timings[0][1]:.3f} s  median "
          f"{statistics.median(b for _, b in timings):.3f} s")
    print(f"  total            first {totals[0]:.3f} s  median {statistics.median(totals):.3f} s"
          f"  max {max(totals):.3f} s  (target <= {args.target_s:.1f} s)")
    ok = max(totals) <= args.target_s
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
