"""layers.parquet: one typed row per layer of every model, written a row group at a time.

Owns the Parquet file's columns and types (the layer table's, plus model_key, model,
relation, base_key, layer_index) and its row groups. The layer table's own columns are
esd_worker.core.store.results.LAYER_COLUMNS; pyarrow is imported only when a table is built
(controller.results.extras).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from controller.results.extras import require
from controller.results.reader import ModelResult, number
from esd_worker.core.store.results import LAYER_COLUMNS

PARQUET_ROW_GROUP = 100_000  # rows per Parquet row group (whole models: at least one)
ID_COLUMNS: tuple[str, ...] = ("model_key", "model", "relation", "base_key", "layer_index")

_INT_COLUMNS = frozenset(
    {"M", "N", "num_params", "num_evals", "num_pl_spikes", "matrix_rank"}
)
_TEXT_COLUMNS = frozenset({"model_id", "revision", "layer", "layer_type", "fix_fingers", "status"})


def layers_table(results: Sequence[ModelResult], bases: Mapping[str, str]) -> Any:
    """A pyarrow Table of every layer of every model: model_key, model, relation, base_key,
    layer_index, then the layer table's columns typed (ints, floats, strings; NaN kept)."""
    pa = require("pyarrow")
    columns: dict[str, list[Any]] = {c: [] for c in ID_COLUMNS}
    for c in LAYER_COLUMNS:
        columns[c] = []
    for r in results:
        for i, row in enumerate(r.rows):
            columns["model_key"].append(r.key)
            columns["model"].append(r.marker.model or r.model_id)
            columns["relation"].append(r.relation)
            columns["base_key"].append(bases.get(r.key))
            columns["layer_index"].append(i)
            for c in LAYER_COLUMNS:
                cell = row.get(c, "")
                if c in _TEXT_COLUMNS:
                    columns[c].append(cell or None)
                elif c in _INT_COLUMNS:
                    f = number(cell)
                    columns[c].append(int(f) if math.isfinite(f) else None)
                else:
                    columns[c].append(number(cell))
    types: dict[str, Any] = {"layer_index": pa.int64()}
    for c in columns:
        if c in types:
            continue
        if c in _INT_COLUMNS:
            types[c] = pa.int64()
        elif c in _TEXT_COLUMNS or c in ID_COLUMNS:
            types[c] = pa.string()
        else:
            types[c] = pa.float64()
    schema = pa.schema([(c, types[c]) for c in columns])
    return pa.table({c: pa.array(v, type=types[c]) for c, v in columns.items()}, schema=schema)


class LayersParquet:
    """layers.parquet built in memory one model at a time: whole models are held back until
    they make PARQUET_ROW_GROUP rows, then written as one row group, so memory holds about
    one row group of tables besides the file itself."""

    def __init__(self) -> None:
        self._pq = require("pyarrow.parquet")
        self._buf = io.BytesIO()
        self._writer: Any = None
        self._pending: list[Any] = []
        self._pending_rows = 0

    def add(self, table: Any) -> None:
        """Add one model's layers_table."""
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= PARQUET_ROW_GROUP:
            self._flush()
            self._pending, self._pending_rows = [], 0

    def finish(self) -> bytes:
        """The file's bytes; at least one table must have been added."""
        self._flush()
        self._writer.close()
        return self._buf.getvalue()

    def _flush(self) -> None:
        """Write the pending tables as one row group (opening the writer on the first)."""
        pa = require("pyarrow")
        if self._writer is None:
            self._writer = self._pq.ParquetWriter(self._buf, self._pending[0].schema)
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending))
