"""Reading a results store as a whole: every model's marker and layer table, and adapters' bases.

Shared by report, refit and compare. Owns how a results location is opened (a missing one is
a ResultsError), which layer table a tag names, the `ModelResult` they all work on, and how
an adapter finds its base among the results, and that nothing damaged is read as a result:
a table or eigenvalue file that is not what its marker seals (size, SHA-256), does not parse,
or lacks layers the marker counts leaves its model out with one warning line (DamagedResult).
Key names and seals come from esd_worker.core.store.layout; this module writes nothing and computes
no
metrics.
"""

from __future__ import annotations

import binascii
import csv
import json
import logging
import math
import re
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controller.errors import ResultsError
from esd_worker.core.echo import echo
from esd_worker.core.models.naming import model_key, split_model_ref
from esd_worker.core.redact import redact
from esd_worker.core.store.layout import (
    DOCUMENT_BYTES,
    EIGS_BYTES,
    EIGS_NAME,
    MARKER_BYTES,
    TABLE_BYTES,
    fetch_all,
    get_checked,
    is_tag,
    layers_name,
    list_markers,
    load_marker,
    marker_key,
    model_file_key,
    refit_record_key,
)
from esd_worker.core.store.marker import LAYERS_NAME, DamagedResult, Marker, MarkerError, check_data
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import eigs_from_npz, layers_from_csv
from esd_worker.core.store.stores import LocalStore, Store

log = logging.getLogger(__name__)

UNLABELLED = "unlabelled"  # models listed without a base_model_relation
# Relations in the order people read them: a base first, then what derives from it.
KNOWN_RELATIONS = ("base", "finetune", "adapter", "lora", "peft", "quantized", "merge")


def check_tag(tag: str) -> str:
    """`tag` when it is a valid table tag (letters, digits, . _ + -), else ResultsError."""
    if not is_tag(tag):
        raise ResultsError(
            f"invalid tag {tag!r}: use 1-100 letters, digits, '.', '_', '+' or '-', "
            "starting with a letter or digit"
        )
    return tag


def table_name(tag: str | None = None) -> str:
    """layout.layers_name, with a bad tag a ResultsError (exit 2): tags come from flags."""
    return LAYERS_NAME if not tag else layers_name(check_tag(tag))


