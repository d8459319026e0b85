"""The store layout: every key and prefix under an output URL, the marker, and the write order.

Owns the contract users script against (docs/design.md, "Store layout"):

    <output>/
      <model_key>/layers.csv          per-layer metrics
      (esd_worker.core.store.results.LAYER_COLUMNS)
      <model_key>/eigs.npz            eigenvalues by layer name (optional)
      <model_key>/layers.<tag>.csv    a refit's layer table
      <model_key>/result.json         the marker: written last
      _failures/<model_key>.json      why a model failed (esd_worker.core.store.records)
      _attempts/<model_key>.json      a model a worker started and has not finished
                                      (esd_worker.serve.batch: finds models that crash workers)
      _shards/<run_id>/<class>/<i>.csv            shard i of a sharded run (a model list)
      _shards/<run_id>/<class>/<i>.progress.json  its pod's progress
                                      (esd_worker.core.store.progressdoc)
      summary.csv, summary.<tag>.csv  one row per done model
      runs/<run_id>.json              what one `esd-sweep run` did
      refits/<tag>.json               what one refit did
      report/                         `esd-sweep report`
      _lease.json                     who is writing the output now (controller.output.lease)

A model is done iff its marker exists, holds the same analysis parameters and the files it
vouches for are whole: the marker seals each file it names with its size and SHA-256
(`FileSeal`), so a deleted or truncated table shows in a store listing (sizes, `check_files`)
and a corrupt one when it is read (`check_data`). What the marker holds (its fields, JSON,
seals, and their names) is esd_worker.core.store.marker's, imported from there;
`write_model_result` is the one writer of a model's files and enforces marker-last. Does not
own how bytes reach a store (esd_worker.core.store.stores) nor what the layer table holds
(esd_worker.core.store.results). No torch here: the controller imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from esd_worker.core.echo import quoted
from esd_worker.core.store.marker import (
    LAYERS_NAME,
    FileSeal,
    Marker,
    MarkerError,
    check_listed,
)
from esd_worker.core.store.stores import READ_LIMIT, Store, StoreRefusal

log = logging.getLogger(__name__)

# The most a reader reads of each kind of file (Store.get_bytes' `limit`): far above what
# the writers write (a marker of a 1,000-layer model is ~1 MB; a failure record keeps a
# 4 kB stderr tail; a part is a few hundred models, or compact's target of 500k layer
# rows, a few MB), and far below what would exhaust a machine's memory. Larger is refused
# with one line, as what is not a regular file is.
MARKER_BYTES = 32 * 2**20
RECORD_BYTES = 4 * 2**20  # failure records, attempt notes, progress documents
DOCUMENT_BYTES = READ_LIMIT  # run reports, refit records
TABLE_BYTES = 512 * 2**20  # a model's layers.csv (its seal checks the exact size)
EIGS_BYTES = 8 * 2**30  # a model's eigs.npz, read one model at a time
PART_BYTES = 2 * 2**30  # a results-table part, held whole while it is read
SUMMARY_BYTES = 8 * 2**30  # summary.csv: read as a stream, or whole by the Python API

EIGS_NAME = "eigs.npz"
MARKER_NAME = "result.json"
FAILURES_PREFIX = "_failures/"
ATTEMPTS_PREFIX = "_attempts/"
SHARDS_PREFIX = "_shards/"
SHARD_PROGRESS_SUFFIX = ".progress.json"
SUMMARY_KEY = "summary.csv"
RUNS_PREFIX = "runs/"
REFITS_PREFIX = "refits/"
REPORT_PREFIX = "report/"
# The results tables' parts (their keys below it: esd_worker.core.store.tables).
TABLES_PREFIX = "_tables/"
# The sweep writing this output now (controller.output.lease): top level, so that no listing of
# model folders (`<model_key>/result.json`) or of _failures/ takes it for one.
LEASE_KEY = "_lease.json"

_MARKER_SUFFIX = "/" + MARKER_NAME
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")


class LayoutError(ValueError):
    """A key part (model key, tag, run id) that has no place in the layout."""


# -- keys --------------------------------------------------------------------------------------


def check_model_key(model_key: str) -> str:
    """model_key when it can name a folder of the store (no '/', not '.' or '..')."""
    if not model_key or "/" in model_key or model_key in (".", ".."):
        raise LayoutError(f"invalid model key {model_key!r}")
    return model_key


def is_tag(tag: str) -> bool:
    """Whether `tag` may name a refit table: 1-100 of letters, digits, . _ + -."""
    return bool(_TAG.fullmatch(tag))


def _check_tag(tag: str) -> str:
    if not is_tag(tag):
        raise LayoutError(f"invalid tag {tag!r}")
    return tag


def layers_name(tag: str | None = None) -> str:
    """File name of a model's layer table: layers.csv, or layers.<tag>.csv for a refit."""
    return f"layers.{_check_tag(tag)}.csv" if tag else LAYERS_NAME


