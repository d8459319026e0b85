"""summary.csv: one row per done model, its columns and encoding, and its first rows as text.

Per-model statistics come from the marker's summary (written by the worker) or, for markers
without one, from esd_worker.core.store.results.summarize_layers over the model's layer table; this
module computes no statistics of its own. A run rebuilds summary.csv without reading again
the markers its plan already read (`KnownMarkers`), and takes the other models' rows from the
results tables (controller.results.tables), a bucket of the list at a time: only the markers
of models no table holds yet are fetched. Does not own the run report
(runs/<run_id>.json: controller.run.runs) nor where summary.csv lies (esd_worker.core.store.layout).
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.compute as pc

from controller.keyset import KeySet, SeenKeys
from controller.results.reader import ModelResult
from controller.results.tables import Tables, rows_of
from esd_worker.core.command.presets import band_applies, fit_label
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import (
    SUMMARY_BYTES,
    SUMMARY_KEY,
    TABLE_BYTES,
    iter_markers,
    model_file_key,
    read_markers,
    summary_key,
)
from esd_worker.core.store.marker import Marker, canonical_parameters
from esd_worker.core.store.results import (
    SUMMARY_FIELDS,
    csv_parts,
    layers_from_csv,
    summarize_layers,
    table_to_csv,
)
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import MODELS_TABLE, marker_part, parameters_text

# The statistics a marker's summary holds (and summarize_layers returns), defined by the worker.
STAT_COLUMNS: tuple[str, ...] = SUMMARY_FIELDS
# What of the checkpoint the model's rows cover, from the marker's coverage
# (esd_worker.core.store.tables.coverage_cells): empty for markers written before it, and
# for rows of table parts written before these columns.
COVERAGE_COLUMNS: tuple[str, ...] = ("params_analysed_share", "tensors_skipped")
SUMMARY_COLUMNS: tuple[str, ...] = (
    "model_id",
    "revision",
    "model_key",
    "relation",
    "source_model",
    *STAT_COLUMNS,
    *COVERAGE_COLUMNS,
    "device",
    "total_s",
    "finished_at",
)
# The columns format_summary_table shows: who, then the headline statistics (the share in
# WeightWatcher's band only where the band applies: BAND_COLUMN).
BAND_COLUMN = "alpha_in_2_6_share"
TABLE_COLUMNS: tuple[str, ...] = (
    "model_id", "relation", "layers", "alpha_mean", "alpha_median", "alpha_in_2_6_share",
    "stable_rank_mean", "log_spectral_norm_mean",
)


def _stats(row: ModelRow, marker: Marker, store: Store) -> Mapping[str, Any]:
    if marker.summary is not None:
        return marker.summary
    data = store.get_bytes(model_file_key(marker.model_key or row.key, marker.layers_name),
                           limit=TABLE_BYTES)
    if data is None:
        return {}
    return summarize_layers(layers_from_csv(data))


def summary_row(row: ModelRow, marker: Marker, store: Store) -> dict[str, Any]:
    """One summary.csv row (SUMMARY_COLUMNS) for a done model.

    Statistics from the marker's summary when present, else computed from its layer table
    (empty when neither is there). Identity columns come from the model list, falling back
    to the marker.
    """
    return _with_row(row, marker_part(marker, _stats(row, marker, store)))


def _with_row(row: ModelRow, part: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model_id": row.model_id,
        "revision": row.revision,
        "model_key": part["model_key"] or row.key,
        "relation": row.relation or part["relation"],
        "source_model": row.source_model or part["base_model"],
        **{col: part.get(col) for col in (*STAT_COLUMNS, *COVERAGE_COLUMNS)},
        "device": part["device"],
        "total_s": part["total_s"],
        "finished_at": part["finished_at"],
    }


class KnownMarkers:
    """The summary parts of markers already read (by the run's plan), so that summary.csv is
    rebuilt without reading them again. Held as compact JSON, ~0.5 kB a model: a plan reads
    at most controller.run.plan.VERIFY_LIMIT markers. Only markers with their own summary are
    kept (older ones need their layer table read)."""

    def __init__(self) -> None:
        self._parts: dict[str, bytes] = {}

    def add(self, marker: Marker) -> None:
        if marker.summary is not None:
            part = marker_part(marker, marker.summary)
            self._parts[marker.model_key] = json.dumps(part, separators=(",", ":")).encode()

    def get(self, key: str) -> dict[str, Any] | None:
        data = self._parts.get(key)
        return None if data is None else dict(json.loads(data))

    def __contains__(self, key: object) -> bool:
        return key in self._parts


def summary_rows(
    results: Sequence[ModelResult], store: Store, *, recompute: bool = False
) -> list[dict[str, Any]]:
    """summary.csv rows (SUMMARY_COLUMNS), one per result.

    recompute: statistics from the rows held (a refit table) instead of the marker's summary.
    """
    rows = []
    for r in results:
        marker = r.marker
        if recompute or marker.summary is None:
            marker = dataclasses.replace(marker, summary=summarize_layers(r.rows))
        rev = marker.revision
        model = ModelRow(
            model_id=r.model_id,
            revision=str(rev) if rev else None,
            relation=marker.relation,
            source_model=None,
        )
        rows.append(summary_row(model, marker, store))
    return rows


def _cell(value: Any) -> str:
    """None and NaN as empty cells; floats in full precision."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "" if not math.isfinite(value) else repr(value)
    return str(value)


def summary_to_csv(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """The CSV of `rows`: SUMMARY_COLUMNS, one line per row, cells as _cell encodes them."""
    return table_to_csv(SUMMARY_COLUMNS, rows, lambda value, _column: _cell(value))


# Up to this many models to look up, their markers are fetched directly (a missing one is
# not done); beyond, one listing of the store first says which exist (S3: 1000 keys a request).
DIRECT_LOOKUPS = 10_000
# Listed models whose markers are read (concurrently) and turned into rows at a time: what
# write_summary holds, whatever the list's length (~6 kB a marker, its row, a CSV part).
CHUNK_MODELS = 1024
# With tables, rows are matched to the models table a bucket at a time: one pass over its
# (model_key, parameters, summary_part) columns a bucket, ~1 kB held a model of the bucket.
BUCKET_MODELS = 250_000


def write_summary(
    store: Store,
    models: Iterable[ModelRow],
    *,
    threads: int = 16,
    parameters: Mapping[str, Any] | None = None,
    known: KnownMarkers | None = None,
    direct_lookups: int = DIRECT_LOOKUPS,
    chunk: int = CHUNK_MODELS,
    bucket: int = BUCKET_MODELS,
) -> int:
    """Write summary.csv for the done models of `models`, in list order; returns the row count.

    A model counts when its marker exists (and, when `parameters` is given, holds those
    parameters). known: markers the caller read and found done (with those parameters),
    not read again. The others come from the results tables (controller.results.tables:
    each model's row there holds its summary part), `bucket` models of the list at a time;
    what no table holds from its marker, read concurrently `chunk` at a time, found by one
    listing once more than `direct_lookups` were looked for. Streams: rows are written as
    they are found (Store.put_parts), so memory does not grow with the list beyond 8 bytes a
    model (the first row of each key wins: controller.keyset.SeenKeys) and a bucket's rows
    and parts.
    """
    known = KnownMarkers() if known is None else known
    # Compared as stored, canonicalised once (not per marker: lists of 10^5 models).
    expected = None if parameters is None else canonical_parameters(parameters)
    tables = _TableParts.of(store, expected, threads=threads)
    rows = _Rows(store, known, expected, tables, threads=threads, chunk=chunk,
                 bucket=bucket if tables is not None else chunk, direct_lookups=direct_lookups)
    store.put_parts(summary_key(), csv_parts(
        SUMMARY_COLUMNS, rows.of(_first_of_each_key(models)),
        lambda value, _column: _cell(value)))
    return rows.count


def _first_of_each_key(models: Iterable[ModelRow]) -> Iterator[ModelRow]:
    seen = SeenKeys()
    return (model for model in models if seen.add(model.key))


class _TableParts:
    """The summary parts the models table holds (the newest row of each model, with the
    expected parameters), found for a bucket of keys in one pass over three columns."""

    def __init__(self, tables: Tables, expected: Mapping[str, Any] | None) -> None:
        self.tables = tables
        self.expected = None if expected is None else parameters_text(expected)
        self.keys = tables.newest().keys

    @classmethod
    def of(cls, store: Store, expected: Mapping[str, Any] | None, *,
           threads: int) -> _TableParts | None:
        """None when the store has no tables (written before them, or not compacted)."""
        tables = Tables(store, threads=threads)
        return cls(tables, expected) if tables.parts(MODELS_TABLE) else None

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def parts(self, keys: Sequence[str]) -> dict[str, str]:
        """model_key → its summary part (JSON) of those of `keys` the tables hold."""
        if not keys:
            return {}
        wanted = set(keys)
        found: dict[str, str] = {}
        for batch in self.tables.models(["model_key", "parameters", "summary_part"],
                                        fallback=False):
            rows = rows_of(batch, wanted)
            if self.expected is not None:
                rows = rows.filter(pc.equal(rows.column(1), self.expected))
            found.update(zip(rows.column(0).to_pylist(), rows.column(2).to_pylist(),
                             strict=True))
        return found


class _Rows:
    """summary.csv's rows of listed models: from what the caller read, the tables, or their
    markers, read a chunk at a time."""

    def __init__(self, store: Store, known: KnownMarkers, expected: Mapping[str, Any] | None,
                 tables: _TableParts | None, *, threads: int, chunk: int, bucket: int,
                 direct_lookups: int) -> None:
        self.store, self.known, self.expected = store, known, expected
        self.present: KeySet | None = None
        self.tables, self.direct_lookups, self.lookups = tables, direct_lookups, 0
        self.threads, self.chunk, self.bucket = threads, chunk, max(bucket, chunk)
        self.count = 0

    def of(self, models: Iterable[ModelRow]) -> Iterator[dict[str, Any]]:
        models = iter(models)
        while bucket := list(itertools.islice(models, self.bucket)):
            tabled: dict[str, str] = {}
            if self.tables is not None:
                tabled = self.tables.parts([m.key for m in bucket if m.key not in self.known
                                            and m.key in self.tables])
            for start in range(0, len(bucket), self.chunk):
                for row in self._chunk(bucket[start:start + self.chunk], tabled):
                    self.count += 1
                    yield row

    def _chunk(self, chunk: Sequence[ModelRow],
               tabled: Mapping[str, str]) -> Iterator[dict[str, Any]]:
        unknown = [m.key for m in chunk if m.key not in self.known and m.key not in tabled]
        if self.present is None and self.lookups + len(unknown) > self.direct_lookups:
            # Past direct_lookups markers to look for, one listing says which exist.
            self.present = KeySet(iter_markers(self.store))
        if self.present is not None:
            unknown = [key for key in unknown if key in self.present]
        self.lookups += len(unknown)
        markers = read_markers(self.store, unknown, threads=self.threads)
        done: list[tuple[ModelRow, Marker]] = []
        for model in chunk:
            marker = markers.get(model.key)
            if marker is not None and (self.expected is None
                                       or marker.parameters == self.expected):
                done.append((model, marker))
        fresh = dict(zip((m.key for m, _ in done), self._summary_rows(done), strict=True))
        for model in chunk:
            part = self.known.get(model.key)
            if part is not None:
                yield _with_row(model, part)
            elif model.key in tabled:
                yield _with_row(model, json.loads(tabled[model.key]))
            elif model.key in fresh:
                yield fresh[model.key]

    def _summary_rows(self, done: Sequence[tuple[ModelRow, Marker]]) -> list[dict[str, Any]]:
        """summary_row of each; concurrently when some marker has no summary (older markers:
        their layer table is read from the store)."""
        if all(marker.summary is not None for _, marker in done):
            return [summary_row(model, marker, self.store) for model, marker in done]
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(done)))) as pool:
            return list(pool.map(lambda item: summary_row(item[0], item[1], self.store), done))


