"""Tests of controller.results.summary: summary.csv rows and encoding, the run report, run ids."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from controller.modellist import ModelRow
from controller.results.summary import (
    STAT_COLUMNS,
    SUMMARY_COLUMNS,
    new_run_id,
    run_report_key,
    summary_row,
    summary_to_csv,
    write_run_report,
    write_summary,
)
from esd_worker.results import layers_to_csv, marker_to_json
from esd_worker.settings import AnalysisSettings
from esd_worker.store import LocalStore, Store

PARAMS = AnalysisSettings().as_dict()

# A small layers table. Hand-computed over the three fitted ("ok") layers, alphas 2, 3, 7:
#   alpha_mean = 12/3 = 4; alpha_median = 3; alpha_std (population) = sqrt((4+1+9)/3)
#   = sqrt(14/3); alpha_in_2_6_share = 2/3 (2 and 3; 7 is out).
LAYERS: tuple[dict[str, Any], ...] = (
    {"layer": "h.0.attn", "alpha": 2.0, "stable_rank": 10.0, "log_spectral_norm": 1.0,
     "log_norm": 2.0, "entropy": 0.9, "alpha_weighted": 2.0, "log_alpha_norm": 3.0,
     "status": "ok"},
    {"layer": "h.0.mlp", "alpha": 3.0, "stable_rank": 20.0, "log_spectral_norm": 2.0,
     "log_norm": 3.0, "entropy": 0.8, "alpha_weighted": 6.0, "log_alpha_norm": 4.0,
     "status": "ok"},
    {"layer": "h.1.mlp", "alpha": 7.0, "stable_rank": 30.0, "log_spectral_norm": 0.5,
     "log_norm": 1.0, "entropy": 0.7, "alpha_weighted": 3.5, "log_alpha_norm": 5.0,
     "status": "ok"},
    {"layer": "lm_head", "alpha": math.nan, "stable_rank": 40.0, "log_spectral_norm": 3.0,
     "log_norm": 4.0, "entropy": 0.6, "alpha_weighted": math.nan, "log_alpha_norm": math.nan,
     "status": "fit_failed"},
)
SUMMARY = {
    "layers": 4,
    "layers_ok": 3,
    "alpha_mean": 4.0,
    "alpha_median": 3.0,
    "alpha_std": math.sqrt(14 / 3),
    "alpha_in_2_6_share": 2 / 3,
    "stable_rank_mean": 25.0,
    "log_spectral_norm_mean": 1.625,
    "log_norm_mean": 2.5,
    "entropy_mean": 0.75,
    "alpha_weighted_mean": 3.8333333333333335,
    "log_alpha_norm_mean": 4.0,
}

# --- builders -------------------------------------------------------------------------------


def make_model_row(ref: str, relation: str = "", source: str | None = None) -> ModelRow:
    model_id, _, revision = ref.partition("@")
    return ModelRow(model_id, revision or None, relation, source, line=0)


def make_marker(row: ModelRow, **kw: Any) -> dict[str, Any]:
    marker: dict[str, Any] = {
        "schema": 1, "model": row.ref, "model_id": row.model_id, "revision": row.revision,
        "model_key": row.key, "relation": row.relation, "base_model": None,
        "parameters": PARAMS, "outputs": {"layers": "layers.csv", "eigs": None},
        "timings": {"total_s": 12.5}, "device": {"type": "cuda", "name": "NVIDIA H100"},
        "finished_at": "2026-11-23T07:05:01+00:00", "summary": dict(SUMMARY),
    }
    marker.update(kw)
    return marker


def put_model(store: Store, row: ModelRow, marker: Mapping[str, Any] | None = None) -> None:
    rows = [{"model_id": row.model_id, "revision": row.revision, **layer} for layer in LAYERS]
    store.put_bytes(f"{row.key}/layers.csv", layers_to_csv(rows))
    store.put_bytes(f"{row.key}/result.json", marker_to_json(marker or make_marker(row)))


def read_summary(store: Store) -> list[dict[str, str]]:
    data = store.get_bytes("summary.csv")
    assert data is not None
    reader = csv.DictReader(io.StringIO(data.decode()))
    assert tuple(reader.fieldnames or ()) == SUMMARY_COLUMNS
    return list(reader)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "results")


# --- summary rows ---------------------------------------------------------------------------


def test_columns() -> None:
    """The contract the lead's tools and users' scripts read (issue 3)."""
    assert SUMMARY_COLUMNS == (
        "model_id", "revision", "model_key", "relation", "source_model", "layers", "layers_ok",
        "alpha_mean", "alpha_median", "alpha_std", "alpha_in_2_6_share", "stable_rank_mean",
        "log_spectral_norm_mean", "log_norm_mean", "entropy_mean", "alpha_weighted_mean",
        "log_alpha_norm_mean", "device", "total_s", "finished_at",
    )
    assert tuple(SUMMARY) == STAT_COLUMNS


def test_summary_row_from_marker_summary(store: LocalStore) -> None:
    row = make_model_row("org/a@main", relation="finetune", source="org/base")
    out = summary_row(row, make_marker(row), store)
    assert tuple(out) == SUMMARY_COLUMNS
    assert out == {
        "model_id": "org/a", "revision": "main", "model_key": row.key, "relation": "finetune",
        "source_model": "org/base", **SUMMARY, "device": "cuda (NVIDIA H100)", "total_s": 12.5,
        "finished_at": "2026-11-23T07:05:01+00:00",
    }


def test_summary_row_falls_back_to_marker_identity(store: LocalStore) -> None:
    """A list row without relation or source: the marker's relation and base model fill in."""
    row = make_model_row("org/adapter")
    marker = make_marker(row, relation="lora", base_model={"model": "org/base@v1"},
                         device={"type": "cpu"}, timings=None)
    out = summary_row(row, marker, store)
    assert (out["relation"], out["source_model"], out["device"], out["total_s"]) == (
        "lora", "org/base@v1", "cpu", None
    )


