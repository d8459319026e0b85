"""Benchmark: plan the shards of a 2,000,000-model list in one streaming pass
(controller.backends.kubernetes.sharded.plan).

Rows are made one at a time (ModelRow -> Item.of with a size from the column, as the sizer
answers it), grouped into units, packed, and each closed shard encoded with shard_csv and
dropped, as a controller that writes shards to the store as they close would. Reported: wall
time and rows per second, then (a second pass under tracemalloc, which slows it) the peak of
Python memory: it must stay flat as the list grows, since only one unit and one shard are kept.
Run: `.venv/bin/python benchmarks/bench_shards.py [--rows N] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controller.backends.kubernetes.sharded.plan import (
    Item,
    Packer,
    shard_count,
    shard_csv,
    target_bytes,
    units,
)
from esd_worker.core.models.modellist import ModelRow

MB, GB = 10**6, 10**9


def items(n: int, seed: int) -> Iterator[Item]:
    """n models: lognormal bases from 10 MB to 140 GB, about 20% adapters after their base."""
    rng = random.Random(seed)
    made = base = 0
    while made < n:
        base += 1
        size = int(min(max(rng.lognormvariate(math.log(1.5 * GB), 1.6), 10 * MB), 140 * GB))
        ref = f"org{base % 997}/base-{base}"
        yield Item.of(ModelRow(ref, None, "", None), size)
        made += 1
        while made < n and rng.random() < 0.2:
            adapter = ModelRow(f"org{base % 997}/adapter-{made}", None, "lora", ref)
            yield Item.of(adapter, rng.randint(10 * MB, 200 * MB))
            made += 1


def plan(n: int, seed: int, parallelism: int, max_models: int,
         total: int) -> tuple[int, int, int]:
    """(shards, CSV bytes written, largest shard bytes) of one pass over n models."""
    count = shard_count(total_bytes=total, total_models=n, parallelism=parallelism,
                        max_models=max_models)
    packer = Packer(target_bytes=target_bytes(total, count), max_models=max_models)
    written = largest = 0
    for unit in units(items(n, seed)):
        shard = packer.add(unit)
        if shard is not None:
            written += len(shard_csv(shard.items))
            largest = max(largest, shard.size)
    last = packer.finish()
    if last is not None:
        written += len(shard_csv(last.items))
        largest = max(largest, last.size)
    return packer.shards, written, largest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--parallelism", type=int, default=64)
    parser.add_argument("--max-models", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    # The totals a controller knows from its first pass (sizing); not timed.
    total = sum(i.size for i in items(args.rows, args.seed))
    t0 = time.perf_counter()
    shards, written, largest = plan(args.rows, args.seed, args.parallelism, args.max_models,
                                    total)
    wall = time.perf_counter() - t0
    small = max(1, args.rows // 10)
    peaks: dict[int, float] = {}
    for n in (small, args.rows):
        tracemalloc.start()
        plan(n, args.seed, args.parallelism, args.max_models,
             sum(i.size for i in items(n, args.seed)))
        peaks[n] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    result: dict[str, Any] = {
        "rows": args.rows, "shards": shards, "csv_mib": written / 2**20,
        "largest_shard_gb": largest / GB, "wall_s": wall, "rows_per_s": args.rows / wall,
        "peak_mib": {str(n): round(p, 2) for n, p in peaks.items()},
    }
    print(f"{args.rows:,} rows -> {shards:,} shards ({written / 2**20:.0f} MiB of CSV) in "
          f"{wall:.1f} s ({args.rows / wall:,.0f} rows/s)")
    for n, peak in peaks.items():
        print(f"peak Python memory, {n:>10,} rows: {peak:8.2f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