def read_refit_record(store: Store, tag: str) -> dict[str, Any] | None:
    """The record of refit `tag` (None when missing or unreadable)."""
    data = get_checked(store, refit_record_key(check_tag(tag)), DOCUMENT_BYTES)
    if data is None:
        return None
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def open_results(url: str) -> Store:
    """The store at `url`, which must exist: a missing local directory is a ResultsError.

    Remote stores are not contacted here; their errors come with the first listing
    (StoreError: exit 3).
    """
    store = open_store(url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise ResultsError(f"no results at {url}: no such directory")
    return store


@dataclass(frozen=True)
class ModelResult:
    """One analysed model: its marker (result.json) and the rows of one of its layer tables.

    rows: layers.csv (or layers.<tag>.csv) as strings, in the worker's layer order.
    """

    key: str
    marker: Marker
    rows: list[dict[str, str]] = field(repr=False)

    @property
    def model_id(self) -> str:
        return self.marker.model_id or self.marker.model or self.key

    @property
    def name(self) -> str:
        """A short name for plots and pages: the last two path segments of the id, @revision
        kept; shown as untrusted text (esd_worker.core.echo: a local path may hold an escape
        sequence, an id a token), redacted before the cut so no part of a secret is kept."""
        rev = self.marker.revision
        return echo(short_name(redact(self.model_id if not rev else f"{self.model_id}@{rev}")))

    @property
    def relation(self) -> str:
        """base_model_relation from the marker; adapters without one are "adapter"."""
        relation = self.marker.relation.lower()
        if not relation and self.marker.adapter is not None:
            relation = "adapter"
        return relation or UNLABELLED

    @property
    def base_ref(self) -> str | None:
        """The adapter's base as the worker resolved it (marker base_model.model), or None."""
        base = self.marker.base_model
        return base.model if base is not None and base.model else None

    @property
    def parameters(self) -> Mapping[str, Any]:
        return self.marker.parameters


def relation_order(relation: str) -> tuple[int, str]:
    """Sort key of a relation: KNOWN_RELATIONS in their order, then the others by name."""
    known = KNOWN_RELATIONS
    return (known.index(relation) if relation in known else len(known), relation)


def short_name(model_id: str, limit: int = 48) -> str:
    """`org/name` of a hub id; the last two segments of a local path; at most `limit` chars."""
    parts = [p for p in re.split(r"[/\\]+", model_id) if p]
    text = "/".join(parts[-2:]) if parts else model_id
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def read_model_markers(
    store: Store, *, keys: Iterable[str] | None = None, threads: int = 16
) -> dict[str, Marker]:
    """model_key → marker of every model of the store (or of `keys`), sorted by key.

    No marker at all, or a key in `keys` without one, is a ResultsError; a marker that is
    not one this version reads (esd_worker.core.store.layout.load_marker: malformed, a name that is
    a
    path, another folder's) leaves its model out with one warning line, as damage does.
    """
    present = list_markers(store)
    if not present:
        raise ResultsError(f"no results in {store.url}: no <model_key>/result.json found")
    wanted = sorted(present)
    if keys is not None:
        asked = list(dict.fromkeys(keys))
        missing = [k for k in asked if k not in present]
        if missing:
            raise ResultsError(
                f"no result for model key(s) {', '.join(missing)} in {store.url}"
            )
        wanted = sorted(asked)
    markers: dict[str, Marker] = {}
    blobs = fetch_all(store, [marker_key(k) for k in wanted], threads=threads,
                      limit=MARKER_BYTES)
    for key, data in zip(wanted, blobs, strict=True):
        if data is None:  # deleted since the listing
            continue
        try:
            markers[key] = load_marker(key, data)
        except MarkerError as e:
            warn_damaged(key, DamagedResult(f"{marker_key(key)} is not a marker this version "
                                            f"reads: {e}"))
    return markers


def iter_results(
    store: Store,
    markers: Mapping[str, Marker],
    order: Sequence[str],
    *,
    tag: str | None = None,
    threads: int = 16,
    chunk: int = 256,
) -> Iterator[ModelResult]:
    """The models of `order` with their layer table, read `chunk` at a time (concurrently), so
    that a store of any size is held in memory one chunk at a time. Models without that
    table are left out with one warning at the end; a damaged table (see read_table) leaves
    its model out with one warning line each."""
    missing: list[str] = []
    for start in range(0, len(order), chunk):
        keys = order[start:start + chunk]
        blobs = fetch_all(store, [model_file_key(k, _table_of(markers[k], tag)) for k in keys],
                          threads=threads, limit=TABLE_BYTES)
        for key, data in zip(keys, blobs, strict=True):
            if data is None:
                missing.append(key)
                continue
            try:
                rows = read_table(markers[key], _table_of(markers[key], tag), data)
            except DamagedResult as e:
                warn_damaged(key, e)
                continue
            yield ModelResult(key, markers[key], rows)
    if missing:
        log.warning("%d model(s) without %s left out: %s", len(missing), table_name(tag),
                    ", ".join(missing[:5]))


def read_table(marker: Marker, name: str, data: bytes) -> list[dict[str, str]]:
    """The rows of the model's table `name`; DamagedResult when the bytes are not what the
    marker seals, do not parse as a table, or hold another number of layers than the
    marker's layer_count (a truncated table of a marker written without seals)."""
    check_data(marker, name, data)
    try:
        rows = layers_from_csv(data)
    except (UnicodeDecodeError, csv.Error) as e:
        raise DamagedResult(f"{name} is not a readable table ({type(e).__name__})") from e
    if marker.layer_count is not None and len(rows) != marker.layer_count:
        raise DamagedResult(f"{name} has {len(rows)} layer row(s), its marker counts "
                            f"{marker.layer_count}")
    return rows


def warn_damaged(key: str, e: DamagedResult) -> None:
    """The one line a damaged model gets when a command leaves it out."""
    log.warning("model_key=%s left out: %s; delete %s and `esd-sweep run` analyses it again",
                key, e, marker_key(key))


def _table_of(marker: Marker, tag: str | None) -> str:
    """The table a model is read from: the tag's, else the one its marker names."""
    return table_name(tag) if tag else marker.layers_name


def no_table_error(store: Store, tag: str | None) -> ResultsError:
    """No model has the table `tag` names; for a tag, how to make it."""
    hint = f": run `esd-sweep refit --tag {tag}` first" if tag else ""
    return ResultsError(f"no {table_name(tag)} in {store.url}{hint}")


def load_results(
    store: Store,
    *,
    tag: str | None = None,
    keys: Iterable[str] | None = None,
    threads: int = 16,
) -> list[ModelResult]:
    """Every model of the store (or of `keys`) with a marker and the layer table `tag`
    names, sorted by key, all in memory (iter_results reads a chunk at a time).

    A model without that table is left out with a warning; no model at all is a
    ResultsError.
    """
    markers = read_model_markers(store, keys=keys, threads=threads)
    results = list(iter_results(store, markers, list(markers), tag=tag, threads=threads))
    if not results:
        raise no_table_error(store, tag)
    return results


def read_eigs(store: Store, result: ModelResult) -> dict[str, np.ndarray] | None:
    """The model's stored eigenvalues by layer name, or None without eigs.npz.

    A marker that names no eigenvalue file is still looked up under eigs.npz: markers
    written before `outputs` existed name none. DamagedResult when the file the marker
    names is missing, is not what it seals, or is not a readable .npz.
    """
    name = result.marker.eigs_name or EIGS_NAME
    data = store.get_bytes(model_file_key(result.key, name), limit=EIGS_BYTES)
    if data is None and result.marker.eigs_name is None:
        return None
    return parse_eigs(result.marker, name, data)


def parse_eigs(marker: Marker, name: str, data: bytes | None) -> dict[str, np.ndarray]:
    """The eigenvalues in `data`, the model's file `name`; DamagedResult when it is missing,
    is not what the marker seals, or is not a readable .npz."""
    check_data(marker, name, data)
    assert data is not None  # check_data raised otherwise
    try:
        return eigs_from_npz(data)
    except (zipfile.BadZipFile, zlib.error, binascii.Error, EOFError, OSError, KeyError,
            ValueError) as e:  # what np.load and zipfile raise for a corrupt archive
        raise DamagedResult(f"{name} is not a readable .npz ({type(e).__name__})") from e


def find_base_key(
    result: ModelResult, by_model: Mapping[str, str], present: Iterable[str]
) -> str | None:
    """model_key of an adapter's base in the same store, or None (not an adapter, not there).

    by_model: marker "model" (the reference the worker was given) → model_key. The base is
    the model analysed under exactly the reference the adapter's worker resolved; failing
    that, the key that reference would get as a hub id (`org/name@rev`) or a path.
    """
    ref = result.base_ref
    if ref is None:
        return None
    if ref in by_model:
        return by_model[ref]
    keys = set(present)
    for candidate in (model_key(*split_model_ref(ref)), model_key(ref)):
        if candidate in keys:
            return candidate
    return None


def models_by_ref(results: Iterable[ModelResult]) -> dict[str, str]:
    """marker "model" (the reference its worker was given) → model_key, for find_base_key."""
    return {r.marker.model: r.key for r in results if r.marker.model}


def base_keys(results: Sequence[ModelResult]) -> dict[str, str]:
    """Adapter model_key → its base's model_key, for the adapters whose base is in `results`."""
    by_model = models_by_ref(results)
    present = [r.key for r in results]
    found: dict[str, str] = {}
    for r in results:
        base = find_base_key(r, by_model, present)
        if base is not None and base != r.key:
            found[r.key] = base
    return found


def number(value: Any) -> float:
    """A table cell as float; empty or unparsable cells are NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
