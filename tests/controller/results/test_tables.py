"""The results tables read back (controller.results.tables): each model once (the row its
files vouch for, its layers those of the same part), partitions pruned, the per-model
fallback, a part gone since the listing, and the same through S3 (moto over HTTP). What a
row must agree with, and parts that cannot be read: test_tables_truth.py."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from controller.results.tables import Tables, read_done_models
from esd_worker.core.store.layout import write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import layers_to_csv
from esd_worker.core.store.stores import LocalStore, Store
from esd_worker.core.store.tables import (
    LAYERS_TABLE,
    MODELS_TABLE,
    DoneModel,
    arch_partition,
    family_of,
    parse_part_key,
    part_key,
    part_tables,
    write_part,
    write_parts,
)
from tests.support.results import CountingStore
from tests.support.results import analysed as write_analysed
from tests.support.s3server import S3Server, make_store, serve_s3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def done(key: str, arch: str | None, finished: str, alphas: list[float]) -> DoneModel:
    marker = Marker(model=f"org/{key}", model_key=key, model_id=f"org/{key}",
                    architecture=arch, finished_at=finished, timings={"total_s": 12},
                    relation="finetune" if key.startswith("ft") else "")
    rows = [{"layer": f"h.{i}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": a,
             "status": "ok"} for i, a in enumerate(alphas)]
    return DoneModel(marker, rows)


def analysed(store: Store, *dones: DoneModel) -> list[DoneModel]:
    return write_analysed(store, dones)


def rows(batches: Iterator[pa.RecordBatch]) -> list[dict[str, object]]:
    return [row for batch in batches for row in batch.to_pylist()]




def test_each_model_once_its_newest_row_and_that_rows_layers(tmp_path: Path) -> None:
    """A model in three parts (analysed three times) counts once, with the row of the
    analysis its files hold now (the last written) and only that part's layers; the rows of
    the earlier analyses no longer agree with its marker and count for nothing."""
    store = LocalStore(tmp_path)
    write_parts(store, analysed(store, done("a", "LlamaForCausalLM", "2026-01-01", [2.0]),
                                done("b", "LlamaForCausalLM", "2026-01-01", [3.0])))
    write_parts(store, analysed(store, done("a", "LlamaForCausalLM", "2026-01-02", [4.0, 4.0])))
    write_parts(store, analysed(store, done("a", "LlamaForCausalLM", "2026-01-03",
                                            [5.0, 5.0, 5.0])))
    tables = Tables(store)
    models = {r["model_key"]: r for r in rows(tables.models(["model_key", "alpha_mean",
                                                              "layers"]))}
    assert models == {"a": {"model_key": "a", "alpha_mean": 5.0, "layers": 3},
                      "b": {"model_key": "b", "alpha_mean": 3.0, "layers": 1}}
    layers = rows(tables.layers(["model_key", "alpha", "layer_index"]))
    assert sorted((r["model_key"], r["layer_index"], r["alpha"]) for r in layers) == [
        ("a", 0, 5.0), ("a", 1, 5.0), ("a", 2, 5.0), ("b", 0, 3.0)]
    assert tables.newest().rows == 4 and len(tables.newest().keys) == 2


def test_partitions_pruned_by_architecture(tmp_path: Path) -> None:
    """Tables(archs=…) reads only those partitions' parts; names become safe partitions."""
    store = CountingStore(tmp_path)
    write_parts(store, analysed(store, done("l", "LlamaForCausalLM", "t", [3.0]),
                                done("g", "GPT2LMHeadModel", "t", [4.0]),
                                done("u", None, "t", [2.5]),
                                done("w", "Weird/Arch Name", "t", [2.0])))
    assert {p.arch for p in Tables(store).parts(MODELS_TABLE)} == {
        "LlamaForCausalLM", "GPT2LMHeadModel", "unknown", "Weird_Arch_Name"}
    store.got.clear()
    only = Tables(store, archs={"GPT2LMHeadModel"})
    assert [r["model_key"] for r in rows(only.models(["model_key"], fallback=False))] == ["g"]
    assert store.got and all("arch=GPT2LMHeadModel/" in key for key in store.got)


@pytest.mark.parametrize(("architecture", "family"), [
    ("LlamaForCausalLM", "llama"), ("GPT2LMHeadModel", "gpt2"), ("BertModel", "bert"),
    ("Qwen2ForSequenceClassification", "qwen2"), ("T5EncoderModel", "t5encoder"),
    (None, "unknown"), ("", "unknown"),
])
def test_family_of_architecture(architecture: str | None, family: str) -> None:
    assert family_of(architecture) == family


