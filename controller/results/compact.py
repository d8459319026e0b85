"""`esd-sweep compact`: the results tables made whole and few.

Owns the four things compact does to a store's `_tables/` parts, in this order:
0. set aside: a part that cannot be read or is not of the schema
   (controller.results.tables) is moved, with the other table's part of its pair, under
   `_tables/_aside/` (never deleted: a person may want to look), so that its models are
   rebuilt by the next step;
1. add missing: done models (a marker) that no part holds are read from their per-model
   files and written as parts, a partition's rows buffered until a part is full (the tables
   of a store written before tables existed are built this way);
2. merge: in each architecture partition, the small parts (fewer than half the target's
   layer rows) are read oldest first and their rows that count (each model's newest row,
   controller.results.tables) written again as parts of up to the target size, a new part
   each time the next old part would not fit; then the merged parts are deleted;
3. orphans: a layers part without its models part (a writer killed between the two writes)
   is deleted once its id says it is more than ORPHAN_AGE_S old (a younger one may be a
   part being written now).
With --rebuild, step 1 writes every done model anew from its per-model files, and every
part listed before it began is then deleted. It does not own the part format or the keys
(esd_worker.core.store.tables) nor which row of a model counts (controller.results.tables).

Concurrency: compact takes no lease, so it may run while a sweep writes new parts. It only
deletes parts it merged (or, with --rebuild, parts listed at its start), never a part
written since, so no row is lost; a model that then sits both in a new part and in a part
compact wrote is counted once by readers (its newest row by finished_at, then part id).
A part is deleted models part first, then its layers part, and a new part is written layers
first: a reader never sees a models row without its layers. Two compacts at once lose
nothing either (at worst a model is written twice, and read once).

Memory: one partition's parts are read a few at a time; what is buffered is at most about
one target's rows (merge: whole old parts until the next would overflow; add missing: the
biggest partition's buffer is written when all of them hold more than a target) plus one
chunk of per-model files.
"""

from __future__ import annotations

import argparse
import calendar
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from controller.results.counting import Counted
from controller.results.parts import BadPart, pair_of, read_part, with_nulls
from controller.results.reader import open_results
from controller.results.tables import Tables, read_done_models
from esd_worker.core.command.flags import MAX_THREADS, add_flag, int_in
from esd_worker.core.store.layout import PART_BYTES, TABLES_PREFIX, fetch_all, iter_markers
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import (
    LAYERS_TABLE,
    MODELS_TABLE,
    PART_SUFFIX,
    SCHEMAS,
    TABLES,
    PartKey,
    parse_part_key,
    part_key,
    part_tables,
    table_prefix,
    write_part,
)

log = logging.getLogger(__name__)

TARGET_ROWS = 500_000  # layer rows a part (~100k-row row groups: a few MB zstd)
READ_CHUNK = 2_000  # models read from their per-model files at a time
ORPHAN_AGE_S = 3_600  # a layers part alone younger than this may be a part being written
_DRY = " (dry run: nothing written; merge planned on the parts there now)"


@dataclass(frozen=True)
class CompactSettings:
    results: str
    rebuild: bool = False
    target_rows: int = TARGET_ROWS
    threads: int = 8
    dry_run: bool = False


@dataclass(frozen=True)
class _Old:
    """A models part of the store and what its rows that count hold."""

    part: PartKey
    models: int  # its models rows that count
    rows: int  # their layer rows (from the models' `layers` counts)
    total: int  # its models rows


@dataclass
class CompactResult:
    parts_before: int = 0  # models parts
    parts_after: int = 0
    models_added: int = 0
    parts_written: int = 0
    parts_merged: int = 0
    orphans: int = 0
    set_aside: int = 0  # part pairs that could not be read, moved aside
    models: int = 0  # models rows written (added or merged)
    rows: int = 0  # layer rows written
    lines: list[str] = field(default_factory=list)


# -- writing parts, a partition's buffer at a time ---------------------------------------------


