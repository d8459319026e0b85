"""Tests of controller.run.plan: done iff a marker with the same parameters; stale, overwrite,
skip."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from controller.run.plan import Plan, plan_run
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import marker_key
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.records import FailureRecord, write_failure
from esd_worker.core.store.stores import READ_LIMIT, LocalStore, Store

PARAMS = AnalysisSettings().as_dict()
OTHER_PARAMS = AnalysisSettings(fix_fingers="DKS").as_dict()

# --- builders -------------------------------------------------------------------------------


def make_model_row(ref: str, relation: str = "") -> ModelRow:
    model_id, _, revision = ref.partition("@")
    return ModelRow(model_id, revision or None, relation, None, line=0)


def write_marker(store: Store, row: ModelRow, parameters: Mapping[str, Any] = PARAMS) -> None:
    """A marker as the worker writes it (Marker.to_json), with layers.csv beside it."""
    store.put_bytes(f"{row.key}/layers.csv", b"model_id,layer\n")
    store.put_bytes(
        marker_key(row.key),
        Marker(model=row.ref, model_key=row.key, model_id=row.model_id, revision=row.revision,
               parameters=dict(parameters)).to_json(),
    )


def write_failed(store: Store, row: ModelRow, *, retryable: bool) -> None:
    write_failure(store, FailureRecord(
        model=row.ref, model_key=row.key,
        error="TransientError" if retryable else "PermanentModelError",
        exit_code=4 if retryable else 3, signal=None, retryable=retryable, attempts=1,
        stderr_tail=(), run_id="r", time="2026-11-23T07:05:01Z",
    ))


def refs(rows: tuple[ModelRow, ...]) -> list[str]:
    return [r.ref for r in rows]


class CountingStore(LocalStore):
    """A LocalStore that counts calls, to check what the planner reads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: list[str] = []
        self.listings: list[str] = []

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        self.gets.append(key)
        return super().get_bytes(key, limit=limit)

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        self.listings.append(prefix)
        return super().list_keys(prefix)

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        self.listings.append(prefix)
        return super().list_sizes(prefix)


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(tmp_path / "results")


MODELS = tuple(make_model_row(r) for r in ("org/a", "org/b@main", "org/c", "org/d", "org/e"))
A, B, C, D, E = MODELS

# --- tests ----------------------------------------------------------------------------------


def test_empty_store_everything_todo(store: CountingStore) -> None:
    plan = plan_run(MODELS, store, PARAMS)
    assert plan == Plan(todo=MODELS, done=(), skipped_failed=(), stale=())


def test_done_iff_marker_with_same_parameters(store: CountingStore) -> None:
    """A done, B stale (other parameters), C has only layers.csv (crashed before the marker)."""
    write_marker(store, A)
    write_marker(store, B, OTHER_PARAMS)
    store.put_bytes(f"{C.key}/layers.csv", b"x\n")
    plan = plan_run(MODELS, store, PARAMS)
    assert refs(plan.done) == ["org/a"]
    assert refs(plan.todo) == ["org/b@main", "org/c", "org/d", "org/e"]
    assert refs(plan.stale) == ["org/b@main"]
    assert plan.skipped_failed == ()


def test_parameters_compared_after_json_round_trip(store: CountingStore) -> None:
    """Callers may pass tuples or ints where the marker holds lists or floats that read equal."""
    write_marker(store, A, {**PARAMS, "extra": [1, 2]})
    plan = plan_run([A], store, {**PARAMS, "extra": (1, 2)})
    assert refs(plan.done) == ["org/a"]


def test_parameter_missing_from_marker_is_stale(store: CountingStore) -> None:
    """A new analysis parameter means old results were computed without it: recompute."""
    old = {k: v for k, v in PARAMS.items() if k != "include_embeddings"}
    write_marker(store, A, old)
    plan = plan_run([A], store, PARAMS)
    assert refs(plan.stale) == ["org/a"] and refs(plan.todo) == ["org/a"]


def test_revision_is_part_of_identity(store: CountingStore) -> None:
    write_marker(store, make_model_row("org/b"))  # no revision: another model than org/b@main
    assert refs(plan_run([B], store, PARAMS).todo) == ["org/b@main"]


