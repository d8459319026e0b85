"""`esd-sweep compact` (controller.results.compact): missing models added from their per-model
files, small parts merged with each model once (its newest row), --rebuild, --dry-run,
orphan layers parts, the command line, and one store through S3 (moto over HTTP)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from controller.cli import main
from controller.results.compact import CompactSettings, compact_store
from controller.results.tables import Tables
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import layers_from_csv
from esd_worker.core.store.stores import LocalStore, Store
from esd_worker.core.store.tables import (
    LAYERS_TABLE,
    MODELS_TABLE,
    DoneModel,
    new_part_id,
    part_key,
    part_tables,
    table_bytes,
    write_parts,
)
from tests.support.results import analysed
from tests.support.s3server import S3Server, make_store, serve_s3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def done(key: str, arch: str, finished: str = "2026-01-01T00:00:00Z",
         alpha: float = 3.0) -> DoneModel:
    """A tiny done model: 3 layers."""
    marker = Marker(model=f"org/{key}", model_key=key, model_id=f"org/{key}",
                    architecture=arch, finished_at=finished, timings={"total_s": 1})
    rows = [{"layer": f"h.{i}", "M": 4, "N": 8, "num_params": 32, "alpha": alpha + i,
             "status": "ok"} for i in range(3)]
    return DoneModel(marker, rows)


files = analysed  # each model's own files, as a worker writes them


def models_of(store: Store) -> list[tuple[str, float]]:
    """(model_key, alpha_mean) of the models rows the parts hold (no fallback), sorted."""
    return sorted((r["model_key"], r["alpha_mean"])
                  for b in Tables(store).models(["model_key", "alpha_mean"], fallback=False)
                  for r in b.to_pylist())


def parts(store: Store, table: str = MODELS_TABLE) -> list[str]:
    return sorted(store.list_keys(f"_tables/{table}/"))


def compact(store: Store, **kw: Any) -> list[str]:
    result = compact_store(CompactSettings(results="unused", **kw), store)
    return result.lines


def test_per_model_files_only_become_parts_with_the_same_numbers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    models = [done(f"m{i}", "LlamaForCausalLM" if i % 2 else "BertModel", alpha=i)
              for i in range(6)]
    files(store, models)
    lines = compact(store)
    assert lines[0].startswith("add: models no part holds: 6 model(s) written as 2 part(s)")
    assert [p.split("/")[2] for p in parts(store)] == ["arch=BertModel", "arch=LlamaForCausalLM"]
    assert [k for k, _ in models_of(store)] == [f"m{i}" for i in range(6)]
    got: dict[str, list[tuple[int, float]]] = {}
    for batch in Tables(store).layers(["model_key", "layer_index", "alpha"], fallback=False):
        for r in batch.to_pylist():
            got.setdefault(r["model_key"], []).append((r["layer_index"], r["alpha"]))
    for d in models:
        data = store.get_bytes(f"{d.marker.model_key}/layers.csv")
        assert data is not None
        csv = layers_from_csv(data)
        assert sorted(got[d.marker.model_key]) == [(i, float(row["alpha"]))
                                                   for i, row in enumerate(csv)]
    assert lines[-1].startswith("compact: parts 0 → 2, models added 6")
    # A second compact has nothing to do.
    again = compact(store)
    assert again[0].startswith("add: models no part holds: 0 model(s)")
    assert again[1].startswith("merge: 0 small part(s)")


@pytest.mark.parametrize(("n_parts", "target", "expected_parts"), [
    (6, 1000, 1),  # all fit one part
    (6, 12, 2),  # 3 layer rows a part (small: below 6): 4 parts (12 rows), then 2
    (1, 1000, 1),  # a single small part whose rows all count: left alone
])
def test_small_parts_merged_no_model_lost_or_doubled(tmp_path: Path, n_parts: int, target: int,
                                                     expected_parts: int) -> None:
    store = LocalStore(tmp_path)
    for i in range(n_parts):
        write_parts(store, files(store, [done(f"m{i}", "GPT2LMHeadModel", alpha=i)]))
    before = set(parts(store)) | set(parts(store, LAYERS_TABLE))
    compact(store, target_rows=target)
    after = parts(store)
    assert len(after) == expected_parts
    assert len(parts(store, LAYERS_TABLE)) == expected_parts
    assert models_of(store) == [(f"m{i}", i + 1.0) for i in range(n_parts)]
    if n_parts > 1:  # the merged parts are gone
        assert not before & (set(after) | set(parts(store, LAYERS_TABLE)))
    rows = sum(b.num_rows for b in Tables(store).layers(["model_key"], fallback=False))
    assert rows == 3 * n_parts


def test_a_model_in_two_parts_keeps_only_its_newer_row(tmp_path: Path) -> None:
    """The row of an older analysis, in a part written later, does not agree with the
    model's files: compact leaves it out."""
    store = LocalStore(tmp_path)
    write_parts(store, files(store, [done("a", "X", "2026-01-02T00:00:00Z", alpha=7.0),
                                     done("b", "X")]))
    write_parts(store, [done("a", "X", "2026-01-01T00:00:00Z", alpha=1.0)])  # older, later
    compact(store)
    (only,) = parts(store)
    table = pa.concat_tables([pa.Table.from_batches(list(Tables(store).layers(
        ["model_key", "alpha"], fallback=False)))])
    assert models_of(store) == [("a", 8.0), ("b", 4.0)]
    assert sorted(zip(table.column("model_key").to_pylist(), table.column("alpha").to_pylist(),
                      strict=True)) == [("a", 7.0), ("a", 8.0), ("a", 9.0),
                                        ("b", 3.0), ("b", 4.0), ("b", 5.0)]
    assert "arch=X" in only


