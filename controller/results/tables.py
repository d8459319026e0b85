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

Memory: a few parts' bytes and one decoded part, 16 bytes a counted row for the choice of
rows (its key's hash, its part, its position), the listing as 8-byte hashes of (model,
file, size), and the marker keys of the listing spooled to a temporary file (millions of
keys are never held as strings).

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
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from controller.keyset import KeySet
from controller.results.counting import (
    KEEP,
    Counted,
    Listing,
    Pick,
    apply_rules,
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
from esd_worker.core.store.stores import Store
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
FALLBACK_CHUNK = 512  # models read from their own files at a time


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
                for key in self.store.list_keys(table_prefix(name)):
                    part = parse_part_key(key)
                    if part is not None and (self.archs is None or part.arch in self.archs):
                        found[name].append(part)
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
                   ) -> Iterator[tuple[PartKey, pa.Table]]:
        """Each part read whole (its `columns`), fetched a few ahead of the reader (stores
        may be remote); a part that cannot be read, or a pair already left out, is skipped
        (one line the first time)."""
        window = max(1, self.threads)
        for start in range(0, len(parts), window):
            chunk = [p for p in parts[start:start + window] if pair_of(p) not in self._bad]
            blobs = fetch_all(self.store, [p.key for p in chunk], threads=self.threads,
                              limit=PART_BYTES)
            for part, data in zip(chunk, blobs, strict=True):
                if data is None:  # merged away by compact since the listing, or refused
                    continue
                try:
                    yield part, read_part(data, part.table, columns)
                except BadPart as e:
                    self._leave_out(part, str(e))

    def check_parts(self) -> dict[str, str]:
        """Read every part of both tables whole: the pairs that cannot be read (bad)."""
        for table in (MODELS_TABLE, LAYERS_TABLE):
            for _ in self.read_parts(self.parts(table)):
                pass
        return self.bad

    # -- which rows count --------------------------------------------------------------------

    def newest(self) -> Counted:
        """Which rows count (see the module's docstring). One pass over the models parts;
        16 bytes a row vouched for are held, and finished_at only of the models met in more
        than one row (a second pass over the parts that hold them)."""
        if self._counted is not None:
            return self._counted
        listing = self.listing()
        parts = self.parts(MODELS_TABLE)
        rules: dict[str, dict[str, Pick | None]] = {}
        hashes: list[np.ndarray] = []
        where: list[np.ndarray] = []  # (part index, row) of each row vouched for
        rows = 0
        index = {pair_of(p): i for i, p in enumerate(parts)}
        # Every column read (a models part is small): a part that fails anywhere fails here,
        # before any of its rows is counted, not later in models().
        for part, table in self.read_parts(parts):
            keys = table.column("model_key").to_pylist()
            files = (table.column("files").to_pylist() if "files" in table.column_names
                     else [None] * len(keys))
            rows += len(keys)
            ok = [i for i, (key, fs) in enumerate(zip(keys, files, strict=True))
                  if key is not None and listing.vouches(key, fs)]
            for i in set(range(len(keys))) - set(ok):
                if keys[i] is not None:
                    rules.setdefault(pair_of(part), {})[keys[i]] = None
            hashes.append(key_hashes([keys[i] for i in ok]))
            where.append(np.array([(index[pair_of(part)], i) for i in ok],
                                  dtype=np.int32).reshape(-1, 2))
        counted = Counted(rows=rows, rules=rules)
        if hashes:
            h, at = np.concatenate(hashes), np.concatenate(where)
            unique, counts = np.unique(h, return_counts=True)
            counted.keys = KeySet.of_hashes(array_of(unique))
            repeated = unique[counts > 1]
            if len(repeated):  # some model in more than one row
                hit = np.isin(h, repeated)
                self._pick(rules, [parts[i] for i in np.unique(at[hit][:, 0])], repeated)
        counted.bad = self._bad
        self._counted = counted
        return counted

    def _pick(self, rules: dict[str, dict[str, Pick | None]], parts: Sequence[PartKey],
              repeated: np.ndarray) -> None:
        """Add to `rules` the rows that do not count of the models met more than once:
        each model's row with the latest finished_at (ISO text sorts as time), then the
        latest part (ids sort by when written), then the last in its part."""
        rows: list[tuple[str, str, int, int, str]] = []  # key, finished_at, rank, row, pair
        for rank, (part, table) in enumerate(self.read_parts(
                parts, ["model_key", "finished_at", "files"])):
            keys = table.column("model_key").to_pylist()
            finished = table.column("finished_at").to_pylist()
            gone = rules.get(pair_of(part), {})
            for i in np.flatnonzero(np.isin(key_hashes(keys), repeated)):
                if gone.get(keys[i], KEEP) is not None:  # a row vouched for
                    rows.append((keys[i], finished[i] or "", rank, int(i), pair_of(part)))
        best: dict[str, tuple[str, int, int, str]] = {}
        for key, finished, rank, row, pair in rows:
            if key not in best or (finished, rank, row) > best[key][:3]:
                best[key] = (finished, rank, row, pair)
        for key, _finished, _rank, _row, pair in rows:
            finished, _, row, won = best[key]
            rules.setdefault(pair, {})[key] = Pick(row, finished) if pair == won else None

    # -- rows --------------------------------------------------------------------------------

    def models(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The models rows that count (MODEL_SCHEMA's columns, or `columns`)."""
        yield from self._rows(MODELS_TABLE, columns, fallback)
        if fallback:
            for models, _ in self._fallback():
                yield from select_columns(models, columns).to_batches(BATCH_ROWS)

    def layers(self, columns: Sequence[str] | None = None, *,
               fallback: bool = True) -> Iterator[pa.RecordBatch]:
        """The layers rows of the models rows that count (LAYER_SCHEMA's columns)."""
        yield from self._rows(LAYERS_TABLE, columns, fallback)
        if fallback:
            for _, layers in self._fallback():
                yield from select_columns(layers, columns).to_batches(BATCH_ROWS)

    def _rows(self, table: str, columns: Sequence[str] | None,
              fallback: bool) -> Iterator[pa.RecordBatch]:
        counted = self.newest()
        schema = SCHEMAS[table]
        wanted = list(columns) if columns is not None else schema.names
        extra = ["model_key", "finished_at"] + (["layer_index"] if table == LAYERS_TABLE
                                                else [])
        read = [*wanted, *(c for c in extra if c not in wanted)]
        for part in self.parts(table):
            pair = pair_of(part)
            if pair in self._bad:
                continue
            got = next(self.read_parts([part], read), None)
            if got is None:
                if pair in self._bad and table == LAYERS_TABLE and fallback:
                    yield from self._pair_from_files(part, columns)
                continue
            kept = apply_rules(got[1], counted.rules.get(pair), table)
            kept = with_nulls(kept, wanted, schema).select(wanted)
            yield from kept.to_batches(BATCH_ROWS)

    def _pair_from_files(self, part: PartKey, columns: Sequence[str] | None,
                         ) -> Iterator[pa.RecordBatch]:
        """The layers rows of the models a left-out layers part held (their models rows
        counted already), read from their own files."""
        models = PartKey(MODELS_TABLE, part.arch, part.part_id)
        data = fetch_all(self.store, [models.key], limit=PART_BYTES)[0]
        if data is None:
            return
        try:
            table = read_part(data, MODELS_TABLE, ["model_key", "finished_at"])
        except BadPart:
            return
        keys = apply_rules(table, self.newest().rules.get(pair_of(part)),
                      MODELS_TABLE).column("model_key").to_pylist()
        for start in range(0, len(keys), FALLBACK_CHUNK):
            done = read_done_models(self.store, keys[start:start + FALLBACK_CHUNK],
                                    threads=self.threads, on_damaged=self._damaged,
                                    check=self.listing().damage)
            for _, layers in part_tables(done).values():
                yield from select_columns(layers, columns).to_batches(BATCH_ROWS)

    def missing_keys(self) -> Iterator[str]:
        """The keys of done models (a marker) that no counted row holds, as the listing
        went."""
        held = self.newest().keys
        return (key for key in self.listing().marker_keys() if key not in held)

    def _fallback(self) -> Iterator[tuple[pa.Table, pa.Table]]:
        """(models, layers) tables of the models no part holds, FALLBACK_CHUNK at a time."""
        missing = self.missing_keys()
        while chunk := list(itertools.islice(missing, FALLBACK_CHUNK)):
            done = read_done_models(self.store, chunk, threads=self.threads,
                                    archs=self.archs, on_damaged=self._damaged,
                                    check=self.listing().damage)
            yield from part_tables(done).values()


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
