"""Which rows of the results tables count: those the store's own files vouch for, one per
model.

Owns the rules (controller.results.tables applies them as it reads): a row is vouched for only
while one listing of the store (Listing) shows its model's marker and the files the marker
seals at the sizes the row recorded (`files`; an older part's row: the marker and layers.csv
listed), and its model_key could name a folder; of a model's vouched rows the one with the
latest finished_at, then the latest part, then the last in its part counts (Counted: the
models each part holds, the row of those it holds more than once, Pick). Knows nothing of
how parts are fetched.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from controller.keyset import Hashes, KeySet
from esd_worker.core.store.layout import (
    MARKER_NAME,
    LayoutError,
    check_model_key,
    iter_model_files,
)
from esd_worker.core.store.marker import LAYERS_NAME, Marker
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import LAYERS_TABLE


@dataclass(frozen=True)
class Pick:
    """The one row of a model that counts in a part that holds it more than once."""

    row: int  # its position in the models part
    finished_at: str  # the layers rows of the part that go with it


@dataclass
class Counted:
    """Which rows of the models parts count: one per model, a row its files vouch for.

    keys: the models with a row that counts; held: per part pair (pair_of), the sorted
    hashes of the models whose counted row is there (a part's rows of any other model do
    not count, in either table); picks: per pair, the models it holds more than once and the
    row of theirs that counts; rows: models rows read; bad: pairs left out, with why.
    """

    keys: KeySet = field(default_factory=KeySet)
    held: dict[str, np.ndarray] = field(default_factory=dict)
    picks: dict[str, dict[str, Pick]] = field(default_factory=dict)
    rows: int = 0
    bad: dict[str, str] = field(default_factory=dict)

    def keep(self, pair: str, table: pa.Table, name: str) -> pa.Table:
        """The rows of part `pair`'s `table` (MODELS_TABLE or LAYERS_TABLE: model_key and
        finished_at, and layer_index for layers, among its columns) that count."""
        held = self.held.get(pair)
        if held is None or not table.num_rows:
            return table.slice(0, 0)
        # A part holds each model's rows together: its few distinct keys are hashed, not
        # every row's (500k layer rows would be 500k Python strings).
        codes = pc.dictionary_encode(table.column("model_key")).combine_chunks()
        counts = np.isin(key_hashes(codes.dictionary.to_pylist()), held)
        indices = codes.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        mask = np.append(counts, False)[indices]  # a null key (-1) counts for nothing
        picks = self.picks.get(pair)
        if picks:
            keys = table.column("model_key").to_pylist()
            finished = table.column("finished_at").to_pylist()
            index = table.column("layer_index").to_pylist() if name == LAYERS_TABLE else None
            seen: set[tuple[str, Any]] = set()
            for i in np.flatnonzero(mask):
                pick = picks.get(keys[i])
                if pick is None:
                    continue
                if index is None:
                    mask[i] = i == pick.row
                else:  # that row's layers: its finished_at, one row per layer_index
                    ok = ((finished[i] or "") == pick.finished_at
                          and (keys[i], index[i]) not in seen)
                    if ok:
                        seen.add((keys[i], index[i]))
                    mask[i] = ok
        return table if mask.all() else table.filter(pa.array(mask))


class Listing:
    """What one listing of the store says of its model folders: (model, file, size) of
    every file as hashes, the models with a marker and layers.csv, and the marker keys
    spooled to a temporary file (read again by missing_keys, never held as strings)."""

    def __init__(self, store: Store) -> None:
        files, markers, tables = Hashes(), Hashes(), Hashes()
        # Closed when the object goes (a TemporaryFile removes itself): no `with`, since
        # missing_keys reads it again as long as the Tables lives.
        self.spool: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
        for key, name, size in iter_model_files(store):
            files.add(hash((key, name, size)))
            if name == MARKER_NAME:
                self.spool.write(key + "\n")
                markers.add(hash(key))
            elif name == LAYERS_NAME:
                tables.add(hash(key))
        whole = np.intersect1d(markers.unique(), tables.unique(), assume_unique=True)
        self.files = KeySet.of_hashes(files.sorted())
        self.whole = KeySet.of_hashes(array_of(whole))

    def marker_keys(self) -> Iterator[str]:
        self.spool.seek(0)
        for line in self.spool:
            yield line.rstrip("\n")

    def marker_keys_of(self, hashes: np.ndarray) -> Iterator[str]:
        """The marker keys whose key_hashes are among the sorted `hashes`, as listed."""
        keys = self.marker_keys()
        while chunk := list(itertools.islice(keys, 1 << 16)):
            for i in np.flatnonzero(np.isin(key_hashes(chunk), hashes)):
                yield chunk[i]

    def damage(self, marker: Marker) -> str | None:
        """What the listing shows wrong with the files `marker` seals (sealed_damage)."""
        return sealed_damage(marker.model_key, marker, self.files)

    def vouches(self, key: str, files: str | None) -> bool:
        """Whether the listing shows what a row of `key` recorded (`files`: its column)."""
        try:
            check_model_key(key)
        except LayoutError:
            return False
        if files is None:  # a part written before rows recorded their files
            return key in self.whole
        try:
            sizes = json.loads(files)
        except ValueError:
            return False
        if not isinstance(sizes, dict) or MARKER_NAME not in sizes:
            return False
        return all(isinstance(size, int) and (key, name, size) in self.files
                   for name, size in sizes.items())


def sealed_damage(key: str, marker: Marker, listed: KeySet) -> str | None:
    """What a listing (`listed`: hashes of (model_key, file, size)) shows wrong with the files
    `marker` seals in folder `key` (None: each is listed at its sealed size). The one check
    `status` (controller.run.plan) and the tables' fallback share."""
    for name in marker.vouched_names():
        seal = marker.files.get(name)
        if seal is not None and (key, name, seal.size) not in listed:
            return f"{name} is missing or not the {seal.size} bytes its marker vouches for"
    return None


def array_of(values: np.ndarray) -> array[int]:
    """Sorted int64 hashes as KeySet holds them."""
    return array("q", values.astype(np.int64).tobytes())


def key_hashes(keys: Sequence[str | None]) -> np.ndarray:
    return np.fromiter((hash(k) for k in keys), dtype=np.int64, count=len(keys))
