"""The long-lived worker's pure parts and its per-model loop in-process: the protocol, the inbox,
bases before adapters, and Batch with its analysis step injected (the step is Batch's own
parameter), writing to a real local store."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.errors import (
    GpuOutOfMemoryError,
    PermanentModelError,
    StoreError,
    Terminated,
    UsageError,
)
from esd_worker.core.models.modellist import ModelRow, base_first
from esd_worker.core.protocol import (
    DRAIN,
    MODEL_BEGIN,
    MODEL_END,
    Request,
    Result,
    parse_event,
    parse_op,
    result_from,
)
from esd_worker.core.store.layout import (
    attempt_key,
    failure_key,
    model_file_key,
    write_model_result,
)
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import READ_LIMIT, LocalStore, Store
from esd_worker.serve.batch import Batch, BatchSettings, Tally
from esd_worker.serve.inbox import Inbox

# -- protocol ---------------------------------------------------------------------------------


def test_requests_and_results_read_back_as_written() -> None:
    request = Request("k", "org/m@v1", "lora", "org/base", 3)
    assert parse_op(request.to_line()) == request
    result = Result("k", "failed", 4, "TransientError: x", True, 1.5)
    assert result_from(parse_event(result.to_line())) == result
    assert parse_op('{"op": "drain"}') == DRAIN


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"op": "explode"}', "unknown op"),
        ('{"op": "analyse", "model": "m"}', "lacks 'key'"),
        ('{"op": "analyse", "key": "", "model": "m"}', "non-empty"),
        ('{"op": "analyse", "key": "k", "model": "m", "attempt": "2"}', "attempt an integer"),
        ('{"op": "analyse", "key": "..", "model": "m"}', "not a model key"),
        ('{"op": "analyse", "key": "a/b", "model": "m"}', "not a model key"),
        ('{"op": "analyse", "key": "a\\u0000b", "model": "m"}', "not a model key"),
        ('{"op": "analyse", "key": "%s", "model": "m"}' % ("k" * 300), "not a model key"),
        ('{"op": "analyse", "key": "Key_A", "model": "m"}', "not a model key"),
        ('{"op": "analyse", "key": 7, "model": "m"}', "non-empty strings"),
    ],
    ids=["not-json", "not-an-object", "unknown-op", "no-key", "empty-key", "attempt-a-string",
         "dotdot-key", "slash-key", "nul-key", "300-char-key", "not-a-slug-key", "int-key"],
)
def test_bad_request_lines_say_what_is_wrong(line: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_op(line)


# -- the inbox ------------------------------------------------------------------------------


def test_the_inbox_reads_requests_and_a_drain_drops_what_is_queued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = [Request("a", "m-a").to_line(), "garbage\n", Request("b", "m-b").to_line()]
    inbox = Inbox()
    inbox.read_from(io.StringIO("".join(lines))).join(5)
    assert [r.key for r in inbox] == ["a", "b"]  # end of input closes it
    assert "ignored a bad request line" in caplog.text
    inbox = Inbox([Request("a", "m-a"), Request("b", "m-b")])
    assert inbox.take() == Request("a", "m-a")
    inbox.read_from(io.StringIO('{"op": "drain"}\n')).join(5)
    assert inbox.take() is None and inbox.upcoming() == []


def test_the_inbox_knows_what_its_queue_still_needs() -> None:
    """Asked after every model by the prefetcher (eviction): counted, not searched."""
    inbox = Inbox([Request("a", "org/base@v1"), Request("b", "org/lora", "lora", "org/base"),
                   Request("c", "org/other")])
    assert inbox.upcoming(2) == [Request("a", "org/base@v1"),
                                 Request("b", "org/lora", "lora", "org/base")]
    assert inbox.needs("org/base@v1") and inbox.needs("org/base")
    assert inbox.take() is not None  # a
    assert not inbox.needs("org/base@v1") and inbox.needs_repo("org/base")
    assert inbox.take() is not None  # b
    assert not inbox.needs_repo("org/base") and inbox.needs_repo("org/other")
    inbox.drain()
    assert not inbox.needs_repo("org/other") and inbox.upcoming() == []


def row(model_id: str, relation: str = "", source: str | None = None) -> ModelRow:
    return ModelRow(model_id, None, relation, source)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        pytest.param([row("a"), row("b"), row("la", "lora", "a")], ["a", "la", "b"],
                     id="adapter-moves-up"),
        pytest.param([row("la", "lora", "a"), row("x"), row("a")], ["x", "a", "la"],
                     id="adapter-moves-down"),
        pytest.param([row("la", "lora", "zz"), row("a")], ["la", "a"], id="base-not-listed"),
        pytest.param([row("a"), row("l1", "lora", "a"), row("b"), row("l2", "peft", "a")],
                     ["a", "l1", "l2", "b"], id="two-adapters-keep-their-order"),
        pytest.param([row("a"), row("ft", "finetune", "a"), row("b")], ["a", "ft", "b"],
                     id="a-finetune-stays"),
    ],
)
def test_adapters_follow_their_base(rows: list[ModelRow], expected: list[str]) -> None:
    assert [r.model_id for r in base_first(rows)] == expected


# -- the batch loop -------------------------------------------------------------------------

TEMPLATE = WorkerSettings(model="(batch)", output="unused")


class Analyses:
    """The analysis step: what each model does, by name; records what it was asked."""

    def __init__(self, behaviour: dict[str, BaseException | None]) -> None:
        self.behaviour = behaviour
        self.calls: list[str] = []

    def __call__(self, settings: WorkerSettings, store: Store, key: str) -> None:
        self.calls.append(settings.model)
        logging.getLogger("esd_worker.analysis.analyze").info("analysing %s", settings.model)
        error = self.behaviour.get(settings.model)
        if error is not None:
            raise error
        write_model_result(store, Marker(model=settings.model, model_key=key,
                                         parameters=settings.analysis.as_dict()),
                           layers=b"layer,alpha\nl0,3.0\n")


def run_batch(store: Store, analyses: Analyses, requests: list[Request],
              **settings: Any) -> tuple[Tally, list[dict[str, Any]], str]:
    events: list[dict[str, Any]] = []
    stderr = io.StringIO()
    batch = Batch(BatchSettings(template=TEMPLATE, run_id="run-7", **settings), store, analyses,
                  lambda line: events.append(parse_event(line)), stderr=stderr)
    tally = batch.run(iter(requests))
    return tally, events, stderr.getvalue()


def req(name: str, attempt: int = 1) -> Request:
    return Request(f"key-{name}", name, attempt=attempt)


def test_each_model_gets_a_start_and_a_result_and_its_log_lines_are_framed(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    tally, events, stderr = run_batch(store, Analyses({}), [req("a"), req("b")])
    assert [(e["event"], e["key"]) for e in events] == [
        ("start", "key-a"), ("result", "key-a"), ("start", "key-b"), ("result", "key-b")]
    assert [result_from(e).status for e in events if e["event"] == "result"] == ["done"] * 2
    lines = stderr.splitlines()
    assert lines[0].startswith(MODEL_BEGIN) and json.loads(lines[0][len(MODEL_BEGIN):]) == {
        "key": "key-a", "attempt": 1}
    assert lines[1].startswith(MODEL_END)
    assert (tally.done, tally.exit_code) == (2, 0)
    assert not store.exists(attempt_key("key-a"))  # the attempt note goes with the outcome


@pytest.mark.parametrize(
    ("error", "exit_code", "retryable", "cls"),
    [
        pytest.param(PermanentModelError("model not found: x"), 3, False, "PermanentModelError",
                     id="permanent"),
        pytest.param(StoreError("throttled"), 4, True, "TransientError", id="transient"),
        pytest.param(GpuOutOfMemoryError("out of GPU memory"), 5, True, "GpuOutOfMemoryError",
                     id="gpu-oom"),
        pytest.param(UsageError("bad flag"), 2, False, "UsageError", id="usage"),
        pytest.param(MemoryError(), 4, True, "TransientError", id="host-oom"),
        # torch's host allocator's own words (tests/esd_worker/test_errors.py provokes them)
        pytest.param(RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot "
            "allocate memory)"), 4, True, "TransientError", id="torch-host-oom"),
        pytest.param(ZeroDivisionError("bug"), 3, False, "PermanentModelError", id="a-bug"),
    ],
)
def test_a_failed_model_gets_the_controllers_record_and_the_next_one_runs(
    tmp_path: Path, error: BaseException, exit_code: int, retryable: bool, cls: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)  # as the worker's own log setup does
    store = LocalStore(tmp_path)
    tally, events, _ = run_batch(store, Analyses({"bad": error}), [req("bad", 2), req("ok")])
    results = [result_from(e) for e in events if e["event"] == "result"]
    assert [r.status for r in results] == ["failed", "done"]
    assert (results[0].exit_code, results[0].retryable) == (exit_code, retryable)
    assert results[0].error.startswith(f"{cls}: ")
    data = store.get_bytes(failure_key("key-bad"))
    assert data is not None
    record = FailureRecord.from_json(data)
    assert (record.exit_code, record.retryable, record.attempts, record.run_id) == (
        exit_code, retryable, 2, "run-7")
    assert record.error == results[0].error
    # the controller's format (esd_worker.core.store.records.utc_now)
    assert record.time.endswith("+00:00")
    assert any("analysing bad" in line for line in record.stderr_tail)
    assert record.stderr_tail[-1].startswith("esd-worker: error: ")
    assert tally.exit_code == (4 if retryable else 3)


def test_a_done_model_clears_its_old_failure_record_and_is_skipped_next_time(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    run_batch(store, Analyses({"m": PermanentModelError("gone")}), [req("m")])
    assert store.exists(failure_key("key-m"))
    analyses = Analyses({})
    run_batch(store, analyses, [req("m")])
    assert not store.exists(failure_key("key-m")) and analyses.calls == ["m"]
    tally, _, _ = run_batch(store, analyses, [req("m")])
    assert analyses.calls == ["m"] and (tally.skipped, tally.exit_code) == (1, 0)
    tally, _, _ = run_batch(store, analyses, [req("m")], overwrite=True)
    assert analyses.calls == ["m", "m"] and tally.done == 1


@pytest.mark.parametrize("damage", [
    lambda store: store.delete(model_file_key("key-m", "layers.csv")),
    lambda store: store.put_bytes(model_file_key("key-m", "layers.csv"), b"layer,alpha\n"),
], ids=["table-deleted", "table-truncated"])
def test_a_done_model_whose_files_are_damaged_is_analysed_again(
    tmp_path: Path, damage: Callable[[Store], None], caplog: pytest.LogCaptureFixture,
) -> None:
    store = LocalStore(tmp_path)
    analyses = Analyses({})
    run_batch(store, analyses, [req("m")])
    damage(store)
    tally, _, _ = run_batch(store, analyses, [req("m")])
    assert analyses.calls == ["m", "m"] and (tally.done, tally.skipped) == (1, 0)
    assert "key-m result damaged (layers.csv" in caplog.text


def test_skip_failed_skips_only_permanent_failure_records(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    run_batch(store, Analyses({"p": PermanentModelError("gone"), "t": StoreError("later")}),
              [req("p"), req("t")])
    analyses = Analyses({})
    tally, _, _ = run_batch(store, analyses, [req("p"), req("t")], skip_failed=True)
    assert analyses.calls == ["t"] and tally.skipped == 1


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_model_whose_attempt_note_shows_every_try_crashed_is_a_poison_model(
    tmp_path: Path, max_retries: int
) -> None:
    """A note left by workers that died under the model (they never cleared it) counts
    their starts; past max_retries the model is recorded, not started."""
    store = LocalStore(tmp_path)
    store.put_bytes(attempt_key("key-p"), json.dumps(
        {"starts": max_retries + 1, "run_id": "run-7"}).encode())
    analyses = Analyses({})
    _, events, _ = run_batch(store, analyses, [req("p"), req("ok")],
                                 max_retries=max_retries)
    assert analyses.calls == ["ok"]
    [poison, _] = [result_from(e) for e in events if e["event"] == "result"]
    assert (poison.status, poison.retryable) == ("failed", False)
    assert poison.error.startswith(f"WorkerCrashed: {max_retries + 1} worker(s) died")
    data = store.get_bytes(failure_key("key-p"))
    assert data is not None and FailureRecord.from_json(data).attempts == max_retries + 1
    assert not store.exists(attempt_key("key-p"))


def test_fewer_crashes_than_allowed_are_counted_and_the_model_runs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes(attempt_key("key-p"), json.dumps({"starts": 1}).encode())
    seen: list[int] = []

    def analyse(settings: WorkerSettings, target: Store, key: str) -> None:
        data = target.get_bytes(attempt_key(key))
        assert data is not None
        seen.append(json.loads(data)["starts"])
        raise PermanentModelError("gone")

    run_batch(store, Analyses({}), [])  # nothing: the note stays
    events: list[dict[str, Any]] = []
    Batch(BatchSettings(template=TEMPLATE, max_retries=2), store, analyse,
          lambda line: events.append(parse_event(line)), stderr=io.StringIO()).run(
        iter([req("p")]))
    assert seen == [2]  # this start is the second
    assert not store.exists(attempt_key("key-p"))


@pytest.mark.parametrize("note", [
    pytest.param({"starts": 1, "run_id": "run-6"}, id="another-runs-note"),
    pytest.param({"starts": 1}, id="a-note-of-no-run"),
    pytest.param({"starts": 1e308, "run_id": "run-7"}, id="starts-1e308"),
    pytest.param({"starts": 10**6, "run_id": "run-7"}, id="more-starts-than-allowed"),
    pytest.param({"starts": "1", "run_id": "run-7"}, id="starts-a-string"),
    pytest.param({"starts": True, "run_id": "run-7"}, id="starts-a-bool"),
    pytest.param({"starts": 0, "run_id": "run-7"}, id="starts-zero"),
    pytest.param({"starts": 1, "run_id": 7}, id="run-id-a-number"),
    pytest.param([1], id="a-list"),
    pytest.param("not json", id="not-json"),
])
def test_a_note_that_is_not_this_runs_counts_no_crash(tmp_path: Path, note: object) -> None:
    """With --max-retries 0 any crash counted would record the model as poison unstarted:
    it is analysed, because only a well-formed note of this run (run-7) with at most
    max_retries + 1 starts counts. Another run's note is what a `--retry-failed` rerun finds
    after a poison model, and must not block that retry."""
    store = LocalStore(tmp_path)
    data = note.encode() if isinstance(note, str) else json.dumps(note).encode()
    store.put_bytes(attempt_key("key-p"), data)
    analyses = Analyses({})
    tally, _, _ = run_batch(store, analyses, [req("p")], max_retries=0)
    assert analyses.calls == ["p"] and tally.done == 1
    assert not store.exists(attempt_key("key-p")) and not store.exists(failure_key("key-p"))


def test_a_request_whose_key_is_no_model_key_fails_alone(tmp_path: Path) -> None:
    """Past the protocol's check (a caller of Batch): no store call is made with the key, the
    request fails as a usage error and the next model runs."""
    store = LocalStore(tmp_path / "out")
    analyses = Analyses({})
    tally, events, _ = run_batch(store, analyses, [Request("..", "m-x"), req("ok")])
    [bad, ok] = [result_from(e) for e in events if e["event"] == "result"]
    assert (bad.status, bad.exit_code, ok.status) == ("failed", 2, "done")
    assert analyses.calls == ["ok"] and tally.failed == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


class RefusingStore(LocalStore):
    """A local store whose reads of one model's files fail as an outage does (StoreError),
    and whose writes fail once `refuse_writes` is set: a store double at the Store seam."""

    def __init__(self, root: Path, model_key: str) -> None:
        super().__init__(root)
        self.model_key = model_key
        self.refuse_writes = False

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        if key.startswith(self.model_key) or key.endswith(f"/{self.model_key}.json"):
            raise StoreError(f"store unreachable reading {key}")
        return super().get_bytes(key, limit=limit)

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.refuse_writes:
            raise StoreError(f"store unreachable writing {key}")
        super().put_bytes(key, data)


@pytest.mark.parametrize("writes", [True, False], ids=["record-written", "store-refuses"])
def test_a_store_error_before_the_model_starts_is_that_models_failure(
    tmp_path: Path, writes: bool
) -> None:
    """The skip check's read fails: the model fails retryably (an outage is worth a retry)
    and the worker goes on; when the failure record cannot be written either the result
    still comes, retryable, since no outcome is in the store."""
    store = RefusingStore(tmp_path, "key-x")
    store.refuse_writes = not writes
    analyses = Analyses({})
    tally, events, _ = run_batch(store, analyses, [req("x"), req("ok")])
    results = {e["key"]: result_from(e) for e in events if e["event"] == "result"}
    assert (results["key-x"].status, results["key-x"].retryable) == ("failed", True)
    assert "store unreachable" in results["key-x"].error
    assert analyses.calls == (["ok"] if writes else [])
    assert results["key-ok"].status == ("done" if writes else "failed")
    assert LocalStore(tmp_path).exists(failure_key("key-x")) is writes
    assert tally.exit_code == 4


def test_a_stop_ends_the_batch_without_blaming_the_model(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    analyses = Analyses({"a": Terminated("terminated by signal 15")})
    with pytest.raises(Terminated):
        run_batch(store, analyses, [req("a"), req("b")])
    assert analyses.calls == ["a"]
    assert not store.exists(failure_key("key-a")) and not store.exists(attempt_key("key-a"))


@pytest.mark.parametrize(
    ("results", "code"),
    [
        ([], 0),
        ([Result("a", "done", 0), Result("b", "skipped", 0)], 0),
        ([Result("a", "done", 0), Result("b", "failed", 3)], 3),
        ([Result("a", "failed", 3), Result("b", "failed", 4, retryable=True)], 4),
    ],
)
def test_the_batch_exit_code(results: list[Result], code: int) -> None:
    tally = Tally()
    for result in results:
        tally.add(result)
    assert tally.exit_code == code
