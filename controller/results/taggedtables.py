"""A refit's tables (layers.<TAG>.csv, which the results tables do not hold) read from the
per-model files as models and layers record batches, a chunk of models at a time.

Owns: turning marker + layers.<TAG>.csv of each model into the tables' rows (the model's
summary recomputed from the refit's rows), so the report's passes read a refit exactly as
they read the results tables. Memory: one chunk of models. Slower than the tables (every
pass reads every model's files again), which a refit report can afford.
Not owned: the tables' columns (esd_worker.core.store.tables), the passes (overview.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pyarrow as pa

from controller.results.reader import read_table, table_name, warn_damaged
from esd_worker.core.store.layout import (
    fetch_all,
    iter_markers,
    marker_key,
    model_file_key,
    parse_marker,
)
from esd_worker.core.store.marker import DamagedResult, Marker
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import DoneModel, part_tables

CHUNK = 256


class TaggedTables:
    """models() / layers() of a refit tag, like controller.results.tables.Tables'."""

    def __init__(self, store: Store, tag: str, *, threads: int = 16) -> None:
        self.store, self.tag, self.threads = store, tag, threads

    def models(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        for models, _ in self._chunks():
            yield from _select(models, columns).to_batches()

    def layers(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        for _, layers in self._chunks():
            yield from _select(layers, columns).to_batches()

    def _chunks(self) -> Iterator[tuple[pa.Table, pa.Table]]:
        keys = iter_markers(self.store)
        name = table_name(self.tag)
        while chunk := list(itertools.islice(keys, CHUNK)):
            markers: list[Marker] = []
            for key, data in zip(chunk, fetch_all(self.store, [marker_key(k) for k in chunk],
                                                  threads=self.threads), strict=True):
                marker = parse_marker(key, data)
                if marker is not None:
                    markers.append(marker)
            blobs = fetch_all(self.store, [model_file_key(m.model_key, name) for m in markers],
                              threads=self.threads)
            done: list[DoneModel] = []
            for marker, blob in zip(markers, blobs, strict=True):
                if blob is None:
                    continue
                try:
                    rows = read_table(marker, name, blob)
                except DamagedResult as e:
                    warn_damaged(marker.model_key, e)
                    continue
                # The marker's summary is of layers.csv: recompute it from the refit's rows.
                done.append(DoneModel(replace(marker, summary=None), rows))
            yield from part_tables(done).values()


def _select(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    return table if columns is None else table.select(list(columns))
