"""The results tables never outrank the markers, and no reader trusts a part it did not check
(controller.results.tables): a row counts only while its model's marker and sealed files are
listed at the sizes it recorded; the same rows twice count once; a part that cannot be read
or is not of the schema is left out with one line (its models read from their own files) and
`compact` sets it aside and rebuilds them; a forged model_key in a part is left out. Each
case runs on a folder store and on S3 (moto over HTTP), through the readers people use:
the tables, `esd_sweep.load()`, `esd-sweep report`, summary.csv and `compact`.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import esd_sweep
from controller.results import tables as tables_module
from controller.results.compact import CompactSettings, aside_key, compact_store
from controller.results.report import ReportSettings, write_report
from controller.results.summary import write_summary
from controller.results.tables import Tables
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import marker_key, model_file_key
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import (
    LAYERS_TABLE,
    MODELS_TABLE,
    DoneModel,
    PartKey,
    part_tables,
    write_part,
    write_parts,
)
from tests.support.results import analysed
from tests.support.s3server import STORE_KINDS, S3Server, serve_s3, store_url

NAMES = ("a", "b", "c")
KEY = {name: model_key(f"org/{name}") for name in (*NAMES, "ghost", "x")}
KEYS = sorted(KEY[n] for n in NAMES)


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=STORE_KINDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request, tmp_path)


def done(name: str, alpha: float = 3.0, finished: str = "2026-01-01T00:00:00Z") -> DoneModel:
    marker = Marker(model=f"org/{name}", model_key=KEY[name], model_id=f"org/{name}",
                    architecture="LlamaForCausalLM", finished_at=finished,
                    timings={"total_s": 1}, parameters={"evals_thresh": 1e-5})
    rows = [{"layer": f"h.{i}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": alpha + i,
             "status": "ok"} for i in range(2)]
    return DoneModel(marker, rows)


def sweep(url: str) -> tuple[Store, list[DoneModel]]:
    """a, b, c analysed (their own files) and in one results-table part, as a worker leaves
    them."""
    store = open_store(url)
    models = analysed(store, [done(n, alpha=2.0 + i) for i, n in enumerate(NAMES)])
    write_parts(store, models)
    return store, models


def counted(store: Store) -> list[str]:
    """The model keys a reader counts, each time it is met (a model twice shows twice)."""
    return sorted(k for b in Tables(store).models(["model_key"]) for k in
                  b.column(0).to_pylist())


def everyone_counts(store: Store, url: str, expected: list[str], tmp_path: Path, *,
                    summary: bool = False) -> None:
    """The tables, load() and the report (and with `summary`, the run's summary step, which
    takes the tables' rows of the listed models) all count exactly `expected`."""
    assert counted(store) == expected
    layers = sorted(k for b in Tables(store).layers(["model_key"]) for k in
                    b.column(0).to_pylist())
    assert layers == sorted(k for k in expected for _ in range(2))
    assert sorted(esd_sweep.load(url).models()["model_key"]) == expected
    report = write_report(ReportSettings(results=url, out=str(tmp_path / "site"),
                                         max_model_plots=0))
    assert report.models == len(expected)
    assert f"{len(expected)} models" in (tmp_path / "site" / "index.html").read_text()
    if not summary:
        return
    rows = [ModelRow(f"org/{n}", None, "", None, line=i) for i, n in enumerate(NAMES)]
    assert write_summary(store, rows, parameters={"evals_thresh": 1e-5}) == len(expected)


# --- rows the markers do not vouch for ---------------------------------------------------------


def delete_marker(store: Store) -> None:
    store.delete(marker_key(KEY["b"]))


def unreadable_marker(store: Store) -> None:
    store.put_bytes(marker_key(KEY["b"]), b'{"schema": 1, "model_key": "b", "trunc')


def truncated_table(store: Store) -> None:
    data = store.get_bytes(model_file_key(KEY["b"], "layers.csv"))
    assert data is not None
    store.put_bytes(model_file_key(KEY["b"], "layers.csv"), data[:-10])


def ghost(store: Store) -> None:
    """A part names a model the store does not hold at all (no folder)."""
    write_parts(store, [done("ghost")])


def forged_key(store: Store) -> None:
    """A part row whose model_key would name a file outside the store."""
    bad = done("x")
    ((models, layers),) = part_tables([bad]).values()
    models = models.set_column(0, "model_key", pa.array(["../../../tmp/x"]))
    layers = layers.set_column(0, "model_key", pa.array(["../../../tmp/x"] * 2))
    write_part(store, "LlamaForCausalLM", models, layers)


def reanalysed_unflushed(store: Store) -> None:
    """b analysed again (other numbers, its files rewritten) by a worker killed before it
    wrote its part: the old row no longer agrees with b's marker, which is read instead."""
    analysed(store, [done("b", alpha=9.0, finished="2026-02-01T00:00:00Z")])


@pytest.mark.parametrize(("damage", "expected"), [
    pytest.param(delete_marker, ["a", "c"], id="marker-deleted"),
    pytest.param(unreadable_marker, ["a", "c"], id="marker-unreadable"),
    pytest.param(truncated_table, ["a", "c"], id="table-truncated"),
    pytest.param(ghost, NAMES, id="ghost-in-a-part"),
    pytest.param(forged_key, NAMES, id="forged-model-key"),
    pytest.param(reanalysed_unflushed, NAMES, id="marker-rewritten"),
])
def test_a_row_counts_only_while_its_marker_and_files_agree(
        url: str, tmp_path: Path, damage: Callable[[Store], None],
        expected: list[str]) -> None:
    """What `status` says is not done is not counted by any reader either; the report goes
    on past a forged row."""
    store, _ = sweep(url)
    damage(store)
    everyone_counts(store, url, sorted(KEY[n] for n in expected), tmp_path)


def test_a_rewritten_marker_is_read_with_its_own_numbers(url: str) -> None:
    """The row of b's earlier analysis does not count: b's numbers are its marker's."""
    store, _ = sweep(url)
    reanalysed_unflushed(store)
    frame = esd_sweep.load(url).models(["model_key", "alpha_mean"])
    assert dict(zip(frame["model_key"], frame["alpha_mean"], strict=True))[KEY["b"]] == 9.5


def test_the_same_rows_twice_in_a_part_count_once(url: str, tmp_path: Path) -> None:
    """A part holding every row twice (and a second part with one of them again): each model
    once, its layers once; compact writes one row each."""
    store, models = sweep(url)
    ((m, ly),) = part_tables(models).values()
    write_part(store, "LlamaForCausalLM", pa.concat_tables([m, m]), pa.concat_tables([ly, ly]))
    everyone_counts(store, url, KEYS, tmp_path, summary=True)
    compact_store(CompactSettings(results=url), store)
    raw = [k for key in store.list_keys("_tables/models/")
           for k in pq.read_table(io.BytesIO(store.get_bytes(key) or b"")
                                  ).column("model_key").to_pylist()]
    assert sorted(raw) == KEYS


# --- parts that cannot be read ---------------------------------------------------------------


def _first_part(store: Store, table: str) -> str:
    return next(k for k in store.list_keys(f"_tables/{table}/") if k.endswith(".parquet"))


def _rewrite(table: str, make: Callable[[bytes], bytes]) -> Callable[[Store], None]:
    def damage(store: Store) -> None:
        key = _first_part(store, table)
        store.put_bytes(key, make(store.get_bytes(key) or b""))
    return damage


def _foreign(columns: dict[str, pa.Array]) -> Callable[[bytes], bytes]:
    def make(_: bytes) -> bytes:
        buf = io.BytesIO()
        pq.write_table(pa.table(columns) if columns else pa.table({}), buf)
        return buf.getvalue()
    return make


@pytest.mark.parametrize("damage", [
    pytest.param(_rewrite(MODELS_TABLE, lambda d: d[:len(d) // 2]), id="models-truncated"),
    pytest.param(_rewrite(LAYERS_TABLE, lambda d: d[:len(d) // 2]), id="layers-truncated"),
    pytest.param(_rewrite(MODELS_TABLE, lambda d: bytes(len(d))), id="same-size-garbage"),
    pytest.param(_rewrite(LAYERS_TABLE, lambda d: b""), id="layers-empty"),
    pytest.param(_rewrite(MODELS_TABLE, _foreign({"model_key": pa.array([1, 2, 3])})),
                 id="int-model-key"),
    pytest.param(_rewrite(MODELS_TABLE, _foreign({
        "model_key": pa.array(KEYS), "alpha_mean": pa.array(["2", "3", "4"])})),
        id="text-numbers"),
    pytest.param(_rewrite(LAYERS_TABLE, _foreign({})), id="no-columns"),
])
def test_a_part_that_cannot_be_read_is_left_out_and_compact_sets_it_aside(
        url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        damage: Callable[[Store], None]) -> None:
    """Every reader goes on: one line names the part and `esd-sweep compact`, the models are
    read from their own files; compact moves the pair aside (nothing deleted) and rebuilds
    its models, after which the tables hold every model again and no line is logged."""
    store, _ = sweep(url)
    damage(store)
    models_key = _first_part(store, MODELS_TABLE)
    layers_key = _first_part(store, LAYERS_TABLE)
    caplog.set_level(logging.WARNING, logger="controller.results.tables")
    everyone_counts(store, url, KEYS, tmp_path, summary=True)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert lines and all("esd-sweep compact" in line for line in lines)
    assert any(models_key.rsplit("/", 1)[-1] in line for line in lines)

    result = compact_store(CompactSettings(results=url), store)
    assert result.set_aside == 1
    for key in (models_key, layers_key):
        part = PartKey(*key.removeprefix("_tables/").removesuffix(".parquet")
                       .replace("arch=", "").split("/"))
        assert store.get_bytes(key) is None and store.get_bytes(aside_key(part)) is not None
    caplog.clear()
    assert counted(store) == KEYS
    assert sorted(k for b in Tables(store).models(["model_key"], fallback=False)
                  for k in b.column(0).to_pylist()) == KEYS
    assert not [r for r in caplog.records if "left out" in r.getMessage()]


def test_a_models_part_without_its_layers_part_is_left_out(url: str) -> None:
    """Its rows would count without layers: its models come from their own files."""
    store, _ = sweep(url)
    store.delete(_first_part(store, LAYERS_TABLE))
    assert sorted(k for b in Tables(store).layers(["model_key"]) for k in
                  b.column(0).to_pylist()) == sorted(KEYS * 2)


def test_a_part_of_an_older_version_without_files_still_counts(url: str) -> None:
    """Parts written before rows recorded their files: counted while the marker and layers.csv
    are there."""
    store, models = sweep(url)
    for key in list(store.list_keys("_tables/")):
        store.delete(key)
    ((m, ly),) = part_tables(models).values()
    write_part(store, "LlamaForCausalLM", m.drop_columns(["files"]), ly)
    assert sorted(k for b in Tables(store).models(["model_key"], fallback=False)
                  for k in b.column(0).to_pylist()) == KEYS
    store.delete(marker_key(KEY["b"]))
    assert counted(store) == [KEY["a"], KEY["c"]]


# --- the tables agree with themselves, whatever the order and whatever happens meanwhile -------


def agree(tables: Tables) -> list[str]:
    """Each model models() yields has exactly its 2 layer rows in layers(), asked in either
    order and again; the sorted models."""
    layers_first = sorted(k for b in tables.layers(["model_key"]) for k in b.column(0).to_pylist())
    models = sorted(k for b in tables.models(["model_key"]) for k in b.column(0).to_pylist())
    layers = sorted(k for b in tables.layers(["model_key"]) for k in b.column(0).to_pylist())
    assert layers_first == layers == sorted(models * 2)
    return models


@pytest.mark.parametrize("damage", [
    pytest.param(_rewrite(LAYERS_TABLE, lambda d: b"garbage"), id="garbage-layers-part"),
    pytest.param(_rewrite(LAYERS_TABLE, lambda d: d + bytes(2_000_000)), id="over-its-bound"),
])
def test_a_layers_part_left_out_after_its_models_counted(
        url: str, monkeypatch: pytest.MonkeyPatch, damage: Callable[[Store], None]) -> None:
    """models() and layers() agree whichever runs first, and compact sets the part aside
    whether the store refused it (over PART_BYTES, here 1 MB) or pyarrow could not read it."""
    monkeypatch.setattr(tables_module, "PART_BYTES", 1_000_000)
    store, _ = sweep(url)
    damage(store)
    assert agree(Tables(store)) == KEYS
    assert compact_store(CompactSettings(results=url), store).set_aside == 1
    assert agree(Tables(store)) == KEYS


def test_a_fifo_for_a_layers_part_is_left_out_and_set_aside(tmp_path: Path) -> None:
    store, _ = sweep(str(tmp_path / "results"))
    key = _first_part(store, LAYERS_TABLE)
    (tmp_path / "results" / key).unlink()
    os.mkfifo(tmp_path / "results" / key)
    assert agree(Tables(store)) == KEYS
    assert compact_store(CompactSettings(results=str(tmp_path / "results")),
                         store).set_aside == 1
    assert agree(Tables(store)) == KEYS


def test_a_reader_goes_on_while_compact_merges_the_parts_it_counted(url: str) -> None:
    """compact takes no lease: the parts a reader counted may be merged away before it
    reads them; their models come from their own files, none lost, none twice."""
    store = open_store(url)
    for name in NAMES:
        write_parts(store, analysed(store, [done(name)]))
    reader = Tables(store)
    reader.newest()
    compact_store(CompactSettings(results=url), store)
    assert agree(reader) == KEYS


def test_a_stale_and_a_current_row_of_one_model_in_one_part(url: str) -> None:
    """The row the model's files vouch for counts, the stale one beside it does not."""
    store = open_store(url)
    # alpha 12 vs 5: files of other sizes (a same-size rewrite is invisible to a listing)
    (stale,) = analysed(store, [done("a", alpha=12.0, finished="2026-01-01T00:00:00Z")])
    current = analysed(store, [done("a", alpha=5.0, finished="2026-02-01T00:00:00Z"),
                               done("b"), done("c")])
    ((m, ly),) = part_tables([stale, *current]).values()
    write_part(store, "LlamaForCausalLM", m, ly)
    tables = Tables(store)
    assert agree(tables) == KEYS
    frame = {r["model_key"]: r["alpha_mean"] for b in tables.models(["model_key", "alpha_mean"])
             for r in b.to_pylist()}
    assert frame[KEY["a"]] == 5.5


def test_layer_rows_of_a_model_the_part_does_not_count_are_left_out(url: str) -> None:
    """A layers part holding rows of a model its models part does not hold (and of none)."""
    store, models = sweep(url)
    ((m, ly),) = part_tables(models).values()
    ((_, ghost),) = part_tables([done("ghost")]).values()
    nameless = ghost.set_column(0, "model_key", pa.nulls(ghost.num_rows, pa.string()))
    for key in list(store.list_keys("_tables/")):
        store.delete(key)
    write_part(store, "LlamaForCausalLM", m, pa.concat_tables([ly, ghost, nameless]))
    assert agree(Tables(store)) == KEYS
