"""The store layout: every key and prefix under an output URL, the marker, and the write order.

Owns the contract users script against (docs/design.md, "Store layout"):

    <output>/
      <model_key>/layers.csv          per-layer metrics (esd_worker.results.LAYER_COLUMNS)
      <model_key>/eigs.npz            eigenvalues by layer name (optional)
      <model_key>/layers.<tag>.csv    a refit's layer table
      <model_key>/result.json         the marker: written last
      _failures/<model_key>.json      why a model failed (esd_worker.records)
      _attempts/<model_key>.json      a model a worker started and has not finished
                                      (esd_worker.batch: finds models that crash workers)
      summary.csv, summary.<tag>.csv  one row per done model
      runs/<run_id>.json              what one `esd-sweep run` did
      refits/<tag>.json               what one refit did
      report/                         `esd-sweep report`

A model is done iff its marker exists and holds the same analysis parameters. The marker is
a frozen, typed `Marker`; `write_model_result` is the one writer of a model's files and
enforces marker-last. Does not own how bytes reach a store (esd_worker.store) nor what the
layer table holds (esd_worker.results). No torch here: the controller imports it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from esd_worker.store import Store

log = logging.getLogger(__name__)

LAYERS_NAME = "layers.csv"
EIGS_NAME = "eigs.npz"
MARKER_NAME = "result.json"
FAILURES_PREFIX = "_failures/"
ATTEMPTS_PREFIX = "_attempts/"
SHARDS_PREFIX = "_shards/"
SUMMARY_KEY = "summary.csv"
RUNS_PREFIX = "runs/"
REFITS_PREFIX = "refits/"
REPORT_PREFIX = "report/"
MARKER_SCHEMA = 1

_MARKER_SUFFIX = "/" + MARKER_NAME
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")


class LayoutError(ValueError):
    """A key part (model key, tag, run id) that has no place in the layout."""


class MarkerError(ValueError):
    """Bytes that are not a marker this version can read; the message says why."""


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


def list_failure_keys(store: Store) -> dict[str, str]:
    """model_key → store key of every failure record, from one listing of _failures/."""
    keys: dict[str, str] = {}
    for key in store.list_keys(FAILURES_PREFIX):
        name = key[len(FAILURES_PREFIX):] if key.startswith(FAILURES_PREFIX) else ""
        if name.endswith(".json") and "/" not in name and len(name) > len(".json"):
            keys[name[: -len(".json")]] = key
    return keys


# -- the marker --------------------------------------------------------------------------------


def canonical_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """parameters as they read back from result.json (tuples become lists, and so on)."""
    return dict(json.loads(json.dumps(dict(parameters))))


@dataclass(frozen=True)
class BaseModelRef:
    """An adapter's base as its worker resolved it."""

    model: str
    resolved_revision: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class Marker:
    """`<model_key>/result.json`: a model is done, with these parameters, and how it went.

    model: the reference the worker was given (id[@rev] or a local path); model_key: its
    folder. parameters: the analysis settings (esd_worker.settings.AnalysisSettings.as_dict).
    summary: the across-layer statistics (esd_worker.results.summarize_layers), None in
    markers written before it existed. layers_name / eigs_name: the files beside it
    (eigs_name None: no eigenvalues stored). timings: seconds per phase (total_s, ...).
    device, versions, adapter: informational, as the worker recorded them.
    """

    model: str
    model_key: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    schema: int = MARKER_SCHEMA
    model_id: str | None = None
    revision: str | None = None
    resolved_revision: str | None = None
    source: str | None = None
    relation: str = ""
    base_model: BaseModelRef | None = None
    adapter: Mapping[str, Any] | None = None
    layer_discovery: str | None = None
    architecture: str | None = None
    discovery_note: str | None = None
    layer_count: int | None = None
    status_counts: Mapping[str, int] = field(default_factory=dict)
    summary: Mapping[str, Any] | None = None
    layers_name: str = LAYERS_NAME
    eigs_name: str | None = None
    timings: Mapping[str, Any] = field(default_factory=dict)
    device: Mapping[str, Any] | None = None
    versions: Mapping[str, Any] = field(default_factory=dict)
    started_at: str | None = None
    finished_at: str | None = None

    @property
    def total_s(self) -> float | None:
        value = self.timings.get("total_s")
        return float(value) if isinstance(value, int | float) else None

    def to_dict(self) -> dict[str, Any]:
        base = self.base_model
        return {
            "schema": self.schema,
            "model": self.model,
            "model_id": self.model_id,
            "revision": self.revision,
            "resolved_revision": self.resolved_revision,
            "source": self.source,
            "model_key": self.model_key,
            "relation": self.relation,
            "base_model": None if base is None else {
                "model": base.model, "resolved_revision": base.resolved_revision,
                "source": base.source,
            },
            "adapter": None if self.adapter is None else dict(self.adapter),
            "parameters": dict(self.parameters),
            "layer_discovery": self.layer_discovery,
            "architecture": self.architecture,
            "discovery_note": self.discovery_note,
            "layer_count": self.layer_count,
            "status_counts": dict(self.status_counts),
            "summary": None if self.summary is None else dict(self.summary),
            "outputs": {"layers": self.layers_name, "eigs": self.eigs_name},
            "timings": dict(self.timings),
            "device": None if self.device is None else dict(self.device),
            "versions": dict(self.versions),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    def to_json(self) -> bytes:
        """Sorted keys, two-space indent; NaN is refused (JSON has none)."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
        return (text + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Marker:
        """Parse a stored marker; MarkerError naming the problem when it is not one.

        The schema must be one this version knows (1..MARKER_SCHEMA): a newer marker is
        refused rather than half understood. Keys this version does not know are ignored.
        """
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MarkerError(f"not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise MarkerError("not a JSON object")
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Marker:
        schema = doc.get("schema")
        if isinstance(schema, bool) or not isinstance(schema, int):
            raise MarkerError(f"schema must be an integer, got {schema!r}")
        if not 1 <= schema <= MARKER_SCHEMA:
            raise MarkerError(f"schema {schema} is not one this version reads (1.."
                              f"{MARKER_SCHEMA}): written by a newer esd-sweep?")
        outputs = _get(doc, "outputs", Mapping, {})
        base = _get(doc, "base_model", Mapping, None)
        return cls(
            schema=schema,
            model=_need(doc, "model", str),
            model_key=_need(doc, "model_key", str),
            parameters=dict(_get(doc, "parameters", Mapping, {})),
            model_id=_get(doc, "model_id", str, None),
            revision=_get(doc, "revision", str, None),
            resolved_revision=_get(doc, "resolved_revision", str, None),
            source=_get(doc, "source", str, None),
            relation=_get(doc, "relation", str, None) or "",
            base_model=None if base is None else BaseModelRef(
                model=_need(base, "model", str, where="base_model."),
                resolved_revision=_get(base, "resolved_revision", str, None),
                source=_get(base, "source", str, None),
            ),
            adapter=_get(doc, "adapter", Mapping, None),
            layer_discovery=_get(doc, "layer_discovery", str, None),
            architecture=_get(doc, "architecture", str, None),
            discovery_note=_get(doc, "discovery_note", str, None),
            layer_count=_get(doc, "layer_count", int, None),
            status_counts=dict(_get(doc, "status_counts", Mapping, {})),
            summary=_get(doc, "summary", Mapping, None),
            layers_name=_get(outputs, "layers", str, None) or LAYERS_NAME,
            eigs_name=_get(outputs, "eigs", str, None),
            timings=dict(_get(doc, "timings", Mapping, {})),
            device=_get(doc, "device", Mapping, None),
            versions=dict(_get(doc, "versions", Mapping, {})),
            started_at=_get(doc, "started_at", str, None),
            finished_at=_get(doc, "finished_at", str, None),
        )


def _need(doc: Mapping[str, Any], name: str, kind: type, *, where: str = "") -> Any:
    if name not in doc:
        raise MarkerError(f"lacks {(where + name)!r}")
    value = _get(doc, name, kind, None, where=where)
    if value is None:
        raise MarkerError(f"{where}{name} must not be null")
    return value


def _get(doc: Mapping[str, Any], name: str, kind: type, default: Any, *, where: str = "") -> Any:
    value = doc.get(name)
    if value is None:
        return default
    # bool is an int subclass: keep them apart.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MarkerError(f"{where}{name} must be {kind.__name__}, got {value!r}")
    return value


# -- reading and writing a model's files ---------------------------------------------------------


def parse_marker(model_key: str, data: bytes | None) -> Marker | None:
    """The marker from its bytes; None for None, and for bytes that are not a marker.

    An unreadable marker is logged (naming the key) and counts as missing, so the model
    runs again and its worker writes a good one.
    """
    if data is None:
        return None
    try:
        return Marker.from_json(data)
    except MarkerError as e:
        log.warning("model_key=%s marker %s ignored: %s", model_key, marker_key(model_key), e)
        return None


def read_marker(store: Store, model_key: str) -> Marker | None:
    """The marker of `model_key`, or None when it is missing or unreadable (see parse_marker)."""
    return parse_marker(model_key, store.get_bytes(marker_key(model_key)))


def fetch_all(store: Store, keys: Sequence[str], *, threads: int = 16) -> list[bytes | None]:
    """The values of `keys` (None where missing), fetched concurrently: stores may be remote.

    Only the fetches run in the pool; parsing is CPU work that threads would only slow
    down by contending for the GIL (measured: benchmarks/bench_plan.py).
    """
    if not keys:
        return []
    workers = max(1, min(threads, len(keys)))
    if workers == 1:
        return [store.get_bytes(key) for key in keys]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(store.get_bytes, keys))


def read_markers(
    store: Store, keys: Iterable[str], *, threads: int = 16
) -> dict[str, Marker | None]:
    """model_key → marker (None when missing or unreadable), fetched concurrently."""
    unique = list(dict.fromkeys(keys))
    blobs = fetch_all(store, [marker_key(key) for key in unique], threads=threads)
    return {key: parse_marker(key, data) for key, data in zip(unique, blobs, strict=True)}


def write_model_result(
    store: Store,
    marker: Marker,
    *,
    layers: bytes,
    eigs: bytes | None = None,
    finish: Callable[[Marker], Marker] | None = None,
) -> Marker:
    """Write a model's layer table, its eigenvalues (when given) and its marker, LAST.

    An older marker (other parameters) must not vouch for the files about to change, so it
    is deleted first: if the writer dies between the files, the model is simply not done.
    finish: called once the data files are written, returns the marker to write (the
    worker stamps the write time and finished_at there). Returns the marker written.
    """
    if (eigs is None) != (marker.eigs_name is None):
        raise ValueError("eigs and marker.eigs_name go together: both or neither")
    key = marker.model_key
    store.delete(marker_key(key))
    store.put_bytes(model_file_key(key, marker.layers_name), layers)
    if eigs is not None and marker.eigs_name is not None:
        store.put_bytes(model_file_key(key, marker.eigs_name), eigs)
    if finish is not None:
        marker = finish(marker)
        if marker.model_key != key:
            raise ValueError("finish() must not change the model key")
    store.put_bytes(marker_key(key), marker.to_json())
    return marker
