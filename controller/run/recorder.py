"""Outcomes into store records as they arrive: a done model's old failure record goes, a failed
model gets one (`_failures/<model_key>.json`), and the run's tally grows.

Owns what a run learned about each task; knows no backend (an Outcome says where a task
ran). A worker's "done" is checked against the store: only a marker makes a model done.
An outcome the store holds already (Outcome.recorded: a sharded run's workers write their
markers and failure records themselves) is only tallied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.backends.base import Outcome
from esd_worker.core.redact import redact
from esd_worker.core.store.layout import attempt_key, marker_key
from esd_worker.core.store.records import FailureRecord, clear_failure, utc_now, write_failure
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

LISTED_FAILURES = 10_000  # failure records a run keeps for its report; the rest are counted


@dataclass
class Recorder:
    """The backends' on_outcome callback for one run (called in the run's thread).

    done / cancelled: task keys in the order they ended (done: of outcomes the recorder
    confirmed; done_recorded counts the ones a sharded run's store vouched for, which are
    not listed: millions of keys); failed: key → the record written, for the first
    `listed_failures` failed models (kept for custom commands too, which get no record in
    the store), failed_count: every failed model (a sweep of millions may fail hundreds of
    thousands: the controller must not hold them all); durations: key →
    seconds of the last attempt; waits: seconds each task waited for a slot.
    writing: whether outcomes still go to the store (`stop_writing`: the output's lease was
    lost, and another sweep's records must not be overwritten); they are tallied either way.
    on_end: told each model's verdict once tallied: (outcome, error, retryable), error ""
    when done (the run's metrics, controller.metrics); cancelled tasks are not told.
    """

    store: Store
    run_id: str
    done: list[str] = field(default_factory=list)
    failed: dict[str, FailureRecord] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    done_recorded: int = 0
    writing: bool = True
    failed_count: int = 0
    listed_failures: int = LISTED_FAILURES
    on_end: Callable[[Outcome, str, bool], None] | None = None

    def stop_writing(self) -> None:
        """From now on tally outcomes without touching the store (safe from any thread)."""
        self.writing = False

    @property
    def done_count(self) -> int:
        return len(self.done) + self.done_recorded

    @property
    def attempted(self) -> int:
        return self.done_count + self.failed_count

    def _keep(self, key: str, record: FailureRecord) -> None:
        """Count the failed model; list its record while fewer than listed_failures are. (A
        model ends once per run: the backends give one final outcome per task.)"""
        if key not in self.failed:
            self.failed_count += 1
            if len(self.failed) >= self.listed_failures:
                return
        self.failed[key] = record

    def __call__(self, outcome: Outcome) -> None:
        task = outcome.task
        key, model = task.key, task.row is not None
        if outcome.recorded:  # no wait measured: the pods of a sharded run wait as shards
            self._tally_recorded(outcome)
            return
        self.waits.append(outcome.wait_s)
        if outcome.status == "cancelled":
            self.cancelled.append(key)
            log.info("model=%s key=%s cancelled (no result; the next run does it)",
                     task.label, key)
            return
        error, retryable = outcome.error, outcome.retryable
        if outcome.status == "done" and model and not self.store.exists(marker_key(key)):
            # The worker said yes but the store disagrees: never count it done.
            error, retryable = "MarkerMissing: worker exited 0 but wrote no result.json", True
        elif outcome.status == "done":
            self.done.append(key)
            self.durations[key] = round(outcome.duration_s, 3)
            if model and self.writing:
                clear_failure(self.store, key)
            log.info("model=%s key=%s done in %.1fs on %s", task.label, key,
                     outcome.duration_s, outcome.where)
            self._tell(outcome, "", False)
            return
        record = self._record(outcome, error, retryable)
        self._keep(key, record)
        self._tell(outcome, error, retryable)
        self.durations[key] = round(outcome.duration_s, 3)
        if model and self.writing:
            write_failure(self.store, record)
            if outcome.exit_code is None or outcome.signal is not None:
                # A worker that died under the model (or was killed) left its attempt note;
                # the record now holds this run's count, and a later run (--retry-failed)
                # must start from none. A worker that reported its failure removed it.
                self.store.delete(attempt_key(key))
        tail = (line for line in reversed(outcome.stderr_tail) if line.strip())
        last = redact(next(tail, ""))  # records are redacted; this log line must be too
        log.error("model=%s key=%s failed after %d attempt(s) on %s: %s%s", task.label, key,
                  outcome.attempts, outcome.where, error, f" | {last}" if last else "")

    def _record(self, outcome: Outcome, error: str, retryable: bool) -> FailureRecord:
        task = outcome.task
        return FailureRecord(
            model=task.label, model_key=task.key, error=error, exit_code=outcome.exit_code,
            signal=outcome.signal, retryable=retryable, attempts=outcome.attempts,
            stderr_tail=tuple(outcome.stderr_tail), run_id=self.run_id, time=utc_now(),
        )

    def _tally_recorded(self, outcome: Outcome) -> None:
        """Count an outcome the store holds; a done model is not logged one by one (a
        sharded run tallies a million at its end: the progress line showed them)."""
        key = outcome.task.key
        if outcome.status == "done":
            self.done_recorded += 1
            self._tell(outcome, "", False)
            return
        self._keep(key, self._record(outcome, outcome.error, outcome.retryable))
        self._tell(outcome, outcome.error, outcome.retryable)
        log.error("model=%s key=%s failed after %d attempt(s) on %s: %s", outcome.task.label,
                  key, outcome.attempts, outcome.where, outcome.error)

    def _tell(self, outcome: Outcome, error: str, retryable: bool) -> None:
        if self.on_end is not None:
            self.on_end(outcome, error, retryable)
