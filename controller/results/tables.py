"""The results tables of a store, read a part at a time with bounded memory, each row
counted only while the store's own files vouch for it.

The tables are esd_worker.core.store.tables' Parquet parts (`_tables/<table>/arch=<A>/`),
a copy of what the markers say; the markers stay the truth. This module decides which rows
count and adds the done models that no counted row holds from their per-model files (the
fallback), so that a reader sees every done model once, and only done models:
- a row counts only while one listing of the store shows its model's marker and the files
  the marker seals at the sizes the row recorded when it was made from them (its `files`
  column; a part written before that column: the marker and layers.csv present). A model
  whose marker was deleted or rewritten since, a table truncated, or a "ghost" that a
  part names and the store does not hold, is not counted from the part: a marker there is
  read with its own files (damaged: left out with one line), none means not done. A
  model_key that could not name a folder (`../x`) never counts;
- a model in more than one row counts once: its row with the latest `finished_at`, then
  the latest part, then the last row of the part (the same rows twice in one part count
  once); its layers are the rows of that part with that `finished_at`, the first of each
  layer_index;
- a part that cannot be read (truncated, garbage, empty, over PART_BYTES, not a regular
  file) or whose columns are not the schema's (a missing column, another type) is left out
  with one line naming it and what to run (`esd-sweep compact` sets it aside,
  controller.results.compact); its models are read from their own files. So is a models
  part whose layers part is missing.

The models of a part counted and then not readable when its rows are read (compact merged
it away meanwhile, or it is left out) are read from their own files, in models() and
layers() alike. Memory: a few parts' bytes and one decoded part, 16 bytes a vouched row for
the choice of rows (its key's hash, its part, its position; a few hundred bytes more for
each model met in more than one row), the listing as 8-byte hashes of (model, file, size),
and the marker keys of the listing spooled to a temporary file (millions of keys are never
held as strings).

Why pyarrow and not DuckDB: pyarrow is already the project's (the worker writes the parts
with it), reads only the columns asked for; the parts are fetched through the project's
Store, the one door to a local folder or S3 (credentials, retries, redaction, the size
bound), where DuckDB would need its own S3 credentials and an httpfs extension it
downloads at run time. Parts are read with use_threads=False: pyarrow 26's threaded
read_table aborts the interpreter at exit now and then ("terminate called without an
active exception"), measured here about 1 run in 10.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from controller.keyset import KeySet
from controller.results.counting import (
    Counted,
    Listing,
    Pick,
    array_of,
    key_hashes,
)
from controller.results.parts import COMPACT_HINT, BadPart, pair_of, read_part, with_nulls
from controller.results.reader import ModelResult, read_table, warn_damaged
from esd_worker.core.store.layout import (
    MARKER_BYTES,
    PART_BYTES,
    TABLE_BYTES,
    fetch_all,
    load_marker,
    marker_key,
    model_file_key,
)
from esd_worker.core.store.marker import (
    BaseModelRef,
    DamagedResult,
    Marker,
    MarkerError,
)
from esd_worker.core.store.stores import Store, StoreRefusal
from esd_worker.core.store.tables import (
    LAYERS_TABLE,
    MODELS_TABLE,
    SCHEMAS,
    DoneModel,
    PartKey,
    arch_partition,
    parse_part_key,
    part_tables,
    table_prefix,
)

log = logging.getLogger(__name__)

BATCH_ROWS = 64 * 1024  # rows per record batch handed on
FALLBACK_CHUNK = 64  # models read from their own files at a time (~20 MB as rows)
WINDOW_BYTES = 64 * 2**20  # part bytes fetched ahead of the reader (at least one part)


class Tables:
    """The tables of one store, optionally only some architectures' partitions.

    models() / layers(): record batches of the rows that count, then, with fallback=True,
    of the done models no counted row holds, made from their marker and layers.csv. The
    store is listed once, and its parts, when first needed.
    """

    def __init__(self, store: Store, *, archs: Collection[str] | None = None,
                 threads: int = 8) -> None:
        self.store, self.threads = store, threads
        self.archs = None if archs is None else frozenset(archs)
        self._parts: dict[str, list[PartKey]] | None = None
        self._listing: Listing | None = None
        self._counted: Counted | None = None
        self._bad: dict[str, str] = {}  # part pair → why it is left out
        self._lost: set[str] = set()  # pairs counted, then not readable (gone or left out)
        self._sizes: dict[str, int] = {}  # part key → its size, as listed
        self._warned: set[str] = set()  # damaged models met by the fallback: one line each

    def _damaged(self, key: str, e: DamagedResult) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_damaged(key, e)

    def _leave_out(self, part: PartKey, why: str) -> None:
        """Part `part` (and the other table's part of its pair) is not read: one line."""
        pair = pair_of(part)
        if pair not in self._bad:
            self._bad[pair] = why
            log.warning("results-table part %s left out: %s; %s", part.key, why,
                        COMPACT_HINT)

    def _refused(self, key: str, e: StoreRefusal) -> None:
        part = parse_part_key(key)
        if part is not None:
            self._leave_out(part, str(e))

    @property
    def bad(self) -> dict[str, str]:
        """Part pairs (pair_of) left out so far, with why."""
        return dict(self._bad)

    def listing(self) -> Listing:
        if self._listing is None:
            self._listing = Listing(self.store)
        return self._listing

    # -- parts -----------------------------------------------------------------------------

    def parts(self, table: str) -> list[PartKey]:
        """The parts of `table` (of the architectures asked for), oldest first, in pairs: a
        layers part counts only with its models part (written after it: a crash between the
        two leaves a layers part that nothing reads), and a models part without its layers
        part is left out (one line)."""
        if self._parts is None:
            found: dict[str, list[PartKey]] = {MODELS_TABLE: [], LAYERS_TABLE: []}
            for name in found:
                for key, size in self.store.list_sizes(table_prefix(name)):
                    part = parse_part_key(key)
                    if part is not None and (self.archs is None or part.arch in self.archs):
                        found[name].append(part)
                        self._sizes[key] = size
            models = {pair_of(p) for p in found[MODELS_TABLE]}
            layers = {pair_of(p) for p in found[LAYERS_TABLE]}
            for part in found[MODELS_TABLE]:
                if pair_of(part) not in layers:
                    self._leave_out(part, "its layers part is missing")
            found[MODELS_TABLE] = [p for p in found[MODELS_TABLE] if pair_of(p) in layers]
            found[LAYERS_TABLE] = [p for p in found[LAYERS_TABLE] if pair_of(p) in models]
            for parts in found.values():
                parts.sort(key=lambda p: (p.part_id, p.arch))
            self._parts = found
        return self._parts[table]

    def read_parts(self, parts: Sequence[PartKey], columns: Sequence[str] | None = None,
                   ) -> Iterator[tuple[PartKey, pa.Table | None]]:
        """Each part read whole (its `columns`), fetched a few ahead of the reader (stores
        may be remote): (part, table), or (part, None) when it cannot be read now: gone
        since the listing (compact merged it), or left out (refused by the store, not a
        readable part of the schema: one line the first time; a pair once left out is not
        fetched again)."""
        for chunk in windows(parts, self._sizes, self.threads):
            fetch = [p for p in chunk if pair_of(p) not in self._bad]
            blobs = dict(zip((p.key for p in fetch), fetch_all(
                self.store, [p.key for p in fetch], threads=self.threads, limit=PART_BYTES,
                on_refused=self._refused),
                strict=True))
            for part in chunk:
                data = blobs.get(part.key)
                if data is None:
                    yield part, None
                    continue
                try:
                    yield part, read_part(data, part.table, columns)
                except BadPart as e:
                    self._leave_out(part, str(e))
                    yield part, None

    def check_parts(self) -> dict[str, str]:
        """Read every part of both tables whole: the pairs that cannot be read (bad)."""
        for table in (MODELS_TABLE, LAYERS_TABLE):
            for _ in self.read_parts(self.parts(table)):
                pass
        return self.bad

    # -- which rows count --------------------------------------------------------------------

    def newest(self) -> Counted:
        """Which rows count (see the module's docstring). One pass over the models parts
        (each read whole: a part that fails anywhere fails before any of its rows counts);
        16 bytes a vouched row are held, and, for the models met in more than one row, a
        second pass over the parts that hold them reads their finished_at."""
        if self._counted is not None:
            return self._counted
        listing = self.listing()
        parts = self.parts(MODELS_TABLE)
        hashes: list[np.ndarray] = []
        where: list[np.ndarray] = []  # (part index, row) of each vouched row
        multi: dict[int, set[str]] = {}  # part index → the keys it holds more than once
        counted = Counted(bad=self._bad)
        for i, (_, table) in enumerate(self.read_parts(parts)):
            if table is None:
                continue
            keys = table.column("model_key").to_pylist()
            files = (table.column("files").to_pylist() if "files" in table.column_names
                     else [None] * len(keys))
            counted.rows += len(keys)
            ok = [r for r, (key, fs) in enumerate(zip(keys, files, strict=True))
                  if key is not None and listing.vouches(key, fs)]
            hashes.append(key_hashes([keys[r] for r in ok]))
            where.append(np.array([(i, r) for r in ok], dtype=np.int64).reshape(-1, 2))
            if len(set(keys)) < len(keys):
                multi[i] = {k for k, n in Counter(keys).items() if k is not None and n > 1}
        if hashes:
            self._choose(counted, parts, np.concatenate(hashes), np.concatenate(where), multi)
        self._counted = counted
        return counted

    def _choose(self, counted: Counted, parts: Sequence[PartKey], h: np.ndarray,
                at: np.ndarray, multi: dict[int, set[str]]) -> None:
        """Fill `counted` from the vouched rows (hashes `h`, (part, row) `at`): a model in one
        row counts there; one in several (or held more than once by a part) counts at its
        row with the latest finished_at (ISO text sorts as time), then the latest part (ids
        sort by when written), then the last in its part."""
        unique, first, counts = np.unique(h, return_index=True, return_counts=True)
        winner = at[first]
        again = unique[counts > 1]
        if multi:
            twice = key_hashes([k for keys in multi.values() for k in keys])
            again = np.union1d(again, twice[np.isin(twice, unique)])
        best: dict[int, tuple[str, int, int]] = {}  # hash → (finished_at, part, row)
        if len(again):
            candidates = at[np.isin(h, again)]
            order = np.argsort(candidates[:, 0], kind="stable")
            candidates = candidates[order]
            starts = np.flatnonzero(np.diff(candidates[:, 0], prepend=-1))
            by_part = dict(zip(candidates[starts, 0].tolist(),
                               np.split(candidates[:, 1], starts[1:]), strict=True))
            index = {pair_of(p): i for i, p in enumerate(parts)}
            chosen = [parts[i] for i in by_part]
            for part, table in self.read_parts(chosen, ["model_key", "finished_at"]):
                if table is None:  # gone since the first pass: its rows are not candidates
                    continue
                i = index[pair_of(part)]
                keys = table.column("model_key").to_pylist()
                finished = table.column("finished_at").to_pylist()
                for r in by_part[i].tolist():
                    row = (finished[r] or "", i, r)
                    k = hash(keys[r])
                    if k not in best or row > best[k]:
                        best[k] = row
            if best:
                won = np.array(list(best), dtype=np.int64)
                winner[np.searchsorted(unique, won)] = [(i, r) for _, i, r in best.values()]
        counted.keys = KeySet.of_hashes(array_of(unique))
        for i in np.unique(winner[:, 0]).tolist():
            counted.held[pair_of(parts[i])] = unique[winner[:, 0] == i]
        for i, keys in multi.items():
            for key in keys:
                pick = best.get(hash(key))
                if pick is not None and pick[1] == i:
                    counted.picks.setdefault(pair_of(parts[i]), {})[key] = Pick(pick[2],
                                                                                 pick[0])

    # -- rows --------------------------------------------------------------------------------

    def models(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The models rows that count (MODEL_SCHEMA's columns, or `columns`)."""
        yield from self._rows(MODELS_TABLE, columns, fallback)

    def layers(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The layers rows of the models rows that count (LAYER_SCHEMA's columns)."""
        yield from self._rows(LAYERS_TABLE, columns, fallback)

    def _rows(self, table: str, columns: Sequence[str] | None,
              fallback: bool) -> Iterator[pa.RecordBatch]:
        """The rows that count of `table`'s parts; with fallback, then those of the models
        whose counted part cannot be read now (gone, left out: models() and layers() agree
        on them whichever runs first), and of the models no counted row holds, from their
        own files."""
        counted = self.newest()
        schema = SCHEMAS[table]
        wanted = list(columns) if columns is not None else schema.names
        extra = ["model_key", "finished_at"] + (["layer_index"] if table == LAYERS_TABLE
                                                else [])
        read = [*wanted, *(c for c in extra if c not in wanted)]
        held = [p for p in self.parts(table) if pair_of(p) in counted.held]
        for part, got in self.read_parts([p for p in held if pair_of(p) not in self._lost],
                                         read):
            if got is None:
                self._lost.add(pair_of(part))
                continue
            kept = counted.keep(pair_of(part), got, table)
            yield from with_nulls(kept, wanted, schema).select(wanted).to_batches(BATCH_ROWS)
        lost = [pair_of(p) for p in held if pair_of(p) in self._lost]
        if not fallback:
            return
        if lost:
            keys = self.listing().marker_keys_of(
                np.unique(np.concatenate([counted.held[pair] for pair in lost])))
            yield from self._from_files(keys, table, columns, archs=None)
        yield from self._from_files(self.missing_keys(), table, columns, archs=self.archs)

    def missing_keys(self) -> Iterator[str]:
        """The keys of done models (a marker) that no counted row holds, as the listing
        went."""
        held = self.newest().keys
        return (key for key in self.listing().marker_keys() if key not in held)

    def _from_files(self, keys: Iterator[str], table: str, columns: Sequence[str] | None,
                    *, archs: frozenset[str] | None) -> Iterator[pa.RecordBatch]:
        """`table`'s rows of these models made from their own files, FALLBACK_CHUNK at a
        time (checked as `status` checks them: a damaged model is left out, one line)."""
        while chunk := list(itertools.islice(keys, FALLBACK_CHUNK)):
            done = read_done_models(self.store, chunk, threads=self.threads, archs=archs,
                                    on_damaged=self._damaged, check=self.listing().damage)
            for models, layers in part_tables(done).values():
                rows = models if table == MODELS_TABLE else layers
                yield from select_columns(rows, columns).to_batches(BATCH_ROWS)


def windows(parts: Sequence[PartKey], sizes: Mapping[str, int],
            most: int) -> Iterator[Sequence[PartKey]]:
    """`parts` in runs fetched together: up to `most` parts and WINDOW_BYTES (their listed
    `sizes`; at least one part), so that a few large compacted parts are not all held."""
    run: list[PartKey] = []
    held = 0
    for part in parts:
        size = sizes.get(part.key, 0)
        if run and (len(run) >= max(1, most) or held + size > WINDOW_BYTES):
            yield run
            run, held = [], 0
        run.append(part)
        held += size
    if run:
        yield run


def select_columns(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    return table if columns is None else table.select(list(columns))


def read_done_models(store: Store, keys: Sequence[str], *, threads: int = 8,
                     archs: Collection[str] | None = None,
                     on_damaged: Callable[[str, DamagedResult], None] = warn_damaged,
                     table: str | None = None,
                     check: Callable[[Marker], str | None] | None = None) -> list[DoneModel]:
    """The DoneModels of `keys` from their per-model files (marker, layers.csv), checked as
    every reader of those files checks them (a marker this version reads; a table whole as
    its marker seals it: controller.results.reader.read_table). A damaged model is left out
    and handed to on_damaged (default: its one line, warn_damaged); a marker gone since the
    listing, or without its table, is left out quietly (not done: the plan runs it again).
    table: another layer table of the model's folder (a refit's layers.<TAG>.csv). check:
    what a listing shows wrong with the files a marker seals (a damaged model, as `status`
    counts it: left out like the others)."""
    markers: list[tuple[Marker, int]] = []  # with the size of its bytes
    for key, data in zip(keys, fetch_all(store, [marker_key(k) for k in keys],
                                         threads=threads, limit=MARKER_BYTES), strict=True):
        if data is None:
            continue
        try:
            marker = load_marker(key, data)
        except MarkerError as e:
            on_damaged(key, DamagedResult(f"{marker_key(key)} is not a marker this "
                                          f"version reads: {e}"))
            continue
        problem = None if check is None else check(marker)
        if problem is not None:
            on_damaged(key, DamagedResult(problem))
        elif archs is None or arch_partition(marker.architecture) in archs:
            markers.append((marker, len(data)))
    names = [table or m.layers_name for m, _ in markers]
    blobs = fetch_all(store, [model_file_key(m.model_key, name)
                              for (m, _), name in zip(markers, names, strict=True)],
                      threads=threads, limit=TABLE_BYTES)
    done: list[DoneModel] = []
    for (marker, size), name, data in zip(markers, names, blobs, strict=True):
        if data is None:
            continue
        try:
            done.append(DoneModel(marker, read_table(marker, name, data), size))
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
