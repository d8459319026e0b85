"""Tests of controller.run.recorder: outcomes become failure records (or clear them) in a real
store,
and a worker's "done" counts only with a marker in the store."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from controller.backends.base import Outcome, Task
from controller.run.recorder import Recorder
from controller.run.runs import run_report
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import marker_key
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.records import FailureRecord, read_failures, write_failure
from esd_worker.core.store.stores import LocalStore

ROW = ModelRow("org/m", None, "", None)


def make_outcome(task: Task, status: str, **kw: Any) -> Outcome:
    fields: dict[str, Any] = {
        "task": task, "status": status, "exit_code": 0 if status == "done" else 3,
        "signal": None, "attempts": 1, "duration_s": 1.5, "total_s": 1.5, "wait_s": 0.25,
        "where": "gpus=0", "stderr_tail": (), "error": "" if status == "done" else
        "PermanentModelError: retrying cannot help (exit 3)", "retryable": False,
    }
    fields.update(kw)
    return Outcome(**fields)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "out")


def old_failure(store: LocalStore) -> None:
    write_failure(store, FailureRecord(
        model=ROW.ref, model_key=ROW.key, error="TransientError", exit_code=4, signal=None,
        retryable=True, attempts=1, stderr_tail=(), run_id="old", time="t"))


def test_done_with_a_marker_clears_the_old_failure(store: LocalStore) -> None:
    old_failure(store)
    store.put_bytes(marker_key(ROW.key), Marker(model=ROW.ref, model_key=ROW.key).to_json())
    recorder = Recorder(store, "run")
    recorder(make_outcome(Task.for_model(ROW), "done"))
    assert (recorder.done, recorder.failed, recorder.durations) == ([ROW.key], {},
                                                                     {ROW.key: 1.5})
    assert read_failures(store) == {}


def test_done_without_a_marker_is_a_retryable_failure(store: LocalStore) -> None:
    """The worker said yes but the store disagrees: never count it done."""
    recorder = Recorder(store, "run")
    recorder(make_outcome(Task.for_model(ROW), "done"))
    assert recorder.done == []
    record = read_failures(store)[ROW.key]
    assert record.error.startswith("MarkerMissing") and record.retryable
    assert record.run_id == "run"


def test_failure_is_recorded_redacted_and_logged_with_where(
    store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    token = "hf_" + "a" * 30
    outcome = make_outcome(Task.for_model(ROW), "failed", attempts=3, where="pod=ns/p node=n1",
                           stderr_tail=(f"401 for token {token}",))
    with caplog.at_level(logging.ERROR, logger="controller.run.recorder"):
        Recorder(store, "run")(outcome)
    record = read_failures(store)[ROW.key]
    assert (record.attempts, record.exit_code, record.retryable) == (3, 3, False)
    assert token not in (store.get_bytes(f"_failures/{ROW.key}.json") or b"").decode()
    assert token not in caplog.text and "pod=ns/p node=n1" in caplog.text


def test_custom_commands_leave_no_records(store: LocalStore) -> None:
    """A command is no model: its failure is tallied for the run report only."""
    recorder = Recorder(store, "run")
    task = Task(key="cmd-1", label="false", argv=("false",))
    recorder(make_outcome(task, "failed", exit_code=1))
    recorder(make_outcome(Task(key="cmd-2", label="true", argv=("true",)), "done"))
    assert list(recorder.failed) == ["cmd-1"] and recorder.done == ["cmd-2"]
    assert list(store.list_keys()) == []


def test_cancelled_is_neither_done_nor_failed(store: LocalStore) -> None:
    recorder = Recorder(store, "run")
    recorder(make_outcome(Task.for_model(ROW), "cancelled"))
    assert (recorder.cancelled, recorder.done, recorder.failed) == ([ROW.key], [], {})
    assert recorder.attempted == 0 and recorder.waits == [0.25]


@pytest.mark.parametrize("status", ["done", "failed"])
def test_an_outcome_the_store_holds_is_tallied_and_nothing_is_written(
    store: LocalStore, status: str,
) -> None:
    """A sharded run's workers wrote the marker or the record: the recorder only counts,
    it neither checks a marker (a million reads) nor writes or clears a record."""
    old_failure(store)  # from an earlier run: a recorded outcome leaves it alone
    before = {key: store.get_bytes(key) for key in store.list_keys()}
    recorder = Recorder(store, "run")
    recorder(make_outcome(Task.for_model(ROW), status, recorded=True))
    assert {key: store.get_bytes(key) for key in store.list_keys()} == before
    assert recorder.done == [] and recorder.waits == [] and recorder.durations == {}
    assert recorder.done_count == (status == "done")
    assert list(recorder.failed) == ([ROW.key] if status == "failed" else [])


def test_a_run_of_many_failures_lists_the_first_and_counts_them_all(store: LocalStore) -> None:
    """A sweep of millions may fail hundreds of thousands: every failed model gets its record
    in the store and is counted, but the recorder (and the run report) keeps the first
    listed_failures records only, so the controller's memory does not grow with them."""
    recorder = Recorder(store, "20261123T070501Z-abcdef", listed_failures=3)
    rows = [ModelRow(f"org/m-{i}", None, "", None) for i in range(7)]
    for row in rows:
        recorder(make_outcome(Task.for_model(row), "failed"))
    recorder(make_outcome(Task.for_model(rows[1]), "failed", recorded=True))  # listed: once
    assert list(recorder.failed) == [r.key for r in rows[:3]]
    assert recorder.failed_count == 7 and recorder.attempted == 7
    assert len(read_failures(store)) == 7
    report = run_report(run_id=recorder.run_id, started_at="t0", finished_at="t1",
                        output=store.url, mode="esd", backend="local", backend_report={},
                        parameters={}, counts={}, tally=recorder, summary_rows=0,
                        runtime_s=1.0, interrupted=False)
    assert report["counts"]["failed"] == 7 and report["success_rate"] == 0.0
    assert list(report["failures"]) == [r.key for r in rows[:3]]
    assert report["failures_not_listed"] == 4