def format_summary_table(store: Store, limit: int = 20, *,
                         parameters: Mapping[str, Any] | None = None) -> str:
    """The first rows of summary.csv as an aligned text table, for people at a terminal.

    Reads the file as a stream: its first `limit` rows are kept, the others only counted
    (a summary of millions of rows is hundreds of MB). parameters: the analysis settings
    the summary's models were fitted with (a run's): a line above the table says the fit,
    and alpha_in_2_6_share is left out where WeightWatcher's band does not apply (the CSV
    keeps the column)."""
    parts = store.get_parts(SUMMARY_KEY, limit=SUMMARY_BYTES)
    reader = csv.DictReader(_lines(parts or iter(())))
    head = list(itertools.islice(reader, limit))
    if reader.fieldnames is None:
        return f"(no {SUMMARY_KEY} yet)"
    more = sum(1 for _ in reader)
    cols = list(TABLE_COLUMNS)
    fit: list[str] = []
    if parameters is not None:
        fit = ["fit: " + fit_label(parameters).removeprefix("fit ")]
        if not band_applies(parameters.get("fix_fingers")):
            cols.remove(BAND_COLUMN)
    table = [cols] + [[_short(r.get(c, "")) for c in cols] for r in head]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = fit + ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                   for line in table]
    if more:
        lines.append(f"... {more} more in {SUMMARY_KEY}")
    return "\n".join(lines)


def _lines(parts: Iterable[bytes]) -> Iterator[str]:
    """The lines (ends kept) of UTF-8 text that comes in parts cut anywhere."""
    held = ""
    for text in codecs.iterdecode(parts, "utf-8"):
        held += text
        *whole, held = held.split("\n")
        for line in whole:
            yield line + "\n"
    if held:
        yield held


def _short(value: str) -> str:
    """A number to 3 decimals (integers as such); text cut to its last 48 characters."""
    try:
        f = float(value)
    except ValueError:
        return value if len(value) <= 48 else "…" + value[-47:]
    return f"{f:.3f}" if not f.is_integer() else str(int(f))