def test_rebuild_writes_every_model_anew_and_drops_the_old_parts(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    models = [done(f"m{i}", "X", alpha=i) for i in range(4)]
    files(store, models)
    compact(store)
    old = set(parts(store)) | set(parts(store, LAYERS_TABLE))
    expected = models_of(store)
    lines = compact(store, rebuild=True)
    assert lines[0].startswith("add: every done model: 4 model(s) written as 1 part(s)")
    assert models_of(store) == expected
    new = set(parts(store)) | set(parts(store, LAYERS_TABLE))
    assert len(new) == 2 and not old & new


@pytest.mark.parametrize("rebuild", [False, True])
def test_dry_run_writes_nothing(tmp_path: Path, rebuild: bool) -> None:
    store = LocalStore(tmp_path)
    files(store, [done("a", "X"), done("b", "Y")])
    for i in range(3):
        write_parts(store, files(store, [done(f"p{i}", "X")]))
    keys = sorted(store.list_keys())
    lines = compact(store, dry_run=True, rebuild=rebuild)
    assert sorted(store.list_keys()) == keys
    assert "would" in lines[0] and "dry run: nothing written" in lines[-1]
    if not rebuild:
        assert lines[:2] == [
            "add: models no part holds: 2 model(s) would be written as 2 part(s), 6 layer rows",
            "merge: 3 small part(s) in 1 partition(s) would be merged into 1 part(s), 9 layer "
            "rows"]


def test_orphan_layers_parts_old_ones_removed_young_ones_kept(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_parts(store, files(store, [done("a", "X")]))
    ((_, layers),) = part_tables([done("ghost", "X")]).values()
    old_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() - 7200)) + "-0a0a0a"
    for part_id in (old_id, new_part_id()):
        store.put_bytes(part_key(LAYERS_TABLE, "X", part_id), table_bytes(layers))
    lines = compact(store)
    left = parts(store, LAYERS_TABLE)
    assert len(left) == 2 and not any(old_id in k for k in left)
    assert lines[2].startswith("orphans: 1 layers part(s) without their models part")
    assert lines[2].endswith(" deleted")
    assert models_of(store) == [("a", 4.0)]


def test_command_line_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path)
    files(store, [done("a", "X")])
    assert main(["compact", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[-1].startswith("compact: parts 0 → 1, models added 1")
    assert models_of(store) == [("a", 4.0)]
    assert main(["compact", "--output-dir", str(tmp_path / "nowhere")]) == 2


def test_through_s3(s3_server: S3Server) -> None:
    store = make_store(s3_server)
    files(store, [done("a", "X"), done("b", "X", alpha=5.0)])
    write_parts(store, files(store, [done("c", "Y")]))
    write_parts(store, files(store, [done("d", "Y")]))
    compact(store)
    assert models_of(store) == [("a", 4.0), ("b", 6.0), ("c", 4.0), ("d", 4.0)]
    assert len(parts(store)) == 2 and len(parts(store, LAYERS_TABLE)) == 2