def test_overwrite_makes_everything_todo_and_reads_no_marker(store: CountingStore) -> None:
    for row in MODELS:
        write_marker(store, row)
    plan = plan_run(MODELS, store, PARAMS, overwrite=True)
    assert plan == Plan(todo=MODELS, done=(), skipped_failed=(), stale=())
    assert store.gets == []


def test_failed_models_are_retried_by_default(store: CountingStore) -> None:
    write_failed(store, C, retryable=False)
    plan = plan_run(MODELS, store, PARAMS)
    assert refs(plan.todo) == refs(MODELS)
    assert store.listings == [""]  # failure records are not even read


def test_skip_failed_skips_only_permanent_failures(store: CountingStore) -> None:
    write_marker(store, A)
    write_failed(store, A, retryable=False)  # done since: the marker wins
    write_failed(store, C, retryable=False)
    write_failed(store, D, retryable=True)
    write_marker(store, E, OTHER_PARAMS)
    write_failed(store, E, retryable=False)
    plan = plan_run(MODELS, store, PARAMS, skip_failed=True)
    assert refs(plan.done) == ["org/a"]
    assert refs(plan.skipped_failed) == ["org/c", "org/e"]
    assert refs(plan.todo) == ["org/b@main", "org/d"]
    assert plan.stale == ()


def test_skip_failed_still_applies_with_overwrite(store: CountingStore) -> None:
    write_marker(store, A)
    write_failed(store, C, retryable=False)
    plan = plan_run(MODELS, store, PARAMS, overwrite=True, skip_failed=True)
    assert refs(plan.skipped_failed) == ["org/c"]
    assert refs(plan.todo) == ["org/a", "org/b@main", "org/d", "org/e"]


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"{truncated", id="bad-json"),
        pytest.param(b"[1, 2, 3]", id="not-an-object"),
        pytest.param(b"\xff\xfe\x00", id="not-utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"schema": 2, "model": "org/b", "model_key": "k"}', id="newer-schema"),
        pytest.param(b'{"model": "org/b", "model_key": "k"}', id="no-schema"),
        pytest.param(b'{"schema": 1, "model": "org/b"}', id="no-model-key"),
        pytest.param(b'{"schema": 1, "model": "org/b", "model_key": "k", "parameters": [1]}',
                     id="parameters-not-an-object"),
    ],
)
def test_corrupt_marker_is_not_done_and_warned(
    store: CountingStore, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    write_marker(store, A)
    store.put_bytes(f"{B.key}/result.json", content)
    with caplog.at_level(logging.WARNING, logger="esd_worker.core.store.layout"):
        plan = plan_run([A, B], store, PARAMS)
    assert refs(plan.done) == ["org/a"]
    assert refs(plan.todo) == ["org/b@main"]
    assert plan.stale == ()  # nothing readable to compare with
    assert B.key in caplog.text


def test_marker_without_parameters_is_stale(store: CountingStore) -> None:
    store.put_bytes(f"{A.key}/layers.csv", b"model_id,layer\n")
    store.put_bytes(marker_key(A.key), Marker(model="org/a", model_key=A.key).to_json())
    plan = plan_run([A], store, PARAMS)
    assert refs(plan.stale) == ["org/a"]


def test_reads_only_markers_of_listed_models_with_one_listing(store: CountingStore) -> None:
    """Other models' markers in the store are never fetched; the store is listed once."""
    for i in range(20):
        write_marker(store, make_model_row(f"other/m{i}"))
    write_marker(store, A)
    write_marker(store, C)
    plan = plan_run(MODELS, store, PARAMS, threads=4)
    assert refs(plan.done) == ["org/a", "org/c"]
    assert sorted(store.gets) == sorted([f"{A.key}/result.json", f"{C.key}/result.json"])
    assert store.listings == [""]


def test_order_follows_the_list(store: CountingStore) -> None:
    rows = tuple(make_model_row(f"org/m{i:02d}") for i in range(30))
    for row in rows[::3]:
        write_marker(store, row)
    plan = plan_run(rows, store, PARAMS, threads=8)
    assert plan.done == rows[::3]
    assert plan.todo == tuple(r for i, r in enumerate(rows) if i % 3)


def test_single_thread(store: CountingStore) -> None:
    write_marker(store, A)
    assert refs(plan_run(MODELS, store, PARAMS, threads=1).done) == ["org/a"]
