"""controller.run.plan.ListPlan: the model list as a stream, its counts, its verify limit, its work.

The counts come from one pass over the list (scan); the states from another (classify):
they must agree in every situation the plan knows, including the one where more markers
exist than the verify limit and presence alone counts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.keyset import KeySet
from controller.run.plan import DONE, SKIPPED, STALE, TODO, ListPlan
from esd_worker.core.models.modellist import ListFile, ModelRow, RowProblem
from esd_worker.core.store.layout import marker_key, model_file_key, write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from tests.controller.test_plan import (
    OTHER_PARAMS,
    PARAMS,
    CountingStore,
    make_model_row,
    write_failed,
    write_marker,
)

ROWS = [make_model_row(f"org/m{i}") for i in range(8)]
BAD = RowProblem("models.csv", 9, "not an id")

Setup = Callable[[Store], None]


def nothing(store: Store) -> None:
    pass


def mixed(store: Store) -> None:
    write_marker(store, ROWS[0])  # done
    write_marker(store, ROWS[1], OTHER_PARAMS)  # stale
    store.put_bytes(marker_key(ROWS[2].key), b"{not json")  # unreadable, no table: damaged
    write_failed(store, ROWS[3], retryable=False)  # permanent
    write_failed(store, ROWS[4], retryable=True)  # retried
    write_marker(store, ROWS[5], OTHER_PARAMS)
    write_failed(store, ROWS[5], retryable=False)  # stale and permanent


def sealed(store: Store, row: ModelRow) -> None:
    """A result as the worker writes it: layers.csv, eigs.npz and a marker sealing both."""
    marker = Marker(model=row.ref, model_key=row.key, parameters=dict(PARAMS),
                    eigs_name="eigs.npz")
    write_model_result(store, marker, layers=b"layer,alpha\nl0,3.0\nl1,4.0\n",
                       eigs=b"E" * 64)


def damaged(store: Store) -> None:
    for row in ROWS[:5]:
        sealed(store, row)
    store.put_bytes(model_file_key(ROWS[1].key, "layers.csv"), b"layer,alpha\nl0,3.0\n")
    store.delete(model_file_key(ROWS[2].key, "layers.csv"))
    store.put_bytes(model_file_key(ROWS[3].key, "eigs.npz"), b"garbage")
    # Same size, other bytes: a listing cannot tell (the reader's hash check does).
    store.put_bytes(model_file_key(ROWS[4].key, "eigs.npz"), b"F" * 64)


@pytest.mark.parametrize(("setup", "options", "expected"), [
    (nothing, {}, {"todo": 8}),
    (mixed, {}, {"done": 1, "todo": 7, "stale": 2, "damaged": 1}),
    (mixed, {"skip_failed": True}, {"done": 1, "todo": 5, "stale": 1, "skipped_failed": 2,
                                    "damaged": 1}),
    (mixed, {"overwrite": True}, {"todo": 8}),
    (mixed, {"overwrite": True, "skip_failed": True}, {"todo": 6, "skipped_failed": 2}),
    # Presence only: every listed model with a marker and its layer table counts done,
    # whatever the marker holds (the unreadable marker of m2 has no table).
    (mixed, {"verify_limit": 2}, {"done": 3, "todo": 5, "damaged": 1}),
    (mixed, {"limit": 3}, {"done": 1, "todo": 2, "stale": 1, "damaged": 1}),
    # Files not at their sealed sizes (m1 truncated, m2 deleted, m3 replaced): run again.
    (damaged, {}, {"done": 2, "todo": 6, "damaged": 3}),
    (damaged, {"skip_failed": True}, {"done": 2, "todo": 6, "damaged": 3}),
    (damaged, {"verify_limit": 2}, {"done": 4, "todo": 4, "damaged": 1}),
], ids=["empty", "mixed", "skip-failed", "overwrite", "overwrite-skip", "presence", "limit",
        "damaged", "damaged-skip-failed", "damaged-presence"])
def test_counts_agree_with_the_states(tmp_path: Path, setup: Setup,
                                      options: dict[str, object],
                                      expected: dict[str, int]) -> None:
    store = CountingStore(tmp_path / "out")
    setup(store)
    items: list[ModelRow | RowProblem] = [ROWS[0], BAD, *ROWS, ROWS[1]]  # a bad row, duplicates
    plan = ListPlan(lambda: items, store, PARAMS, **options).scan()  # type: ignore[arg-type]
    counts = {"done": 0, "todo": 0, "stale": 0, "skipped_failed": 0, "damaged": 0, **expected}
    got = plan.counts
    assert {"done": got.done, "todo": got.todo, "stale": got.stale, "damaged": got.damaged,
            "skipped_failed": got.skipped_failed} == counts
    states = collections.Counter(state for _, state in plan.classify())
    assert states[DONE] == got.done and states[SKIPPED] == got.skipped_failed
    assert states[TODO] + states[STALE] == got.todo and states[STALE] == got.stale
    assert got.models == min(len(ROWS), int(str(options.get("limit", 99))))
    assert got.bad_rows == 1 and plan.problems == [BAD]
    assert len(list(plan.todo())) == got.todo
    assert plan.verified is (options.get("verify_limit") != 2)


def test_only_listed_markers_are_read_and_only_up_to_the_limit(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "out")
    for row in ROWS:
        write_marker(store, row)
    ListPlan(lambda: ROWS[:3], store, PARAMS).scan()
    assert sorted(store.gets) == sorted(marker_key(r.key) for r in ROWS[:3])
    store.gets.clear()
    ListPlan(lambda: ROWS, store, PARAMS, verify_limit=5).scan()
    assert store.gets == []  # 8 present > 5: presence counts, no marker read
    assert store.listings == ["", ""]  # one listing per scan


def test_a_list_in_a_store_is_fetched_once_and_read_as_often_as_needed(tmp_path: Path) -> None:
    bucket = open_store(str(tmp_path / "bucket"))
    text = "model_id,base_model_relation,source_model\norg/base,,\norg/x,,\norg/ad,lora,org/base\n"
    bucket.put_bytes("lists/models.csv", text.encode())
    source = ListFile(f"file://{tmp_path / 'bucket'}/lists/models.csv")
    plan = ListPlan(source.items, open_store(str(tmp_path / "out")), PARAMS).scan()
    bucket.put_bytes("lists/models.csv", b"model_id\norg/changed\n")  # the copy is read
    order = [row.ref for row in plan.todo()]
    assert order == ["org/base", "org/ad", "org/x"]  # the adapter right after its base
    assert [row.ref for row in plan.rows()] == ["org/base", "org/x", "org/ad"]
    source.close()


def test_rows_of_a_large_list_are_not_held(tmp_path: Path) -> None:
    """The plan keeps counts, not rows: a generator of 50,000 rows is read twice and no
    ModelRow of it stays referenced by the plan."""
    reads = []

    def items() -> object:
        reads.append(1)
        return (make_model_row(f"org/big-{i}") for i in range(50_000))

    plan = ListPlan(items, open_store(str(tmp_path / "out")), PARAMS).scan()  # type: ignore[arg-type]
    assert plan.counts.todo == 50_000 and len(reads) == 1
    assert sum(1 for _ in plan.todo()) == 50_000 and len(reads) == 2
    held = [v for v in vars(plan).values() if isinstance(v, list | tuple | set) and v
            and isinstance(next(iter(v)), ModelRow)]
    assert held == []


def test_a_key_set_answers_membership_like_a_set() -> None:
    keys = [row.key for row in ROWS[:5]]
    held = KeySet(keys + keys[:2])  # duplicates count once
    assert len(held) == 5
    assert all(key in held for key in keys)
    assert not any(row.key in held for row in ROWS[5:])
    assert "" not in KeySet()


class SmallChunks(KeySet):
    CHUNK = 3  # several sorted chunks merged, duplicates across them


@pytest.mark.parametrize("kind", [KeySet, SmallChunks])
def test_a_key_set_built_from_chunks_is_the_same_set(kind: type[KeySet]) -> None:
    keys = [f"org--m{i}" for i in range(20)]
    held = kind(keys[:12] + keys[5:8] + keys[:2])
    assert len(held) == 12
    assert [key in held for key in keys] == [True] * 12 + [False] * 8


@pytest.mark.parametrize(("refs", "limit", "expected"), [
    (["a", "b", "a", "c", "b"], None, ["a", "b", "c"]),
    (["a", "a", "a", "b"], None, ["a", "b"]),
    (["a", "b@v1", "b", "b@v1"], None, ["a", "b@v1", "b"]),  # another revision is another model
    (["a", "a", "b", "c"], 2, ["a", "b"]),  # the limit counts kept rows
    (["a", "b", "c"], None, ["a", "b", "c"]),
], ids=["spread", "run", "revisions", "limit", "none"])
def test_later_passes_drop_the_duplicates_the_scan_found(
        tmp_path: Path, refs: list[str], limit: int | None, expected: list[str]) -> None:
    def row(ref: str) -> ModelRow:
        return make_model_row(f"org/{ref}")

    items: list[ModelRow | RowProblem] = [row(ref) for ref in refs]
    items.insert(1, BAD)  # positions count bad rows too
    plan = ListPlan(lambda: items, open_store(str(tmp_path / "out")), PARAMS,
                    limit=limit).scan()
    assert plan.counts.duplicates == len(refs) - len(set(refs))
    for _ in range(2):  # every later pass agrees, and holds no set of what it saw
        assert [r.ref for r in plan.rows()] == [row(ref).ref for ref in expected]
        assert [r.ref for r, _ in plan.classify()] == [row(ref).ref for ref in expected]


def test_the_list_is_scanned_before_it_is_classified(tmp_path: Path) -> None:
    plan = ListPlan(lambda: ROWS, open_store(str(tmp_path / "out")), PARAMS)
    with pytest.raises(RuntimeError, match="scan"):
        next(plan.classify())
