"""The whole zoo through one worker: build it, list it, run one `esd-worker --models` over it
(CPU, offline), read each entry's library while the worker runs, and judge every entry
(tests.zoo.checker); `markdown_table` prints the acceptance table."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.zoo.catalog import Entry, build_zoo, write_model_list
from tests.zoo.checker import (
    CORRECT,
    CRASHED,
    NOT_BUILT,
    NOTED,
    REFUSED,
    SILENT,
    UNKNOWN,
    WRONG,
    Outcome,
    check_entry,
)
from tests.zoo.library import Unit

CONV_NORM = 0.5  # the worker's default --conv-norm (the run uses the defaults)


@dataclass
class ZooRun:
    outcomes: list[Outcome]
    build_s: float
    worker_s: float
    total_s: float
    worker_code: int
    worker_tail: str

    @property
    def built(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.outcome != NOT_BUILT]

    @property
    def share(self) -> float:
        """Share of built entries handled as expected (analysed correctly, or refused where
        the zoo expects a refusal)."""
        built = self.built
        return sum(o.as_expected for o in built) / len(built) if built else 0.0


def worker_env(home: Path) -> dict[str, str]:
    """The worker offline, with its own HF home (no cache or token of the machine's)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_zoo(root: Path, *, entries: Sequence[Entry] | None = None) -> ZooRun:
    """Build the zoo under root/models (unless `entries` are given, built), analyse it into
    root/out with one worker, judge every entry."""
    from tests.support.builders import worker_command
    from tests.zoo.references import library_units

    start = time.monotonic()
    built = list(entries) if entries is not None else build_zoo(root / "models")
    build_s = time.monotonic() - start
    listed = write_model_list(built, root / "zoo.csv")
    output = root / "out"
    log = (root / "worker.log").open("w")
    worker_start = time.monotonic()
    proc = subprocess.Popen(
        [*worker_command(), "--models", str(listed), "--output", str(output), "--device", "cpu",
         "--no-eigs", "--run-id", "zoo", "--max-retries", "0"],
        stdout=subprocess.DEVNULL, stderr=log, env=worker_env(root / "hf-home"))
    units: dict[str, list[Unit] | None] = {}
    for entry in built:  # the libraries read while the worker runs (the second core)
        if entry.not_built is None and entry.refusal is None:
            try:
                units[entry.name] = library_units(entry, conv_norm=CONV_NORM)
            except Exception:
                units[entry.name] = None
    try:
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    worker_s = time.monotonic() - worker_start
    outcomes = [check_entry(e, output, units.get(e.name)) for e in built]
    tail = "\n".join((root / "worker.log").read_text(errors="replace").splitlines()[-20:])
    return ZooRun(outcomes, build_s, worker_s, time.monotonic() - start, code, tail)


_COLUMNS = (CORRECT, REFUSED, WRONG, SILENT, NOTED, CRASHED, UNKNOWN)


def markdown_table(run: ZooRun) -> str:
    """Per family: built, and how many of each outcome; then every entry not correct, with
    its one-line cause; then the share and the times."""
    families: dict[str, list[Outcome]] = {}
    for o in run.outcomes:
        families.setdefault(o.entry.family, []).append(o)
    head = ["family", "entries", "built", *[c.replace("partial-with-warning", "partial noted")
                                            for c in _COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    totals = [0] * (len(head) - 1)
    for family, outcomes in families.items():
        counts = [len(outcomes), sum(o.outcome != NOT_BUILT for o in outcomes),
                  *[sum(o.outcome == c for o in outcomes) for c in _COLUMNS]]
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        lines.append("| " + " | ".join([family, *map(str, counts)]) + " |")
    lines.append("| " + " | ".join(["**all**", *[f"**{t}**" for t in totals]]) + " |")
    lines.append("")
    lines.append("| entry | outcome | cause |")
    lines.append("| --- | --- | --- |")
    for o in run.outcomes:
        if o.outcome == CORRECT:
            continue
        expected = " (expected)" if o.as_expected else ""
        cause = "; ".join(o.details[:2]).replace("|", "\\|")
        lines.append(f"| {o.entry.name} | {o.outcome}{expected} | {cause} |")
    lines.append("")
    lines.append(f"as expected (correct, or refused where expected): {run.share:.1%} of "
                 f"{len(run.built)} built; build {run.build_s:.0f} s, worker {run.worker_s:.0f} s "
                 f"(exit {run.worker_code}), total {run.total_s:.0f} s")
    return "\n".join(lines)