def test_summary_row_without_summary_or_layers_has_empty_stats(store: LocalStore) -> None:
    row = make_model_row("org/a")
    marker = make_marker(row)
    del marker["summary"]
    out = summary_row(row, marker, store)
    assert all(out[col] is None for col in STAT_COLUMNS)


def test_summary_row_computes_from_layers_csv_for_old_markers(store: LocalStore) -> None:
    """A marker without "summary" (written before it existed): the hand-computed numbers at
    the top of this file, from layers.csv (a NaN alpha and a fit_failed layer included)."""
    row = make_model_row("org/a")
    marker = make_marker(row)
    del marker["summary"]
    put_model(store, row, marker)
    out = summary_row(row, marker, store)
    for col, expected in SUMMARY.items():
        assert out[col] == pytest.approx(expected, rel=1e-12), col


def test_write_summary_mixes_new_and_old_markers(store: LocalStore) -> None:
    """Both sources give the same cells for the same layers."""
    new, old = make_model_row("org/new"), make_model_row("org/old")
    put_model(store, new)
    marker = make_marker(old)
    del marker["summary"]
    put_model(store, old, marker)
    assert write_summary(store, [new, old]) == 2
    a, b = read_summary(store)
    for col in STAT_COLUMNS:
        assert float(a[col]) == pytest.approx(float(b[col]), rel=1e-12), col


# --- summary.csv ----------------------------------------------------------------------------


def test_write_summary_done_models_in_list_order(store: LocalStore) -> None:
    a, b, c, d = (make_model_row(r) for r in ("org/a", "org/b", "org/c@v2", "org/d"))
    put_model(store, c)
    put_model(store, a)
    store.put_bytes(f"{b.key}/layers.csv", b"crashed before the marker\n")
    put_model(store, make_model_row("org/not-listed"))
    assert write_summary(store, [d, c, b, a, c]) == 2
    rows = read_summary(store)
    assert [(r["model_id"], r["revision"]) for r in rows] == [("org/c", "v2"), ("org/a", "")]


def test_write_summary_cells(store: LocalStore) -> None:
    """Floats in full precision; None and NaN as empty cells."""
    row = make_model_row("org/a")
    put_model(store, row, make_marker(row, summary={**SUMMARY, "alpha_std": None}))
    write_summary(store, [row])
    (cells,) = read_summary(store)
    assert cells["alpha_mean"] == "4.0"
    assert float(cells["alpha_in_2_6_share"]) == 2 / 3
    assert cells["layers"] == "4"
    assert cells["alpha_std"] == ""
    assert cells["revision"] == "" and cells["source_model"] == ""
    assert cells["total_s"] == "12.5"


