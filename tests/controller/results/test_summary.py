"""Tests of controller.results.summary: summary.csv rows and encoding, its text table."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest

from controller.results.reader import ModelResult
from controller.results.summary import (
    STAT_COLUMNS,
    SUMMARY_COLUMNS,
    _short,
    format_summary_table,
    summary_row,
    summary_rows,
    summary_to_csv,
    write_summary,
)
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.marker import BaseModelRef, Marker
from esd_worker.core.store.results import layers_from_csv, layers_to_csv
from esd_worker.core.store.stores import LocalStore, Store
from tests.support.results import CountingStore

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


def make_marker(row: ModelRow, **kw: Any) -> Marker:
    """The marker the worker writes for `row`, with SUMMARY; `kw`: Marker fields to change."""
    fields: dict[str, Any] = {
        "model": row.ref, "model_id": row.model_id, "revision": row.revision,
        "model_key": row.key, "relation": row.relation, "base_model": None,
        "parameters": PARAMS, "layers_name": "layers.csv", "eigs_name": None,
        "timings": {"total_s": 12.5}, "device": {"type": "cuda", "name": "NVIDIA H100"},
        "finished_at": "2026-11-23T07:05:01+00:00", "summary": dict(SUMMARY),
    }
    return Marker(**(fields | kw))


def without_summary(marker: Marker) -> Marker:
    """A marker as written before "summary" existed."""
    return dataclasses.replace(marker, summary=None)


def layer_rows(row: ModelRow) -> list[dict[str, Any]]:
    return [{"model_id": row.model_id, "revision": row.revision, **layer} for layer in LAYERS]


def put_model(store: Store, row: ModelRow, marker: Marker | None = None) -> None:
    store.put_bytes(f"{row.key}/layers.csv", layers_to_csv(layer_rows(row)))
    store.put_bytes(f"{row.key}/result.json", (marker or make_marker(row)).to_json())


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
        "log_alpha_norm_mean", "params_analysed_share", "tensors_skipped", "device",
        "total_s", "finished_at",
    )
    assert tuple(SUMMARY) == STAT_COLUMNS


def test_summary_row_from_marker_summary(store: LocalStore) -> None:
    row = make_model_row("org/a@main", relation="finetune", source="org/base")
    out = summary_row(row, make_marker(row), store)
    assert tuple(out) == SUMMARY_COLUMNS
    assert out == {
        "model_id": "org/a", "revision": "main", "model_key": row.key, "relation": "finetune",
        "source_model": "org/base", **SUMMARY, "params_analysed_share": None,
        "tensors_skipped": None, "device": "cuda (NVIDIA H100)", "total_s": 12.5,
        "finished_at": "2026-11-23T07:05:01+00:00",
    }


def test_summary_row_falls_back_to_marker_identity(store: LocalStore) -> None:
    """A list row without relation or source: the marker's relation and base model fill in."""
    row = make_model_row("org/adapter")
    marker = make_marker(row, relation="lora", base_model=BaseModelRef("org/base@v1"),
                         device={"type": "cpu"}, timings={})
    out = summary_row(row, marker, store)
    assert (out["relation"], out["source_model"], out["device"], out["total_s"]) == (
        "lora", "org/base@v1", "cpu", None
    )


def test_summary_row_without_summary_or_layers_has_empty_stats(store: LocalStore) -> None:
    row = make_model_row("org/a")
    marker = without_summary(make_marker(row))
    out = summary_row(row, marker, store)
    assert all(out[col] is None for col in STAT_COLUMNS)


def test_summary_row_computes_from_layers_csv_for_old_markers(store: LocalStore) -> None:
    """A marker without "summary" (written before it existed): the hand-computed numbers at
    the top of this file, from layers.csv (a NaN alpha and a fit_failed layer included)."""
    row = make_model_row("org/a")
    marker = without_summary(make_marker(row))
    put_model(store, row, marker)
    out = summary_row(row, marker, store)
    for col, expected in SUMMARY.items():
        assert out[col] == pytest.approx(expected, rel=1e-12), col


def test_write_summary_mixes_new_and_old_markers(store: LocalStore) -> None:
    """Both sources give the same cells for the same layers."""
    new, old = make_model_row("org/new"), make_model_row("org/old")
    put_model(store, new)
    put_model(store, old, without_summary(make_marker(old)))
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


# --- summary rows of results (report, refit) -------------------------------------------------


@pytest.mark.parametrize(
    ("recompute", "alpha_mean"),
    [
        pytest.param(False, 99.0, id="marker-summary"),
        pytest.param(True, 4.0, id="recomputed-from-the-rows"),
    ],
)
def test_summary_rows_of_results(store: LocalStore, recompute: bool, alpha_mean: float) -> None:
    """Without recompute the marker's summary is the source (here a made-up 99); with it,
    the rows held (a refit table): the hand-computed 4.0 of LAYERS. Identity columns come from
    the marker."""
    row = make_model_row("org/a@v1", relation="finetune")
    marker = make_marker(row, summary={**SUMMARY, "alpha_mean": 99.0})
    rows = layers_from_csv(layers_to_csv(layer_rows(row)))
    (out,) = summary_rows([ModelResult(row.key, marker, rows)], store, recompute=recompute)
    assert out["alpha_mean"] == pytest.approx(alpha_mean)
    assert (out["model_id"], out["revision"], out["relation"]) == ("org/a", "v1", "finetune")


