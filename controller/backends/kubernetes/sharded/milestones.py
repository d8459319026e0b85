"""The milestones of a sharded run as Events on its Indexed Jobs: what they say and when.

Owns the Normal Events of the sharded mode: ShardsCreated (a class's Job made: its shards,
models, pods at once), ClassComplete (each Job once, when the run sees it finished: shards
and their models by how they ended) and SweepFinished (on each Job still there when the run ends,
finished, stopped or --no-wait; the run's model counts when it finished). The failures'
Warnings are sent where they are found (ShardFailed: .status; GPUBroken: .devicefaults;
Unschedulable: .backend). Sending them, best effort and bounded, is common.jobevents'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from controller.backends.base import Outcome, OutcomeCallback
from controller.backends.kubernetes.common.jobevents import JobEventRecorder
from controller.backends.kubernetes.sharded.sharding import ClassShards
from controller.backends.kubernetes.sharded.status import IndexedRun

NO_WAIT = "ended without waiting for its Jobs (--no-wait): a later run re-attaches"
STOPPED = "stopped: its Jobs keep running (the next run re-attaches)"


def announce(events: JobEventRecorder | None, job: Mapping[str, Any], c: ClassShards,
             run_id: str) -> None:
    """ShardsCreated on a class's new Job."""
    if events is not None:
        events.normal(job, "ShardsCreated", (
            f"class {c.cls.name}: {c.shards} shard(s) of {c.models} model(s), "
            f"{c.parallelism} pod(s) at once (run {run_id})"))


def completed(events: JobEventRecorder | None, runs: list[IndexedRun], told: set[str]) -> None:
    """ClassComplete on each Job finished since the last look (told: the Jobs already
    counted, updated), so a class that ends early says so while the others still run; none
    on a Job deleted under the run (nothing to put it on)."""
    for r in runs:
        if r.finished and r.name not in told:
            told.add(r.name)
            if r.state != "Deleted" and events is not None:
                events.normal(r.job, "ClassComplete", class_line(r))


def ended(events: JobEventRecorder | None, run_id: str, runs: list[IndexedRun],
          how: str) -> None:
    """At the run's end, on each of its Jobs still there: SweepFinished."""
    for r in runs:
        if r.state != "Deleted" and events is not None:
            events.normal(r.job, "SweepFinished", f"run {run_id} {how}")


def class_line(r: IndexedRun) -> str:
    """A finished Job's ClassComplete message: its shards (and the models they hold) by how
    they ended (a done shard's models may hold failures of their own: the store has them)."""
    replaced = (f", {len(r.replaced)} run again by a replacement Job ({r.models_replaced} "
                "model(s))" if r.replaced else "")
    return (f"class {r.class_name}: Job {r.state or 'finished'}: {len(r.completed)} of "
            f"{r.completions} shard(s) done ({r.models_done} model(s)), "
            f"{len(r.failed) - len(r.replaced)} failed ({r.models_failed} model(s)){replaced}")


class Finished:
    """The end of a run whose Jobs all finished: a context whose value is on_outcome,
    counting the outcomes by status on the way; SweepFinished (with the counts) on each Job
    once every outcome went out (not when that raised)."""

    def __init__(self, events: JobEventRecorder | None, run_id: str, runs: list[IndexedRun],
                 on_outcome: OutcomeCallback) -> None:
        self.events, self.run_id, self.runs = events, run_id, runs
        self.on_outcome = on_outcome
        self.counts: Counter[str] = Counter()

    def __call__(self, outcome: Outcome) -> None:
        self.counts[outcome.status] += 1
        self.on_outcome(outcome)

    def __enter__(self) -> Finished:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            ended(self.events, self.run_id, self.runs, (
                f"finished: {self.counts['done']} model(s) done, "
                f"{self.counts['failed']} failed"))