class _PartWriter:
    """Buffers tables per partition; writes a partition's part when it reaches the target
    (or the buffers together hold more than one target: the biggest goes first)."""

    def __init__(self, store: Store, target: int, result: CompactResult, *,
                 dry_run: bool) -> None:
        self.store, self.target, self.result, self.dry_run = store, target, result, dry_run
        self.buffers: dict[str, tuple[list[pa.Table], list[pa.Table]]] = {}
        self.rows: dict[str, int] = {}

    def add(self, arch: str, models: pa.Table, layers: pa.Table) -> None:
        if self.rows.get(arch, 0) and self.rows[arch] + layers.num_rows > self.target:
            self.flush(arch)
        bufs = self.buffers.setdefault(arch, ([], []))
        bufs[0].append(models)
        bufs[1].append(layers)
        self.rows[arch] = self.rows.get(arch, 0) + layers.num_rows
        if self.rows[arch] >= self.target:
            self.flush(arch)
        while sum(self.rows.values()) > self.target:
            self.flush(max(self.rows, key=lambda a: self.rows[a]))

    def flush(self, arch: str) -> None:
        models, layers = self.buffers.pop(arch, ([], []))
        self.rows.pop(arch, None)
        if not models:
            return
        m = pa.concat_tables(models).combine_chunks()
        ly = pa.concat_tables(layers).combine_chunks()
        if not self.dry_run:
            write_part(self.store, arch, m, ly)
        self.result.parts_written += 1
        self.result.models += m.num_rows
        self.result.rows += ly.num_rows

    def close(self) -> None:
        for arch in list(self.buffers):
            self.flush(arch)


# -- the steps ---------------------------------------------------------------------------------


def _listing(store: Store) -> list[PartKey]:
    """Every part of both tables (orphans included), as listed now."""
    return [part for table in TABLES for key in store.list_keys(table_prefix(table))
            if (part := parse_part_key(key)) is not None]


def add_done_models(store: Store, keys: Iterable[str], writer: _PartWriter, *,
                    threads: int) -> int:
    """Write these done models from their per-model files (READ_CHUNK at a time); how many
    were read (a marker gone since the listing, or unreadable, is left out)."""
    added = 0
    it = iter(keys)
    while chunk := list(itertools.islice(it, READ_CHUNK)):
        done = read_done_models(store, chunk, threads=threads)
        added += len(done)
        for arch, (models, layers) in part_tables(done).items():
            writer.add(arch, models, layers)
    return added


def _plan(tables: Tables) -> dict[str, list[_Old]]:
    """arch → its models parts, oldest first, with how many of their rows there are and how
    many count (read from the models parts only: a model's `layers` count is its layer
    rows)."""
    counted = tables.newest()
    plan: dict[str, list[_Old]] = {}
    for part, table in tables.read_parts(tables.parts(MODELS_TABLE),
                                         ["model_key", "finished_at", "layers"]):
        if table is None:  # gone (another compact) or left out: not merged
            continue
        kept = counted.keep(pair_of(part), table, MODELS_TABLE)
        rows = pc.sum(kept.column("layers")).as_py() or 0
        plan.setdefault(part.arch, []).append(_Old(part, kept.num_rows, rows,
                                                   table.num_rows))
    return plan


def _to_merge(olds: Sequence[_Old], target: int) -> list[_Old]:
    """The small parts of a partition, or none when merging would change nothing (a single
    small part whose rows all count)."""
    small = [old for old in olds if old.rows < target / 2]
    if len(small) == 1 and small[0].models == small[0].total:
        return []
    return small


def _groups(olds: Sequence[_Old], target: int) -> int:
    """How many parts merging `olds` in order writes (each closed before it overflows)."""
    groups, rows = 0, 0
    for old in olds:
        if rows and rows + old.rows > target:
            groups, rows = groups + 1, 0
        rows += old.rows
    return groups + (1 if rows else 0)


