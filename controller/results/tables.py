"""The results tables of a store, read a record batch at a time with bounded memory.

The tables are esd_worker.core.store.tables' Parquet parts (`_tables/<table>/arch=<A>/`);
this module lists them, keeps the newest row of each model when a model sits in more than
one part, and adds the models that no part holds yet from their per-model files (the
fallback), so that a reader sees every done model once whichever way it was recorded.

Why pyarrow and not DuckDB: pyarrow is already the project's (the worker writes the parts
with it), reads a part's row groups a batch at a time and prunes columns; the parts are
fetched through the project's Store, the one door to a local folder or S3 (credentials,
retries, redaction), where DuckDB would need its own S3 credentials and an httpfs
extension it downloads at run time. Memory: a few parts' bytes plus a batch, and 12 bytes a
model for the newest-row check (its key's hash and its part: 24 MB at 2M models).

Parts are opened with ParquetFile and read with use_threads=False: pyarrow 26's threaded
read_table aborts the interpreter at exit now and then ("terminate called without an
active exception"), measured here about 1 run in 10.
"""

from __future__ import annotations

import io
import itertools
import logging
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from controller.keyset import KeySet
from controller.results.reader import ModelResult, read_table, warn_damaged
from esd_worker.core.store.layout import (
    fetch_all,
    iter_markers,
    load_marker,
    marker_key,
    model_file_key,
)
from esd_worker.core.store.marker import BaseModelRef, DamagedResult, Marker, MarkerError
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import (
    LAYER_SCHEMA,
    LAYERS_TABLE,
    MODEL_SCHEMA,
    MODELS_TABLE,
    DoneModel,
    PartKey,
    arch_partition,
    parse_part_key,
    part_tables,
    table_prefix,
)

log = logging.getLogger(__name__)

BATCH_ROWS = 64 * 1024  # rows per record batch handed on
FALLBACK_CHUNK = 512  # models read from their own files at a time


@dataclass
class _Newest:
    """Which models row of each model_key counts: the newest by finished_at, then part."""

    losers: dict[str, set[str]] = field(default_factory=dict)  # part_id → model_keys
    keys: KeySet = field(default_factory=KeySet)
    rows: int = 0


