"""Tests of esd_worker.core.store.layout: store keys, the typed marker (JSON round trip, schema
check) and
marker-last writing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.errors import StoreError
from esd_worker.core.store.layout import (
    EIGS_NAME,
    LayoutError,
    check_files,
    failure_key,
    is_tag,
    layers_name,
    list_failure_keys,
    list_markers,
    marker_key,
    model_file_key,
    read_marker,
    read_markers,
    refit_record_key,
    run_report_key,
    summary_key,
    write_model_result,
)
from esd_worker.core.store.marker import (
    MARKER_SCHEMA,
    BaseModelRef,
    DamagedResult,
    FileSeal,
    Marker,
    MarkerError,
    canonical_parameters,
    check_data,
)
from esd_worker.core.store.stores import LocalStore


@pytest.mark.parametrize("bad", ["", "a/b", "..", "."])
def test_failure_key_rejects_unsafe_keys(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid model key"):
        failure_key(bad)


# --- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param(lambda: marker_key("m-0123456789"), "m-0123456789/result.json", id="marker"),
        pytest.param(lambda: failure_key("m-0123456789"), "_failures/m-0123456789.json",
                     id="failure"),
        pytest.param(lambda: layers_name(), "layers.csv", id="layers"),
        pytest.param(lambda: layers_name("dks"), "layers.dks.csv", id="layers-tag"),
        pytest.param(lambda: summary_key(), "summary.csv", id="summary"),
        pytest.param(lambda: summary_key("dks"), "summary.dks.csv", id="summary-tag"),
        pytest.param(lambda: refit_record_key("dks"), "refits/dks.json", id="refit-record"),
        pytest.param(lambda: run_report_key("20261123T070501Z-abcdef"),
                     "runs/20261123T070501Z-abcdef.json", id="run-report"),
        pytest.param(lambda: model_file_key("m", EIGS_NAME), "m/eigs.npz", id="eigs"),
    ],
)
def test_keys_are_the_documented_layout(key: Callable[[], str], expected: str) -> None:
    """The layout users script against (docs/design.md, "Store layout")."""
    assert key() == expected


@pytest.mark.parametrize("bad", ["a b", "../x", "-x", "x" * 101, "a/b"])
def test_bad_tags_have_no_place_in_the_layout(bad: str) -> None:
    assert not is_tag(bad)
    with pytest.raises(LayoutError, match="invalid tag"):
        layers_name(bad)
    with pytest.raises(LayoutError, match="invalid tag"):
        summary_key(bad)


def test_list_markers_finds_only_model_markers(store: LocalStore) -> None:
    store.put_bytes(marker_key("a"), make_marker("a").to_json())
    store.put_bytes("b/layers.csv", b"")
    store.put_bytes("runs/x/result.json", b"{}")  # too deep: not a model marker
    store.put_bytes("result.json", b"{}")  # at the root: not a model marker
    store.put_bytes("_failures/k.json", b"{}")
    assert list_markers(store) == {"a"}
    assert list_failure_keys(store) == {"k": "_failures/k.json"}


# --- the marker -------------------------------------------------------------------------------


def make_marker(key: str = "org--m-0123456789", **kw: Any) -> Marker:
    fields: dict[str, Any] = {
        "model": "org/m", "model_key": key, "model_id": "org/m",
        "parameters": canonical_parameters(AnalysisSettings().as_dict()),
        "relation": "lora", "base_model": BaseModelRef("org/base", "a" * 40, "hub"),
        "summary": {"layers": 3, "alpha_mean": 3.5}, "eigs_name": EIGS_NAME,
        "timings": {"total_s": 1.25}, "device": {"type": "cpu", "name": "x86_64"},
        "finished_at": "2026-11-23T07:05:01+00:00",
    }
    fields.update(kw)
    return Marker(**fields)


def test_marker_round_trips_through_json() -> None:
    marker = make_marker()
    assert Marker.from_json(marker.to_json()) == marker
    assert marker.total_s == 1.25


def test_marker_json_is_the_documented_document() -> None:
    """result.json as users read it: sorted keys, outputs nested, base_model an object."""
    doc = json.loads(make_marker().to_json())
    assert list(doc) == sorted(doc)
    assert doc["schema"] == MARKER_SCHEMA
    assert doc["outputs"] == {"layers": "layers.csv", "eigs": "eigs.npz"}
    assert doc["base_model"] == {"model": "org/base", "resolved_revision": "a" * 40,
                                 "source": "hub"}


def test_marker_parameters_compare_as_stored() -> None:
    """Tuples in the settings become lists in JSON: a round trip still matches."""
    params = AnalysisSettings().as_dict()
    marker = Marker.from_json(make_marker(parameters=canonical_parameters(params)).to_json())
    assert marker.parameters == canonical_parameters(params)
    assert marker.parameters != canonical_parameters({**params, "fix_fingers": "DKS"})


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        pytest.param(b"[]", "not a JSON object", id="not-object"),
        pytest.param(b"{", "not JSON", id="not-json"),
        pytest.param(b'{"model": "m", "model_key": "k"}', "schema must be an integer",
                     id="no-schema"),
        pytest.param(b'{"schema": 2, "model": "m", "model_key": "k"}', "newer", id="newer"),
        pytest.param(b'{"schema": 0, "model": "m", "model_key": "k"}', "schema 0", id="zero"),
        pytest.param(b'{"schema": true, "model": "m", "model_key": "k"}', "integer",
                     id="bool-schema"),
        pytest.param(b'{"schema": 1, "model_key": "k"}', "lacks 'model'", id="no-model"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": null}', "must not be null",
                     id="null-key"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "layer_count": "3"}',
                     "layer_count must be int", id="bad-type"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "base_model": {}}',
                     "lacks 'base_model.model'", id="base-without-model"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"outputs": {"layers": "../../x"}}', "outputs.layers is not a file name",
                     id="table-a-path"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"outputs": {"eigs": ""}}', "outputs.eigs is not a file name",
                     id="eigs-empty"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"files": {"a/b": {"size": 1, "sha256": "x"}}}', "is not a file name",
                     id="seal-a-path"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "layer_count": -1}',
                     "layer_count must be >= 0", id="negative-count"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "layer_count": NaN}',
                     "NaN is not a JSON number", id="nan"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "layer_count": 1e999}',
                     "'1e999' is not a finite number", id="1e999"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", "layer_count": '
                     + b"9" * 5000 + b"}", "not JSON", id="5000-digits"),
        pytest.param(b'{"schema": 1, "adapter": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     "nested too deep", id="nested"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"status_counts": {"ok": 1.5}}', "status_counts.'ok' must be a count",
                     id="count-not-whole"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"summary": {"alpha_mean": "3"}}', "summary.'alpha_mean' must be a number",
                     id="summary-a-string"),
        pytest.param(b'{"schema": 1, "model": "m", "model_key": "k", '
                     b'"timings": {"total_s": true}}', "timings.'total_s' must be a number",
                     id="timing-a-bool"),
    ],
)
def test_marker_refuses_what_it_cannot_read(doc: bytes, problem: str) -> None:
    """Each is no marker a worker writes: a name that is a path would be read outside the
    model's folder, NaN and 1e999 have no JSON form (to_json refuses them), a number of
    5000 digits or a nesting 100,000 deep would end the reader with ValueError or
    RecursionError, and the summary and timings go into summary.csv as numbers."""
    with pytest.raises(MarkerError, match=re.escape(problem)):
        Marker.from_json(doc)


def test_a_marker_of_another_folder_is_not_this_folders(
    store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A marker copied (or forged) into folder `b` still says `a`: its names would lead to
    a's files, so `b` has no readable marker (and runs again)."""
    store.put_bytes(marker_key("b"), make_marker("a").to_json())
    with caplog.at_level(logging.WARNING, logger="esd_worker.core.store.layout"):
        assert read_marker(store, "b") is None
    assert "its model_key 'a' is not its folder's" in caplog.text