def merge_parts(store: Store, arch: str, olds: Sequence[_Old], tables: Tables,
                target: int, result: CompactResult, *, threads: int) -> None:
    """Write the rows that count of these parts (oldest first) as new parts, then delete
    the parts merged: models part first, so that a reader never sees a models row without
    its layers. A part that cannot be read now is left where it is (one line)."""
    writer = _PartWriter(store, target, result, dry_run=False)
    counted = tables.newest()
    merged: list[PartKey] = []
    window = max(1, min(threads, 4))  # a few small parts' bytes held at a time
    for start in range(0, len(olds), window):
        chunk = [old.part for old in olds[start:start + window]]
        keys = [k for p in chunk for k in (p.key, part_key(LAYERS_TABLE, p.arch, p.part_id))]
        blobs = fetch_all(store, keys, threads=threads, limit=PART_BYTES)
        for i, part in enumerate(chunk):
            models_data, layers_data = blobs[2 * i], blobs[2 * i + 1]
            if models_data is None or layers_data is None:
                log.warning("part %s gone since the listing: not merged", part.key)
                continue
            try:
                models = _whole(models_data, MODELS_TABLE, counted, pair_of(part))
                layers = _whole(layers_data, LAYERS_TABLE, counted, pair_of(part))
            except BadPart as e:
                log.warning("part %s not merged: %s", part.key, e)
                continue
            writer.add(arch, models, layers)
            merged.append(part)
    writer.close()
    for part in merged:
        store.delete(part.key)
        store.delete(part_key(LAYERS_TABLE, part.arch, part.part_id))
    result.parts_merged += len(merged)


def _whole(data: bytes, table: str, counted: Counted, pair: str) -> pa.Table:
    """A part's rows that count, with every column of the schema (an older part's missing
    optional columns as nulls)."""
    schema = SCHEMAS[table]
    got = counted.keep(pair, read_part(data, table), table)
    return with_nulls(got, schema.names, schema).select(schema.names).cast(schema)


def aside_key(part: PartKey) -> str:
    """Where compact sets a part aside: `_tables/_aside/<table>/arch=<A>/<id>.parquet`,
    a key no reader lists as a part."""
    return f"{TABLES_PREFIX}_aside/{part.table}/arch={part.arch}/{part.part_id}{PART_SUFFIX}"


def set_aside(store: Store, bad: dict[str, str], result: CompactResult, *,
              dry_run: bool) -> None:
    """Move the pairs that cannot be read aside, never deleting them: the layers part first,
    so that a compact killed between the two leaves a models part without its layers (left
    out by readers, set aside by the next compact), never a layers part alone (which step 3
    would delete)."""
    for pair in sorted(bad):
        arch, _, part_id = pair.partition("/")
        for table in (LAYERS_TABLE, MODELS_TABLE):
            part = PartKey(table, arch, part_id)
            if not dry_run:
                store.move(part.key, aside_key(part))
        log.info("part %s set aside (%s): %s", pair, "would be" if dry_run else "moved to "
                 + aside_key(PartKey(MODELS_TABLE, arch, part_id)), bad[pair])
    result.set_aside = len(bad)


def _part_age_s(part_id: str, now: float) -> float | None:
    """Seconds since the time a part id starts with (new_part_id); None without one."""
    try:
        written = calendar.timegm(time.strptime(part_id[:16], "%Y%m%dT%H%M%SZ"))
    except ValueError:
        return None
    return now - written


def _orphans(parts: Sequence[PartKey], now: float) -> list[PartKey]:
    """Layers parts without their models part, old enough not to be a part being written."""
    models = {(p.arch, p.part_id) for p in parts if p.table == MODELS_TABLE}
    return [p for p in parts if p.table == LAYERS_TABLE and (p.arch, p.part_id) not in models
            and (age := _part_age_s(p.part_id, now)) is not None and age > ORPHAN_AGE_S]