class Tables:
    """The tables of one store, optionally only some architectures' partitions.

    models() / layers(): record batches of the rows that count (each model once, its layers
    those of the same part), then, with fallback=True, of the done models no part holds yet,
    made from their marker and layers.csv. Parts are listed once, when first needed.
    """

    def __init__(self, store: Store, *, archs: Collection[str] | None = None,
                 threads: int = 8) -> None:
        self.store, self.threads = store, threads
        self.archs = None if archs is None else frozenset(archs)
        self._parts: dict[str, list[PartKey]] | None = None
        self._newest: _Newest | None = None
        self._warned: set[str] = set()  # damaged models met by the fallback: one line each

    def _damaged(self, key: str, e: DamagedResult) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_damaged(key, e)

    # -- parts -----------------------------------------------------------------------------

    def parts(self, table: str) -> list[PartKey]:
        """The parts of `table` (of the architectures asked for), oldest first. A layers
        part counts only with its models part (written after it: a crash between the two
        leaves a layers part that nothing reads)."""
        if self._parts is None:
            found: dict[str, list[PartKey]] = {MODELS_TABLE: [], LAYERS_TABLE: []}
            for name in found:
                for key in self.store.list_keys(table_prefix(name)):
                    part = parse_part_key(key)
                    if part is not None and (self.archs is None or part.arch in self.archs):
                        found[name].append(part)
            ids = {(p.arch, p.part_id) for p in found[MODELS_TABLE]}
            found[LAYERS_TABLE] = [p for p in found[LAYERS_TABLE] if (p.arch, p.part_id) in ids]
            for parts in found.values():
                parts.sort(key=lambda p: (p.part_id, p.arch))
            self._parts = found
        return self._parts[table]

    def _files(self, parts: Sequence[PartKey]) -> Iterator[tuple[PartKey, pq.ParquetFile]]:
        """Each part opened, fetched a few ahead of the reader (stores may be remote)."""
        window = max(1, self.threads)
        for start in range(0, len(parts), window):
            chunk = parts[start:start + window]
            for part, data in zip(chunk, fetch_all(self.store, [p.key for p in chunk],
                                                   threads=self.threads), strict=True):
                if data is None:  # merged away by compact since the listing
                    continue
                yield part, pq.ParquetFile(io.BytesIO(data))

    def _batches(self, table: str, columns: Sequence[str] | None,
                 ) -> Iterator[tuple[PartKey, pa.RecordBatch]]:
        for part, file in self._files(self.parts(table)):
            for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=columns,
                                           use_threads=False):
                yield part, batch

    # -- the newest row of each model --------------------------------------------------------

    def newest(self) -> _Newest:
        """Which row of each model counts. One pass over the models parts' model_key column
        (8 bytes a row held: its hash); only when some model sits in more than one part, a
        second pass over the parts that hold those models reads their finished_at."""
        if self._newest is not None:
            return self._newest
        hashes: list[np.ndarray] = []
        part_of: list[np.ndarray] = []  # the index in parts() of each row's part
        index = {p.part_id + "/" + p.arch: i for i, p in enumerate(self.parts(MODELS_TABLE))}
        for part, batch in self._batches(MODELS_TABLE, ["model_key"]):
            hashes.append(_hashes(batch.column(0).to_pylist()))
            part_of.append(np.full(batch.num_rows, index[part.part_id + "/" + part.arch],
                                   dtype=np.int32))
        newest = _Newest()
        if hashes:
            h = np.concatenate(hashes)
            unique, counts = np.unique(h, return_counts=True)
            newest.rows = len(h)
            newest.keys = KeySet.of_hashes(array("q", unique.tobytes()))
            repeated = unique[counts > 1]
            if len(repeated):  # some model in more than one part
                parts = np.unique(np.concatenate(part_of)[np.isin(h, repeated)])
                newest.losers = self._losers(repeated, [self.parts(MODELS_TABLE)[i]
                                                        for i in parts])
        self._newest = newest
        return newest

    def _losers(self, repeated: np.ndarray, parts: Sequence[PartKey]) -> dict[str, set[str]]:
        """part_id → the keys whose row in that part is not their newest: rows are ranked
        by finished_at (ISO text sorts as time), then by part (ids sort by when written)."""
        best: dict[str, tuple[str, int, str]] = {}  # key → (finished_at, rank, part_id)
        rows: list[tuple[str, str, int, str]] = []
        for rank, (part, file) in enumerate(self._files(parts)):
            for batch in file.iter_batches(batch_size=BATCH_ROWS, use_threads=False,
                                           columns=["model_key", "finished_at"]):
                keys = batch.column(0).to_pylist()
                hit = np.isin(_hashes(keys), repeated)
                finished = batch.column(1).to_pylist()
                for i in np.flatnonzero(hit):
                    rows.append((keys[i], finished[i] or "", rank, part.part_id))
        for key, finished, rank, part_id in rows:
            if key not in best or (finished, rank) > best[key][:2]:
                best[key] = (finished, rank, part_id)
        losers: dict[str, set[str]] = {}
        for key, finished, rank, part_id in rows:
            if best[key] != (finished, rank, part_id):
                losers.setdefault(part_id, set()).add(key)
        return losers

    # -- rows --------------------------------------------------------------------------------

    def models(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The models rows that count (MODEL_SCHEMA's columns, or `columns`)."""
        yield from self._rows(MODELS_TABLE, columns, MODEL_SCHEMA)
        if fallback:
            for models, _ in self._fallback():
                yield from select_columns(models, columns).to_batches(BATCH_ROWS)

    def layers(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The layers rows of the models rows that count (LAYER_SCHEMA's columns)."""
        yield from self._rows(LAYERS_TABLE, columns, LAYER_SCHEMA)
        if fallback:
            for _, layers in self._fallback():
                yield from select_columns(layers, columns).to_batches(BATCH_ROWS)

    def _rows(self, table: str, columns: Sequence[str] | None,
              schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        losers = self.newest().losers
        wanted = list(columns) if columns is not None else schema.names
        read = wanted if "model_key" in wanted or not losers else [*wanted, "model_key"]
        for part, batch in self._batches(table, read):
            gone = losers.get(part.part_id)
            if gone:
                keep = pc.invert(pc.is_in(batch.column("model_key"),
                                          value_set=pa.array(sorted(gone))))
                batch = batch.filter(keep)
            if read != wanted:
                batch = batch.select(wanted)
            if batch.num_rows:
                yield batch

    def missing_keys(self) -> Iterator[str]:
        """The keys of done models (a marker) that no part holds, as one listing goes."""
        held = self.newest().keys
        return (key for key in iter_markers(self.store) if key not in held)

    def _fallback(self) -> Iterator[tuple[pa.Table, pa.Table]]:
        """(models, layers) tables of the models no part holds, FALLBACK_CHUNK at a time."""
        missing = self.missing_keys()
        while chunk := list(itertools.islice(missing, FALLBACK_CHUNK)):
            done = read_done_models(self.store, chunk, threads=self.threads,
                                    archs=self.archs, on_damaged=self._damaged)
            yield from part_tables(done).values()


def select_columns(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    return table if columns is None else table.select(list(columns))


def _hashes(keys: Sequence[str]) -> np.ndarray:
    return np.fromiter((hash(k) for k in keys), dtype=np.int64, count=len(keys))


def read_done_models(store: Store, keys: Sequence[str], *, threads: int = 8,
                     archs: Collection[str] | None = None,
                     on_damaged: Callable[[str, DamagedResult], None] = warn_damaged,
                     table: str | None = None) -> list[DoneModel]:
    """The DoneModels of `keys` from their per-model files (marker, layers.csv), checked as
    every reader of those files checks them (a marker this version reads; a table whole as
    its marker seals it: controller.results.reader.read_table). A damaged model is left out
    and handed to on_damaged (default: its one line, warn_damaged); a marker gone since the
    listing, or without its table, is left out quietly (not done: the plan runs it again).
    table: another layer table of the model's folder (a refit's layers.<TAG>.csv)."""
    markers: list[Marker] = []
    for key, data in zip(keys, fetch_all(store, [marker_key(k) for k in keys],
                                         threads=threads), strict=True):
        if data is None:
            continue
        try:
            marker = load_marker(key, data)
        except MarkerError as e:
            on_damaged(key, DamagedResult(f"{marker_key(key)} is not a marker this "
                                          f"version reads: {e}"))
            continue
        if archs is None or arch_partition(marker.architecture) in archs:
            markers.append(marker)
    names = [table or m.layers_name for m in markers]
    blobs = fetch_all(store, [model_file_key(m.model_key, name)
                              for m, name in zip(markers, names, strict=True)],
                      threads=threads)
    done: list[DoneModel] = []
    for marker, name, data in zip(markers, names, blobs, strict=True):
        if data is None:
            continue
        try:
            done.append(DoneModel(marker, read_table(marker, name, data)))
        except DamagedResult as e:
            on_damaged(marker.model_key, e)
    return done


def rows_of(batch: pa.RecordBatch, keys: Collection[str],
            column: str = "model_key") -> pa.RecordBatch:
    """The rows of `batch` whose `column` is one of `keys` (a set, for big ones). Not
    pc.is_in: it builds its hash table of `keys` anew for every batch (measured: 43 s of 52
    for summary.csv of 200,000 models in 1,565 parts)."""
    names = batch.column(column).to_pylist()
    return batch.take(pa.array([i for i, key in enumerate(names) if key in keys],
                               type=pa.int64()))


# What a ModelResult shell needs of a models row: who the model is, and its base.
SHELL_COLUMNS = ("model_key", "model", "model_id", "revision", "relation", "base_model")


def model_shells(tables: Tables, keys: Collection[str] | None = None) -> list[ModelResult]:
    """A ModelResult without rows for each model of the tables (or of `keys`), sorted by key:
    what pairing models needs (ids, relation, base) at ~1 kB a model, not its layers."""
    wanted = None if keys is None else set(keys)
    shells: list[ModelResult] = []
    for batch in tables.models(SHELL_COLUMNS):
        if wanted is not None:
            batch = rows_of(batch, wanted)
        for row in batch.to_pylist():
            base = row["base_model"]
            marker = Marker(model=row["model"] or row["model_key"], model_key=row["model_key"],
                            model_id=row["model_id"], revision=row["revision"],
                            relation=row["relation"] or "",
                            base_model=BaseModelRef(base) if base else None)
            shells.append(ModelResult(row["model_key"], marker, []))
    shells.sort(key=lambda r: r.key)
    return shells


def layer_rows(tables: Tables, keys: Collection[str]) -> dict[str, list[dict[str, Any]]]:
    """model_key → its layer rows (LAYER_COLUMNS, in layer order) for `keys`: one pass over
    the layers table, filtered as it is read."""
    wanted = set(keys)
    found: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for batch in tables.layers():
        for row in rows_of(batch, wanted).to_pylist():
            found.setdefault(row["model_key"], []).append((row["layer_index"], row))
    return {key: [row for _, row in sorted(rows, key=lambda item: item[0])]
            for key, rows in found.items()}