def test_marker_ignores_keys_it_does_not_know() -> None:
    marker = Marker.from_json(b'{"schema": 1, "model": "m", "model_key": "k", "later": 1}')
    assert (marker.model, marker.model_key, dict(marker.parameters)) == ("m", "k", {})


def test_read_markers_reads_missing_and_corrupt_as_none(
    store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.put_bytes(marker_key("a"), make_marker("a").to_json())
    store.put_bytes(marker_key("b"), b"{broken")
    with caplog.at_level(logging.WARNING, logger="esd_worker.core.store.layout"):
        markers = read_markers(store, ["a", "b", "c", "a"], threads=2)
    assert list(markers) == ["a", "b", "c"]
    assert markers["a"] == make_marker("a") == read_marker(store, "a")
    assert markers["b"] is None and markers["c"] is None
    assert "model_key=b" in caplog.text


# --- marker last -------------------------------------------------------------------------------


class RecordingStore(LocalStore):
    """A LocalStore that records the order of writes and deletes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ops: list[str] = []

    def put_bytes(self, key: str, data: bytes) -> None:
        self.ops.append(f"put {key}")
        super().put_bytes(key, data)

    def delete(self, key: str) -> None:
        self.ops.append(f"delete {key}")
        super().delete(key)


def test_write_model_result_writes_the_marker_last(tmp_path: Path) -> None:
    """An old marker goes first, the new one last: a crash in between leaves no marker
    vouching for half-written files."""
    store = RecordingStore(tmp_path)
    marker = make_marker("k")
    stamped = write_model_result(
        store, marker, layers=b"layers", eigs=b"eigs",
        finish=lambda m: dataclasses.replace(m, finished_at="later"),
    )
    assert store.ops == ["delete k/result.json", "put k/layers.csv", "put k/eigs.npz",
                         "put k/result.json"]
    assert stamped.finished_at == "later"
    assert read_marker(store, "k") == stamped


def test_write_model_result_without_eigs(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path)
    write_model_result(store, make_marker("k", eigs_name=None), layers=b"layers")
    assert store.ops == ["delete k/result.json", "put k/layers.csv", "put k/result.json"]


def test_write_model_result_refuses_eigs_the_marker_does_not_name(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path)
    with pytest.raises(ValueError, match="both or neither"):
        write_model_result(store, make_marker("k", eigs_name=None), layers=b"x", eigs=b"y")
    assert store.ops == []


class FailingStore(RecordingStore):
    def put_bytes(self, key: str, data: bytes) -> None:
        if key.endswith(EIGS_NAME):
            raise StoreError("disk full")
        super().put_bytes(key, data)


def test_a_failed_write_leaves_no_marker(tmp_path: Path) -> None:
    store = FailingStore(tmp_path)
    store.put_bytes(marker_key("k"), make_marker("k").to_json())  # an older result
    with pytest.raises(StoreError):
        write_model_result(store, make_marker("k"), layers=b"x", eigs=b"y")
    assert read_marker(store, "k") is None


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


# --- seals: the marker vouches for the files it names ------------------------------------------


def sealed_result(store: LocalStore) -> Marker:
    marker = Marker(model="org/m", model_key="m", eigs_name=EIGS_NAME)
    return write_model_result(store, marker, layers=b"layer,alpha\nl0,3.0\n", eigs=b"E" * 10)


def test_write_model_result_seals_the_files_it_writes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    written = sealed_result(store)
    assert written.files == {
        "layers.csv": FileSeal(19, hashlib.sha256(b"layer,alpha\nl0,3.0\n").hexdigest()),
        "eigs.npz": FileSeal(10, hashlib.sha256(b"E" * 10).hexdigest()),
    }
    stored = read_marker(store, "m")
    assert stored is not None and stored.files == written.files
    assert json.loads(store.get_bytes("m/result.json") or b"")["files"]["eigs.npz"] == {
        "size": 10, "sha256": FileSeal.of(b"E" * 10).sha256}


@pytest.mark.parametrize(("change", "problem"), [
    (None, None),
    (lambda s: s.delete("m/layers.csv"), "layers.csv is missing"),
    (lambda s: s.delete("m/eigs.npz"), "eigs.npz is missing"),
    (lambda s: s.put_bytes("m/layers.csv", b"layer,alpha\n"), "layers.csv has 12 bytes, its "
                                                               "marker says 19"),
    (lambda s: s.put_bytes("m/eigs.npz", b"F" * 10), None),  # same size: only a read tells
    (lambda s: s.put_bytes("m/layers.extra.csv", b"x"), None),  # a refit table: not sealed
], ids=["whole", "table-deleted", "eigs-deleted", "table-truncated", "eigs-same-size",
        "refit-table"])
def test_check_files_compares_the_listed_sizes_with_the_seals(
    tmp_path: Path, change: Callable[[LocalStore], None] | None, problem: str | None,
) -> None:
    store = LocalStore(tmp_path)
    marker = sealed_result(store)
    if change is not None:
        change(store)
    assert check_files(store, marker) == problem


@pytest.mark.parametrize(("data", "problem"), [
    (b"E" * 10, None),
    (None, "eigs.npz is missing"),
    (b"E" * 9, "eigs.npz has 9 bytes, its marker says 10"),
    (b"E" * 9 + b"F", "eigs.npz is corrupt"),
], ids=["whole", "missing", "short", "corrupt"])
def test_check_data_verifies_size_and_hash(tmp_path: Path, data: bytes | None,
                                           problem: str | None) -> None:
    marker = sealed_result(LocalStore(tmp_path))
    if problem is None:
        assert check_data(marker, "eigs.npz", data) == data
    else:
        with pytest.raises(DamagedResult, match=problem):
            check_data(marker, "eigs.npz", data)


def test_markers_without_seals_are_taken_as_they_are(tmp_path: Path) -> None:
    """Markers written before seals: a file is checked for presence only."""
    store = LocalStore(tmp_path)
    store.put_bytes("m/layers.csv", b"anything")
    marker = Marker(model="org/m", model_key="m")
    assert check_files(store, marker) is None
    assert check_data(marker, "layers.csv", b"anything else") == b"anything else"
    store.delete("m/layers.csv")
    assert check_files(store, marker) == "layers.csv is missing"


@pytest.mark.parametrize("files", [
    {"layers.csv": {"size": 3}},
    {"layers.csv": {"size": -1, "sha256": "0" * 64}},
    {"layers.csv": {"size": 3, "sha256": "xyz"}},
    {"layers.csv": [3, "0" * 64]},
])
def test_a_marker_with_bad_seals_is_refused(files: dict[str, Any]) -> None:
    doc = {**Marker(model="org/m", model_key="m").to_dict(), "files": files}
    with pytest.raises(MarkerError, match="files"):
        Marker.from_dict(doc)