def compact_store(settings: CompactSettings, store: Store | None = None) -> CompactResult:
    """Add the missing models, merge the small parts, remove old orphans (or --rebuild);
    with dry_run, what it would do and nothing written."""
    store = store if store is not None else open_results(settings.results)
    target, threads, dry = settings.target_rows, settings.threads, settings.dry_run
    result = CompactResult()
    would = "would be " if dry else ""

    # 0. set aside the parts that cannot be read, so that step 1 rebuilds their models
    bad = Tables(store, threads=threads).check_parts()
    set_aside(store, bad, result, dry_run=dry)
    if bad:
        result.lines.append(f"set aside: {len(bad)} part(s) that cannot be read {would}"
                            f"moved under {TABLES_PREFIX}_aside/ (never deleted); their "
                            "models are rebuilt from their own files")
    before = [p for p in _listing(store) if not (dry and pair_of(p) in bad)]
    result.parts_before = sum(1 for p in before if p.table == MODELS_TABLE)

    # 1. add the models no part holds (all of them with --rebuild)
    writer = _PartWriter(store, target, result, dry_run=dry)
    keys: Iterator[str] = (iter_markers(store) if settings.rebuild
                           else Tables(store, threads=threads).missing_keys())
    result.models_added = add_done_models(store, keys, writer, threads=threads)
    writer.close()
    what = "every done model" if settings.rebuild else "models no part holds"
    result.lines.append(
        f"add: {what}: {result.models_added} model(s) {would}written as "
        f"{result.parts_written} part(s), {result.rows} layer rows")

    # --rebuild: the parts listed at the start go (models part first, then its layers)
    dropped = 0
    if settings.rebuild:
        for part in sorted(before, key=lambda p: p.table != MODELS_TABLE):
            if not dry:
                store.delete(part.key)
            dropped += part.table == MODELS_TABLE
        result.lines.append(f"rebuild: the {dropped} part(s) listed at the start {would}"
                            "deleted")

    # 2. merge the small parts of each partition
    if dry and settings.rebuild:
        result.lines.append("merge: nothing to plan before the rebuild is written")
    else:
        _merge_step(store, settings, result)

    # 3. orphan layers parts
    orphans = [] if settings.rebuild else _orphans(_listing(store) if not dry else before,
                                                   time.time())
    for part in orphans:
        if not dry:
            store.delete(part.key)
    result.orphans = len(orphans)
    result.lines.append(f"orphans: {len(orphans)} layers part(s) without their models part "
                        f"(older than {ORPHAN_AGE_S // 60} min) {would}deleted")

    result.parts_after = (result.parts_before + result.parts_written - result.parts_merged
                          - dropped)
    if not dry:
        result.parts_after = sum(1 for p in _listing(store) if p.table == MODELS_TABLE)
    result.lines.append(
        f"compact{_DRY if dry else ''}: parts {result.parts_before} → {result.parts_after}, "
        f"models added {result.models_added}, "
        f"{result.models} models rows and {result.rows} layer rows {would}written")
    return result


def _merge_step(store: Store, settings: CompactSettings, result: CompactResult) -> None:
    target, threads = settings.target_rows, settings.threads
    tables = Tables(store, threads=threads)
    plan = _plan(tables)
    merged = written = rows = 0
    partitions = 0
    for arch in sorted(plan):
        olds = _to_merge(plan[arch], target)
        if not olds:
            continue
        partitions += 1
        merged += len(olds)
        if settings.dry_run:
            written += _groups(olds, target)
            rows += sum(old.rows for old in olds)
            continue
        before_parts, before_rows = result.parts_written, result.rows
        merge_parts(store, arch, olds, tables, target, result, threads=threads)
        written += result.parts_written - before_parts
        rows += result.rows - before_rows
    if settings.dry_run:
        result.parts_merged += merged
        result.parts_written += written
    would = "would be " if settings.dry_run else ""
    result.lines.append(f"merge: {merged} small part(s) in {partitions} partition(s) {would}"
                        f"merged into {written} part(s), {rows} layer rows")


# -- the command -------------------------------------------------------------------------------


def add_compact_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--output-dir", "--output", "--results", required=True, metavar="URL",
             help="results location: a directory, file:// URL or s3://…")
    add_flag(parser, "--rebuild", action="store_true",
             help="write every done model anew from its per-model files, then delete every "
             "part that existed before")
    add_flag(parser, "--target-rows", type=int_in(1, 100_000_000), default=TARGET_ROWS,
             metavar="N", help=f"layer rows a part (default {TARGET_ROWS}); parts below half "
             "of it are merged")
    add_flag(parser, "--threads", type=int_in(1, MAX_THREADS), default=8, metavar="N",
             help="files fetched at once (default 8)")
    add_flag(parser, "--dry-run", action="store_true",
             help="say what compact would do; write and delete nothing")


def run_compact(args: argparse.Namespace) -> int:
    """`esd-sweep compact`: errors are raised (ResultsError: exit 2; StoreError: exit 3)."""
    result = compact_store(CompactSettings(
        results=args.output_dir, rebuild=args.rebuild, target_rows=args.target_rows,
        threads=args.threads, dry_run=args.dry_run))
    for line in result.lines:
        print(line)
    return 0