@pytest.mark.parametrize(
    ("value", "cell"),
    [(None, ""), (math.nan, ""), (math.inf, ""), (0.1, "0.1"), (1 / 3, repr(1 / 3)), (7, "7"),
     (True, "true"), ("x,y", "x,y")],
)
def test_summary_cell_encoding(value: Any, cell: str) -> None:
    """Markers hold null for NaN, but rows computed from layers.csv can hold NaN itself."""
    header, row = csv.reader(io.StringIO(summary_to_csv([{"alpha_mean": value}]).decode()))
    assert tuple(header) == SUMMARY_COLUMNS
    assert row[SUMMARY_COLUMNS.index("alpha_mean")] == cell
    assert [c for i, c in enumerate(row) if i != SUMMARY_COLUMNS.index("alpha_mean")] == [""] * (
        len(SUMMARY_COLUMNS) - 1
    )


def test_write_summary_parameters_filter(store: LocalStore) -> None:
    a, b = make_model_row("org/a"), make_model_row("org/b")
    put_model(store, a)
    put_model(store, b, make_marker(b, parameters=AnalysisSettings(fix_fingers="DKS").as_dict()))
    assert write_summary(store, [a, b]) == 2
    assert write_summary(store, [a, b], parameters=PARAMS) == 1
    assert [r["model_id"] for r in read_summary(store)] == ["org/a"]


def test_write_summary_with_nothing_done_writes_header_only(store: LocalStore) -> None:
    assert write_summary(store, [make_model_row("org/a")]) == 0
    assert read_summary(store) == []


def test_write_summary_skips_corrupt_marker(store: LocalStore) -> None:
    a, b = make_model_row("org/a"), make_model_row("org/b")
    put_model(store, a)
    store.put_bytes(f"{b.key}/result.json", b"{oops")
    assert write_summary(store, [a, b], threads=2) == 1


def test_write_summary_many_models_threads(store: LocalStore) -> None:
    rows = [make_model_row(f"org/m{i:03d}") for i in range(40)]
    for row in rows[1::2]:
        put_model(store, row)
    assert write_summary(store, rows, threads=8) == 20
    assert [r["model_id"] for r in read_summary(store)] == [r.model_id for r in rows[1::2]]


# --- run report -----------------------------------------------------------------------------


def test_write_run_report(store: LocalStore) -> None:
    report = {
        "run_id": "20261123T070501Z-abcdef", "counts": {"done": 3, "failed": 1},
        "success_rate": 0.75, "avg_gpu_wait_s": math.nan, "durations": (1.5, 2.0),
        "log_dir": Path("/tmp/logs"), "started": datetime(2026, 11, 23, tzinfo=timezone.utc),
    }
    key = write_run_report(store, "20261123T070501Z-abcdef", report)
    assert key == "runs/20261123T070501Z-abcdef.json"
    data = store.get_bytes(key)
    assert data is not None
    doc = json.loads(data)
    assert doc["counts"] == {"done": 3, "failed": 1}
    assert doc["avg_gpu_wait_s"] is None  # JSON has no NaN
    assert doc["durations"] == [1.5, 2.0]
    assert doc["log_dir"] == "/tmp/logs"
    assert doc["started"].startswith("2026-11-23")


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x y"])
def test_run_report_key_rejects_unsafe_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run id"):
        run_report_key(bad)


# --- run ids --------------------------------------------------------------------------------


def test_run_id_format() -> None:
    run_id = new_run_id(datetime(2026, 11, 23, 7, 5, 1, tzinfo=timezone.utc))
    assert re.fullmatch(r"20261123T070501Z-[0-9a-f]{6}", run_id)
    assert run_report_key(run_id) == f"runs/{run_id}.json"


def test_run_ids_sort_by_start_time() -> None:
    """Lexical order is time order, across time zones and day/year boundaries."""
    start = datetime(2026, 12, 31, 23, 59, 58, tzinfo=timezone.utc)
    times = [start + timedelta(seconds=s) for s in (0, 1, 2, 3, 86400, 86400 * 40)]
    ids = [new_run_id(t.astimezone(timezone(timedelta(hours=-7)))) for t in times]
    assert sorted(ids) == ids
    assert ids[2].startswith("20270101T000000Z-")


def test_run_ids_unique_within_a_second() -> None:
    now = datetime(2026, 11, 23, tzinfo=timezone.utc)
    assert len({new_run_id(now) for _ in range(200)}) == 200


def test_run_id_defaults_to_now() -> None:
    before = datetime.now(timezone.utc).replace(microsecond=0)
    run_id = new_run_id()
    stamp = datetime.strptime(run_id.split("-")[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    assert before <= stamp <= datetime.now(timezone.utc)