def test_summary_rows_without_a_marker_summary_use_the_rows(store: LocalStore) -> None:
    row = make_model_row("org/a")
    marker = without_summary(make_marker(row))
    rows = layers_from_csv(layers_to_csv(layer_rows(row)))
    (out,) = summary_rows([ModelResult(row.key, marker, rows)], store)
    assert out["alpha_mean"] == pytest.approx(SUMMARY["alpha_mean"])


# --- the text table -----------------------------------------------------------------------------


def test_format_summary_table_without_summary(store: LocalStore) -> None:
    assert format_summary_table(store) == "(no summary.csv yet)"


def test_format_summary_table(store: LocalStore) -> None:
    """Aligned columns; numbers to 3 decimals, integers without; past `limit` rows a line
    says how many more there are. alpha_mean 4.0 prints as 4, α share 2/3 as 0.667."""
    rows = [make_model_row(f"org/m{i}", relation="base") for i in range(3)]
    for row in rows:
        put_model(store, row)
    write_summary(store, rows)
    lines = format_summary_table(store, limit=2).splitlines()
    assert lines[0].split() == [
        "model_id", "relation", "layers", "alpha_mean", "alpha_median", "alpha_in_2_6_share",
        "stable_rank_mean", "log_spectral_norm_mean",
    ]
    assert lines[1].split() == ["org/m0", "base", "4", "4", "3", "0.667", "25", "1.625"]
    assert lines[1].index("base") == lines[0].index("relation")
    assert lines[3] == "... 1 more in summary.csv"
    assert len(lines) == 4


@pytest.mark.parametrize(
    ("fix_fingers", "fit", "share"),
    [
        pytest.param("xmin_mid", "fit: xmin_mid, float32", False, id="xmin_mid"),
        pytest.param("DKS", "fit: DKS, float32", True, id="DKS"),
    ],
)
def test_format_summary_table_says_the_fit(store: LocalStore, fix_fingers: str, fit: str,
                                           share: bool) -> None:
    """As `run` prints it (with its analysis settings): the fit above the table, and the
    share in WeightWatcher's 2–6 band only where the band applies (DKS). summary.csv keeps
    the column whatever the fit."""
    row = make_model_row("org/m0", relation="base")
    put_model(store, row)
    write_summary(store, [row])
    parameters = AnalysisSettings(fix_fingers=fix_fingers).as_dict()
    lines = format_summary_table(store, parameters=parameters).splitlines()
    assert lines[0] == fit
    assert ("alpha_in_2_6_share" in lines[1].split()) is share
    assert lines[2].split()[0] == "org/m0"
    assert "alpha_in_2_6_share" in (store.root / "summary.csv").read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("cell", "text"),
    [("4.0", "4"), ("0.123456", "0.123"), ("org/m", "org/m"), ("x" * 60, "…" + "x" * 47),
     ("", "")],
)
def test_format_summary_table_cells(cell: str, text: str) -> None:
    assert _short(cell) == text


# --- a run's summary: markers the plan read are not read again -------------------------------




def test_a_run_summary_reads_only_the_markers_its_plan_did_not(tmp_path: Path) -> None:
    """As controller.run.sweep does: the plan hands its done markers to KnownMarkers, then
    the models analysed during the run (b here) are read; summary.csv is the same as one
    built from scratch, and no marker is read twice."""
    from controller.results.summary import KnownMarkers
    from controller.run.plan import ListPlan

    store = CountingStore(tmp_path / "results")
    a, b, c = (make_model_row(r, "finetune", "org/base") for r in ("org/a", "org/b", "org/c"))
    put_model(store, a, make_marker(a, relation="base"))
    put_model(store, c, without_summary(make_marker(c)))  # older marker: its table is read
    known = KnownMarkers()
    plan = ListPlan(lambda: [a, b, c], store, PARAMS, on_done=known.add).scan()
    assert plan.counts.done == 2 and plan.counts.todo == 1 and a.key in known
    put_model(store, b)  # analysed during the run
    store.got.clear()
    assert write_summary(store, plan.rows(), parameters=PARAMS, known=known) == 3
    incremental = read_summary(store)
    assert sorted(store.got) == sorted([f"{b.key}/result.json", f"{c.key}/result.json",
                                         f"{c.key}/layers.csv", "summary.csv"])
    assert write_summary(store, [a, b, c], parameters=PARAMS) == 3
    assert incremental == read_summary(store)
    assert [r["model_key"] for r in incremental] == [a.key, b.key, c.key]
    assert incremental[0]["relation"] == "finetune"  # the list's relation wins
    assert incremental[0]["source_model"] == "org/base"
