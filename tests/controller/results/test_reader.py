"""Tests of controller.results.reader: tags, the ModelResult view of a marker, streaming tables,
and finding an adapter's base. Real results: tests.support.results.example_results."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from controller.errors import ResultsError
from controller.results import reader
from controller.results.reader import UNLABELLED, ModelResult
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.marker import BaseModelRef, Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import eigs_to_npz
from esd_worker.core.store.stores import LocalStore
from tests.support.results import copy_example, example_results, make_result


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    master = example_results(tmp_path_factory, gpt2_dir)
    return copy_example(master, tmp_path_factory.mktemp("reader") / "results")


def test_tables_stream_in_chunks(example: Path) -> None:
    """iter_results reads a few tables at a time and yields every model in the given order,
    so a report or refit of a large store holds one chunk of tables in memory."""
    store = open_store(str(example))
    markers = reader.read_model_markers(store)
    order = sorted(markers, reverse=True)
    got = list(reader.iter_results(store, markers, order, chunk=2))
    assert [r.key for r in got] == order
    assert all(r.rows for r in got)


@pytest.mark.parametrize(
    ("name", "short"),
    [
        pytest.param("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf", id="hub-id"),
        pytest.param("/data/models/org/name", "org/name", id="local-path"),
        pytest.param("org/" + "x" * 60, "…" + "x" * 47, id="long"),
    ],
)
def test_short_names(name: str, short: str) -> None:
    assert reader.short_name(name) == short


@pytest.mark.parametrize(
    ("tag", "table"),
    [
        pytest.param(None, "layers.csv", id="none"),
        pytest.param("", "layers.csv", id="empty"),
        pytest.param("refit-DKS-1e-05-100", "layers.refit-DKS-1e-05-100.csv", id="refit"),
    ],
)
def test_table_names(tag: str | None, table: str) -> None:
    assert reader.table_name(tag) == table


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "x y", "x" * 101])
def test_bad_tags_are_usage_errors(bad: str) -> None:
    """Tags come from flags: a bad one is a ResultsError (exit 2), not a LayoutError."""
    for call in (reader.check_tag, reader.table_name):
        with pytest.raises(ResultsError, match="invalid tag") as err:
            call(bad)
        assert err.value.exit_code == 2


@pytest.mark.parametrize(
    ("marker", "relation", "base_ref", "name"),
    [
        pytest.param({}, UNLABELLED, None, "org/m", id="unlabelled"),
        pytest.param({"relation": "FineTune", "revision": "v2"}, "finetune", None, "org/m@v2",
                     id="relation-lowercased-revision-kept"),
        pytest.param({"adapter": {"r": 8}, "base_model": BaseModelRef("org/base")}, "adapter",
                     "org/base", "org/m", id="adapter-without-relation"),
        pytest.param({"relation": "lora", "adapter": {"r": 8}}, "lora", None, "org/m",
                     id="adapter-with-relation"),
    ],
)
def test_model_result_reads_its_marker(
    marker: dict[str, object], relation: str, base_ref: str | None, name: str
) -> None:
    result = make_result([2.0], **marker)
    assert (result.relation, result.base_ref, result.name) == (relation, base_ref, name)


def test_model_id_falls_back_to_the_reference() -> None:
    """Markers of local paths have no model_id: the reference the worker was given stands in."""
    marker = Marker(model="/data/org/name", model_key="k")
    assert ModelResult("k", marker, []).model_id == "/data/org/name"


def _result(ref: str, base: str | None = None) -> ModelResult:
    marker = Marker(model=ref, model_key=model_key(ref),
                    base_model=None if base is None else BaseModelRef(base))
    return ModelResult(marker.model_key, marker, [])


def test_base_keys_pair_adapters_with_their_base() -> None:
    """By the exact reference first (a local path), then by the key a hub id would get; an
    adapter whose base is not among the results has none."""
    base, hub = _result("/models/gpt2"), _result("org/base@v1")
    by_path = _result("/models/lora", base="/models/gpt2")
    by_hub = _result("org/lora", base="org/base@v1")
    orphan = _result("org/other-lora", base="org/elsewhere")
    found = reader.base_keys([base, hub, by_path, by_hub, orphan])
    assert found == {by_path.key: base.key, by_hub.key: hub.key}


def test_read_eigs_falls_back_to_eigs_npz(tmp_path: Path) -> None:
    """A marker naming no eigenvalue file (written before `outputs` existed) still finds
    eigs.npz beside it; no file at all is None."""
    store = LocalStore(tmp_path)
    result = make_result([2.0])
    assert reader.read_eigs(store, result) is None
    store.put_bytes(f"{result.key}/eigs.npz", eigs_to_npz({"l0": np.arange(3.0)}))
    eigs = reader.read_eigs(store, result)
    assert eigs is not None and list(eigs["l0"]) == [0.0, 1.0, 2.0]


def test_refit_record_missing_or_unreadable_is_none(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert reader.read_refit_record(store, "t") is None
    store.put_bytes("refits/t.json", b"{oops")
    assert reader.read_refit_record(store, "t") is None
    store.put_bytes("refits/t.json", b'{"tag": "t"}')
    assert reader.read_refit_record(store, "t") == {"tag": "t"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1.5", 1.5), (2, 2.0), ("", float("nan")), (None, float("nan")), ("x", float("nan"))],
)
def test_number(value: object, expected: float) -> None:
    """Empty and unparsable cells are NaN, so statistics can skip them."""
    np.testing.assert_equal(reader.number(value), expected)
