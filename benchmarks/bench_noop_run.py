"""Benchmark: `esd-sweep run` with nothing to do on an output of 100,000 done models.

Issue 15: such a run re-read every result.json to rebuild summary.csv (41 s warm on the 2-core
development machine); it now rebuilds the summary from the markers its plan already read.
The store is a LocalStore of N models, each a layers.csv and a result.json marker shaped like
the worker's (benchmarks/bench_plan.py's fake_marker) that seals the table, written with
plain file writes (no fsync: building is not timed). The run is the real CLI, in process,
`--device cpu`; the phases come from its log lines' timestamps.
Run: `.venv/bin/python benchmarks/bench_noop_run.py [--models 100000] [--dir DIR]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan import fake_marker

from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.store.marker import FileSeal, Marker

LAYERS = b"model_id,revision,layer,alpha\n" + b"m,,layer,3.5\n" * 225


def build(root: Path, n: int) -> float:
    """The list and the store under root (reused when already built); seconds spent."""
    stamp = root / f"built-{n}"
    if stamp.exists():
        return 0.0
    t0 = time.perf_counter()
    ids = [f"org{i % 97}/model-{i:07d}" for i in range(n)]
    (root / "models.csv").write_text("model_id\n" + "\n".join(ids) + "\n", encoding="utf-8")
    params = AnalysisSettings().as_dict()
    seal = FileSeal.of(LAYERS)
    for row in read_model_list(root / "models.csv").rows:
        folder = root / "out" / row.key
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "layers.csv").write_bytes(LAYERS)
        doc = fake_marker(row.ref, row.key, "", params)
        doc["outputs"] = {"layers": "layers.csv", "eigs": None}
        marker = Marker.from_dict(doc)
        marker = dataclasses.replace(marker, files={"layers.csv": seal})
        (folder / "result.json").write_bytes(marker.to_json())
    stamp.write_text("ok\n")
    return time.perf_counter() - t0


class Stamps(logging.Handler):
    """When the sweep logged its plan and its end (the summary is written between)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.at: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.name == "controller.run.sweep" and "done already" in text:
            self.at["planned"] = time.perf_counter()
        elif record.name == "controller.run.sweep" and text.startswith("run "):
            self.at["finished"] = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, help="keep the generated list and store here")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    from controller.cli import main as esd_sweep

    with tempfile.TemporaryDirectory(prefix="bench-noop-") as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        build_s = build(root, args.models)
        runs = []
        for _ in range(args.repeat):
            stamps = Stamps()
            t0 = time.perf_counter()
            # On the sweep's own logger: the CLI's log setup replaces the root's handlers.
            logging.getLogger("controller.run.sweep").addHandler(stamps)
            code = esd_sweep(["run", "--model-list", str(root / "models.csv"), "--output-dir",
                              str(root / "out"), "--device", "cpu"])
            total = time.perf_counter() - t0
            logging.getLogger("controller.run.sweep").removeHandler(stamps)
            assert code == 0, code
            runs.append((stamps.at.get("planned", t0) - t0,
                         stamps.at.get("finished", t0) - stamps.at.get("planned", t0), total))

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
          file=sys.stderr)
    print(f"store: {args.models} done models (layers.csv + sealed result.json); built in "
          f"{build_s:.1f} s (not timed)", file=sys.stderr)
    for i, (plan_s, rest_s, total_s) in enumerate(runs, 1):
        print(f"  run {i}: plan {plan_s:.1f} s, summary and report {rest_s:.1f} s, "
              f"total {total_s:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
