"""Write a synthetic results store at atlas scale (no analysis): the per-model files a worker
writes, `_tables/` parts whose rows vouch for them, and failure records; the generator is
tests/support/synthstore.py (shared with the tests). Owns only the command line.

Run: `.venv/bin/python benchmarks/synth_store.py OUT --models 100000 --layers 100`
(OUT a folder or an s3:// URL with AWS_* set, e.g. from `python -m tests.support.s3server`);
`--untabled-every N` leaves every N-th model out of the parts (read by the fallback).
`--models-csv PATH` writes the model list of the store's models.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from esd_worker.core.store.opener import open_store  # noqa: E402
from tests.support.synthstore import SynthSpec, models_csv, write_synth_store  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="store: a folder or an s3:// URL")
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untabled-every", type=int, default=0,
                        help="every N-th model in no part, only as its own files (0: none)")
    parser.add_argument("--failures", type=int, default=100)
    parser.add_argument("--no-tables", action="store_true",
                        help="per-model files only (a store for compact to build)")
    parser.add_argument("--models-csv", type=Path, help="write the model list here")
    args = parser.parse_args(argv)
    spec = SynthSpec(models=args.models, layers=args.layers, seed=args.seed,
                     untabled_every=args.untabled_every,
                     failures=args.failures, tables=not args.no_tables)
    start = time.monotonic()
    counts = write_synth_store(open_store(args.out), spec)
    if args.models_csv:
        args.models_csv.write_bytes(models_csv(spec))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{counts} in {time.monotonic() - start:.1f} s, peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