def summary_key(tag: str | None = None) -> str:
    """summary.csv, or summary.<tag>.csv for a refit."""
    return f"summary.{_check_tag(tag)}.csv" if tag else SUMMARY_KEY


def model_file_key(model_key: str, name: str) -> str:
    """`<model_key>/<name>`: a file in a model's folder."""
    return f"{check_model_key(model_key)}/{name}"


def marker_key(model_key: str) -> str:
    return model_file_key(model_key, MARKER_NAME)


def failure_key(model_key: str) -> str:
    """Store key of a model's failure record."""
    return f"{FAILURES_PREFIX}{check_model_key(model_key)}.json"


def attempt_key(model_key: str) -> str:
    """Store key of a model's attempt note (written before a worker starts it)."""
    return f"{ATTEMPTS_PREFIX}{check_model_key(model_key)}.json"


def shard_prefix(run_id: str, class_name: str) -> str:
    """`_shards/<run_id>/<class>/`: the shard lists of one run's Indexed Job (one per
    resource class); shard i is `<prefix><i>.csv`, a model list the worker reads."""
    if not _RUN_ID.fullmatch(run_id):
        raise LayoutError(f"invalid run id {run_id!r}")
    if not _RUN_ID.fullmatch(class_name):
        raise LayoutError(f"invalid resource class {class_name!r}")
    return f"{SHARDS_PREFIX}{run_id}/{class_name}/"


def shard_key(run_id: str, class_name: str, index: int) -> str:
    """Store key of shard `index` (0-based, the Job's completion index) of a run's class."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise LayoutError(f"invalid shard index {index!r}")
    return f"{shard_prefix(run_id, class_name)}{index}.csv"


def shard_progress_name(index: int) -> str:
    """`<index>.progress.json`: the progress document of shard `index` (its pod's
    supervisor writes it, esd_worker.serve.shardprogress), in the shard folder next to the
    shard's list `<index>.csv`. Not `.csv`: whoever reads the folder's lists by name never
    takes it for one."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise LayoutError(f"invalid shard index {index!r}")
    return f"{index}{SHARD_PROGRESS_SUFFIX}"


def shard_progress_key(run_id: str, class_name: str, index: int) -> str:
    """Store key of shard `index`'s progress document (shard_progress_name) of a run's class."""
    return f"{shard_prefix(run_id, class_name)}{shard_progress_name(index)}"


def run_report_key(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise LayoutError(f"invalid run id {run_id!r}")
    return f"{RUNS_PREFIX}{run_id}.json"


def refit_record_key(tag: str) -> str:
    """Where a refit records its settings and counts: refits/<tag>.json."""
    return f"{REFITS_PREFIX}{_check_tag(tag)}.json"


def list_markers(store: Store) -> set[str]:
    """model_keys that have `<key>/result.json`, from one listing of the store."""
    return set(iter_markers(store))


def iter_markers(store: Store) -> Iterator[str]:
    """The model_keys that have `<key>/result.json`, as one listing of the store goes."""
    for key in store.list_keys():
        if key.endswith(_MARKER_SUFFIX):
            model_key = key[: -len(_MARKER_SUFFIX)]
            if model_key and "/" not in model_key:
                yield model_key


def iter_model_files(store: Store) -> Iterator[tuple[str, str, int]]:
    """(model_key, file name, size) of every file directly in a folder of the store, as one
    listing goes: the markers, and the sizes of the files they vouch for, in one pass."""
    for key, size in store.list_sizes():
        model_key, sep, name = key.partition("/")
        if sep and model_key and name and "/" not in name:
            yield model_key, name, size


def list_failure_keys(store: Store) -> dict[str, str]:
    """model_key → store key of every failure record, from one listing of _failures/."""
    return dict(iter_failure_keys(store))


def iter_failure_keys(store: Store) -> Iterator[tuple[str, str]]:
    """(model_key, store key) of every failure record, as one listing of _failures/ goes
    (nothing held: 100k records need not be 100k strings in memory at once)."""
    for key in store.list_keys(FAILURES_PREFIX):
        name = key[len(FAILURES_PREFIX):] if key.startswith(FAILURES_PREFIX) else ""
        if name.endswith(".json") and "/" not in name and len(name) > len(".json"):
            yield name[: -len(".json")], key


# -- reading and writing a model's files ---------------------------------------------------------


def load_marker(model_key: str, data: bytes) -> Marker:
    """The marker in folder `model_key` from its bytes; MarkerError when they are not a
    marker this version reads (esd_worker.core.store.marker), or are another folder's: its model_key
    is not `model_key` (a copied or forged file; its model_key would name other files)."""
    marker = Marker.from_json(data)
    if marker.model_key != model_key:
        raise MarkerError(f"its model_key {quoted(marker.model_key, limit=80)} is not its "
                          "folder's")
    return marker


def parse_marker(model_key: str, data: bytes | None) -> Marker | None:
    """The marker from its bytes (load_marker); None for None, and for bytes that are not a
    marker of this folder.

    An unreadable marker is logged (naming the key) and counts as missing, so the model
    runs again and its worker writes a good one.
    """
    if data is None:
        return None
    try:
        return load_marker(model_key, data)
    except MarkerError as e:
        log.warning("model_key=%s marker %s ignored: %s", model_key, marker_key(model_key), e)
        return None


def read_marker(store: Store, model_key: str) -> Marker | None:
    """The marker of `model_key`, or None when it is missing or unreadable (see parse_marker;
    a marker the store refuses to read, StoreRefusal, is unreadable: one line)."""
    return parse_marker(model_key, get_checked(store, marker_key(model_key), MARKER_BYTES))


Refused = Callable[[str, StoreRefusal], None]


def _log_refusal(_key: str, e: StoreRefusal) -> None:
    log.warning("%s; left out", e)


def get_checked(store: Store, key: str, limit: int,
                on_refused: Refused = _log_refusal) -> bytes | None:
    """store.get_bytes(key, limit=limit), with a refused value (not a regular file, or
    larger than `limit`) read as missing and handed to on_refused (default: one line
    logged): whoever reads many keys leaves that one out and goes on."""
    try:
        return store.get_bytes(key, limit=limit)
    except StoreRefusal as e:
        on_refused(key, e)
        return None


def fetch_all(store: Store, keys: Sequence[str], *, threads: int = 16,
              limit: int = READ_LIMIT, on_refused: Refused = _log_refusal,
              ) -> list[bytes | None]:
    """The values of `keys` (None where missing or refused: get_checked), fetched
    concurrently: stores may be remote. `limit`: the bound of the kind read (MARKER_BYTES…).

    Only the fetches run in the pool; parsing is CPU work that threads would only slow
    down by contending for the GIL (measured: benchmarks/bench_plan.py).
    """
    if not keys:
        return []
    workers = max(1, min(threads, len(keys)))
    if workers == 1:
        return [get_checked(store, key, limit, on_refused) for key in keys]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda key: get_checked(store, key, limit, on_refused), keys))


