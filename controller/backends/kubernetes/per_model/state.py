"""Where each model of a run stands on the cluster: a table the backend's parts share.

Owns the per-model state (its Job in flight, attempts taken, times waited and run), the
queue of models to submit, which are in flight or still waiting for a pod, and turning a
model's end into its one Outcome. Does not talk to the API (controller.backends.kubernetes
.submit and .events do, and update this table).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.backends.base import Outcome, OutcomeCallback, Task
from controller.backends.kubernetes.common.diagnosis import Diagnosis
from controller.progress import Progress
from esd_worker.core.models.modellist import ModelRow


@dataclass
class ModelState:
    """One model of the run, as the controller last saw it."""

    task: Task
    row: ModelRow
    args: tuple[str, ...] = ()  # the worker args, built only to compare with a found Job
    attempt: int = -1  # the highest attempt number taken (any sweep), -1: none
    tries: int = 0  # Jobs of this run's count (submitted or adopted active)
    name: str | None = None  # the Job in flight
    submitted_at: float = 0.0
    running: bool = False
    running_at: float | None = None
    node: str | None = None  # the node it prefers (reservation held until it runs)
    gpus: int | None = None  # the GPUs its Job asks for (the GPU rule's; None: not decided)
    pending_checked_at: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    in_flight: bool = False
    finished: bool = False
    last: Diagnosis | None = None  # the last failed attempt, while its retry waits

    @property
    def key(self) -> str:
        return self.row.key


class ModelTable:
    """Every model of the run by key, the submission queue, and the Outcomes so far.

    `flight`: keys with a Job in flight; `waiting`: of those, the ones whose pod does not
    run yet. `finish` makes a model's one Outcome and hands it to on_outcome (in the
    thread that calls it: the backend's run loop). namespace: for Outcome.where.
    """

    def __init__(self, namespace: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.namespace = namespace
        self.clock = clock
        self.models: dict[str, ModelState] = {}
        self.queue: deque[str] = deque()
        self.flight: set[str] = set()
        self.waiting: set[str] = set()
        self.outcomes: list[Outcome] = []
        self.counts = {"done": 0, "failed": 0}
        self.on_outcome: OutcomeCallback | None = None
        self.progress: Progress | None = None
        self._by_name: dict[str, str] = {}

    def add(self, task: Task, row: ModelRow) -> None:
        """Queue a model once (a key seen before is not queued again)."""
        if row.key not in self.models:
            self.models[row.key] = ModelState(task, row)
            self.queue.append(row.key)

    def set_flight(self, model: ModelState, in_flight: bool, *, running: bool = False) -> None:
        key = model.key
        model.in_flight = in_flight
        model.running = running
        if in_flight:
            self.flight.add(key)
        else:
            self.flight.discard(key)
        if in_flight and not running:
            self.waiting.add(key)
        else:
            self.waiting.discard(key)

    def track(self, model: ModelState, name: str) -> None:
        """The model's Job in flight is now `name` (created or adopted)."""
        model.name = name
        self.set_flight(model, True)
        model.submitted_at = self.clock()
        model.tries += 1
        self._by_name[name] = model.key

    def model_for(self, job: Mapping[str, Any]) -> ModelState | None:
        """The model whose Job in flight this is; None for any other Job (an older attempt,
        another sweep's, one that ended)."""
        name = str((job.get("metadata") or {}).get("name"))
        key = self._by_name.get(name)
        model = self.models.get(key) if key is not None else None
        if model is None or not model.in_flight or model.name != name:
            return None
        return model

    def in_flight_names(self) -> list[str]:
        return sorted(m.name for m in self.models.values() if m.in_flight and m.name)

    def finish(self, model: ModelState, status: str, diagnosis: Diagnosis,
               duration: float = 0.0) -> None:
        """The model ended (status "done" or "failed"): its Outcome, once."""
        self.set_flight(model, False)
        model.finished = True
        model.last = None
        outcome = Outcome(
            task=model.task,
            status=status,
            exit_code=diagnosis.exit_code,
            signal=diagnosis.signal,
            attempts=max(model.tries, 1),
            duration_s=duration,
            total_s=model.total_s,
            wait_s=model.wait_s,
            where=self._where(model, diagnosis),
            stderr_tail=diagnosis.tail,
            error=diagnosis.error,
            retryable=status != "done" and diagnosis.retryable,
        )
        self.outcomes.append(outcome)
        self.counts[status] = self.counts.get(status, 0) + 1
        if self.progress is not None:
            self.progress.record_duration(model.total_s)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _where(self, model: ModelState, diagnosis: Diagnosis) -> str:
        if diagnosis.pod:
            node = f" node={diagnosis.node}" if diagnosis.node else ""
            return f"pod={self.namespace}/{diagnosis.pod}{node}"
        return f"job={self.namespace}/{model.name}" if model.name else ""

    def drop_retries(self) -> None:
        """Retries that will not happen now are reported as the failures they were; the
        queue is emptied (models never submitted stay for a later run)."""
        for key in list(self.queue):
            model = self.models[key]
            if model.last is not None and not (model.in_flight or model.finished):
                self.finish(model, "failed", model.last)
        self.queue.clear()

    def update_progress(self) -> None:
        if self.progress is None:
            return
        self.progress.update(
            done=self.counts["done"], failed=self.counts["failed"],
            running=len(self.flight) - len(self.waiting),
            waiting=len(self.queue) + len(self.waiting))