@pytest.mark.parametrize(("key", "parsed"), [
    ("_tables/models/arch=Llama/20261126T000000Z-ab.parquet", ("models", "Llama",
                                                               "20261126T000000Z-ab")),
    ("_tables/layers/arch=unknown/x.parquet", ("layers", "unknown", "x")),
    ("_tables/models/arch=Llama/.x.parquet.tmp", None),
    ("_tables/other/arch=Llama/x.parquet", None),
    ("_tables/models/Llama/x.parquet", None),
    ("m/result.json", None),
])
def test_part_keys(key: str, parsed: tuple[str, str, str] | None) -> None:
    part = parse_part_key(key)
    assert (None if part is None else (part.table, part.arch, part.part_id)) == parsed
    if part is not None:
        assert part.key == key == part_key(part.table, part.arch, part.part_id)


def test_orphan_layers_part_is_not_read(tmp_path: Path) -> None:
    """A layers part without its models part (a worker killed between the two writes)."""
    store = LocalStore(tmp_path)
    write_parts(store, analysed(store, done("a", "X", "t", [3.0])))
    (orphan,) = analysed(store, done("b", "X", "t", [7.0, 7.0]))
    ((models, layers),) = part_tables([orphan]).values()
    store.put_bytes(part_key(LAYERS_TABLE, "X", "orphan"), _parquet(layers))
    tables = Tables(store)
    assert [r["model_key"] for r in rows(tables.layers(["model_key"], fallback=False))] == ["a"]
    assert len(tables.parts(LAYERS_TABLE)) == 1 and models.num_rows == 1


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_models_no_part_holds_come_from_their_files(tmp_path: Path) -> None:
    """Per-model files only (a store from before the tables, or a worker's unflushed
    models): missing_keys lists them, models() and layers() read them from their marker and
    layers.csv, with the same rows a part would hold; a model in both is read once."""
    store = LocalStore(tmp_path)
    for d in (done("a", "X", "2026-01-01", [3.0, 4.0]), done("b", "Y", "2026-01-01", [2.0])):
        write_model_result(store, d.marker, layers=layers_to_csv(d.layers))
    write_parts(store, read_done_models(store, ["a"]))
    tables = Tables(store)
    assert list(tables.missing_keys()) == ["b"]
    models = rows(tables.models(["model_key", "alpha_mean", "family", "num_params"]))
    assert sorted(models, key=lambda r: str(r["model_key"])) == [
        {"model_key": "a", "alpha_mean": 3.5, "family": "x", "num_params": 256},
        {"model_key": "b", "alpha_mean": 2.0, "family": "y", "num_params": 128}]
    layer_keys = sorted(str(r["model_key"]) for r in rows(tables.layers(["model_key"])))
    assert layer_keys == ["a", "a", "b"]
    assert rows(tables.models(["model_key"], fallback=False)) == [{"model_key": "a"}]


def test_a_part_gone_since_the_listing_is_skipped(tmp_path: Path) -> None:
    """compact merged a part away between the listing and the read: no error, its rows are
    in the merged part."""
    store = LocalStore(tmp_path)
    (a,) = analysed(store, done("a", "X", "t", [3.0]))
    write_parts(store, [a])
    tables = Tables(store)
    parts = list(tables.parts(MODELS_TABLE))
    ((models, layers),) = part_tables([a]).values()
    merged = write_part(store, "X", models, layers)
    store.delete(parts[0].key)
    assert rows(tables.models(["model_key"], fallback=False)) == []  # listed before the merge
    assert rows(Tables(store).models(["model_key"], fallback=False)) == [{"model_key": "a"}]
    assert merged.arch == arch_partition("X")


def test_tables_through_s3(s3_server: S3Server) -> None:
    """The same reading through the S3 store (moto over HTTP): parts listed, newest row."""
    store: Store = make_store(s3_server)
    write_parts(store, analysed(store, done("a", "X", "2026-01-01", [2.0]),
                                done("b", "Y", "2026-01-01", [3.0])))
    write_parts(store, analysed(store, done("a", "X", "2026-01-02", [6.0])))
    tables = Tables(store, threads=4)
    assert len(tables.parts(MODELS_TABLE)) == 3
    got = {r["model_key"]: r["alpha_mean"] for r in rows(tables.models(["model_key",
                                                                        "alpha_mean"]))}
    assert got == {"a": 6.0, "b": 3.0}