def read_markers(
    store: Store, keys: Iterable[str], *, threads: int = 16
) -> dict[str, Marker | None]:
    """model_key → marker (None when missing or unreadable), fetched concurrently."""
    unique = list(dict.fromkeys(keys))
    blobs = fetch_all(store, [marker_key(key) for key in unique], threads=threads,
                      limit=MARKER_BYTES)
    return {key: parse_marker(key, data) for key, data in zip(unique, blobs, strict=True)}


# -- whether a model's files are whole ---------------------------------------------------------


def check_files(store: Store, marker: Marker) -> str | None:
    """check_listed against one listing of the model's folder (one request on S3)."""
    prefix = f"{check_model_key(marker.model_key)}/"
    sizes = {key[len(prefix):]: size for key, size in store.list_sizes(prefix)
             if key.startswith(prefix)}
    return check_listed(marker, sizes)


def write_model_result(
    store: Store,
    marker: Marker,
    *,
    layers: bytes,
    eigs: bytes | None = None,
    eigs_kept: FileSeal | None = None,
    finish: Callable[[Marker], Marker] | None = None,
) -> Marker:
    """Write a model's layer table, its eigenvalues (when given) and its marker, LAST.

    An older marker (other parameters) must not vouch for the files about to change, so it
    is deleted first: if the writer dies between the files, the model is simply not done.
    The marker written seals the files (size and SHA-256 of the bytes written).
    eigs_kept: instead of `eigs`, the seal of the eigenvalue file already in the store and
    left as it is (a refit in place, which checked those bytes against it).
    finish: called once the data files are written, returns the marker to write (the
    worker stamps the write time and finished_at there). Returns the marker written.
    """
    if eigs is not None and eigs_kept is not None:
        raise ValueError("eigs and eigs_kept: one or the other")
    if (eigs is None and eigs_kept is None) != (marker.eigs_name is None):
        raise ValueError("eigs and marker.eigs_name go together: both or neither")
    seals = {marker.layers_name: FileSeal.of(layers)}
    if eigs is not None and marker.eigs_name is not None:
        seals[marker.eigs_name] = FileSeal.of(eigs)
    if eigs_kept is not None and marker.eigs_name is not None:
        seals[marker.eigs_name] = eigs_kept
    marker = dataclasses.replace(marker, files=seals)
    key = marker.model_key
    store.delete(marker_key(key))
    store.put_bytes(model_file_key(key, marker.layers_name), layers)
    if eigs is not None and marker.eigs_name is not None:
        store.put_bytes(model_file_key(key, marker.eigs_name), eigs)
    if finish is not None:
        marker = finish(marker)
        if marker.model_key != key or marker.files != seals:
            raise ValueError("finish() must not change the model key or the seals")
    store.put_bytes(marker_key(key), marker.to_json())
    return marker
