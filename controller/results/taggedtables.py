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

from controller.results.reader import table_name
from controller.results.tables import read_done_models, select_columns
from esd_worker.core.store.layout import iter_markers
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import DoneModel, part_tables

CHUNK = 256


class TaggedTables:
    """models() / layers() of a refit tag, like controller.results.tables.Tables'."""

    def __init__(self, store: Store, tag: str, *, threads: int = 16) -> None:
        self.store, self.tag, self.threads = store, tag, threads

    def models(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        for models, _ in self._chunks():
            yield from select_columns(models, columns).to_batches()

    def layers(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        for _, layers in self._chunks():
            yield from select_columns(layers, columns).to_batches()

    def _chunks(self) -> Iterator[tuple[pa.Table, pa.Table]]:
        keys = iter_markers(self.store)
        name = table_name(self.tag)
        while chunk := list(itertools.islice(keys, CHUNK)):
            done = read_done_models(self.store, chunk, threads=self.threads, table=name)
            # The marker's summary is of layers.csv: recompute it from the refit's rows.
            yield from part_tables([DoneModel(replace(d.marker, summary=None), d.layers)
                                    for d in done]).values()
