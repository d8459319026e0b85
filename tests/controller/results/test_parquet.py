"""Tests of controller.results.parquet: the columns and types of layers.parquet, and its row
groups. Every layer of a real report is checked in test_report."""

from __future__ import annotations

import io
import math

import pytest

from controller.results import parquet
from esd_worker.core.store.results import LAYER_COLUMNS
from tests.support.results import make_result

pq = pytest.importorskip("pyarrow.parquet")


def test_layers_table_types_and_empty_cells() -> None:
    """Counts are int64 with empty cells null; metrics float64 with empty cells NaN; text
    columns string with empty cells null; the adapter's base key where it has one."""
    result = make_result([2.5, math.nan], ["ok", "fit_failed"])
    result.rows[0]["M"] = "64"
    table = parquet.layers_table([result], {result.key: "base-key"})
    assert table.column_names == [*parquet.ID_COLUMNS, *LAYER_COLUMNS]
    assert str(table.schema.field("M").type) == "int64"
    assert str(table.schema.field("alpha").type) == "double"
    assert str(table.schema.field("layer_type").type) == "string"
    rows = table.to_pylist()
    assert [r["M"] for r in rows] == [64, None]
    assert rows[0]["alpha"] == 2.5 and math.isnan(rows[1]["alpha"])
    assert [r["layer_type"] for r in rows] == [None, None]
    assert [r["layer_index"] for r in rows] == [0, 1]
    assert {r["base_key"] for r in rows} == {"base-key"}
    assert {r["model"] for r in rows} == {"org/m"}


@pytest.mark.parametrize(
    ("row_group", "groups"),
    [
        pytest.param(100_000, 1, id="all-in-one"),
        pytest.param(2, 3, id="whole-models-per-group"),
    ],
)
def test_row_groups_hold_whole_models(
    monkeypatch: pytest.MonkeyPatch, row_group: int, groups: int
) -> None:
    """Three models of two layers: with row groups of 2 rows each model fills one (a group
    is never split inside a model); the file holds every row in order."""
    monkeypatch.setattr(parquet, "PARQUET_ROW_GROUP", row_group)
    writer = parquet.LayersParquet()
    for alphas in ([2.0, 3.0], [4.0, 5.0], [6.0, 7.0]):
        writer.add(parquet.layers_table([make_result(alphas)], {}))
    data = writer.finish()
    reader = pq.ParquetFile(io.BytesIO(data))
    assert reader.metadata.num_row_groups == groups
    assert reader.read().column("alpha").to_pylist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
