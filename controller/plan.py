"""The resume plan: which listed models are done (marker with the same parameters) and which to run.

Owns reading completion markers (`<model_key>/result.json`). Does not look at what is
running: the backend knows that.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from controller.modellist import ModelRow
from controller.records import read_failures
from esd_worker.store import MARKER_NAME, Store

log = logging.getLogger(__name__)

_MARKER_SUFFIX = "/" + MARKER_NAME


@dataclass(frozen=True)
class Plan:
    """The listed models split by what a run must do with them, each in list order.

    todo: to analyse (includes stale); done: marker with the same parameters;
    skipped_failed: permanent failure record and --skip-failed; stale: marker with other
    parameters (recomputed, so also in todo).
    """

    todo: tuple[ModelRow, ...]
    done: tuple[ModelRow, ...]
    skipped_failed: tuple[ModelRow, ...]
    stale: tuple[ModelRow, ...]


def marker_key(model_key: str) -> str:
    return f"{model_key}{_MARKER_SUFFIX}"


def list_markers(store: Store) -> set[str]:
    """model_keys that have `<key>/result.json`, from one listing of the store."""
    found: set[str] = set()
    for key in store.list_keys():
        if key.endswith(_MARKER_SUFFIX):
            model_key = key[: -len(_MARKER_SUFFIX)]
            if model_key and "/" not in model_key:
                found.add(model_key)
    return found


def read_marker(store: Store, key: str) -> dict[str, Any] | None:
    """The marker of model_key `key`, or None when it is missing or not a JSON object.

    A corrupt marker is logged (naming the key) and counts as missing, so the model runs
    again and its worker writes a good one.
    """
    return parse_marker(key, store.get_bytes(marker_key(key)))


def parse_marker(key: str, data: bytes | None) -> dict[str, Any] | None:
    """The marker from its bytes (see read_marker); None for None."""
    if data is None:
        return None
    try:
        marker = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("model_key=%s corrupt marker %s ignored: %s", key, marker_key(key), e)
        return None
    if not isinstance(marker, dict):
        log.warning("model_key=%s marker %s is not a JSON object: ignored", key, marker_key(key))
        return None
    return marker


def canonical_parameters(parameters: Mapping[str, Any]) -> Any:
    """parameters as they read back from result.json (tuples become lists, and so on)."""
    return json.loads(json.dumps(dict(parameters)))


def read_markers(
    store: Store, keys: Sequence[str], *, threads: int = 16
) -> dict[str, dict[str, Any] | None]:
    """key → marker (None when missing or corrupt), fetched concurrently: stores may be remote.

    Only the fetches run in the pool; parsing is CPU work that threads would only slow
    down by contending for the GIL (measured: benchmarks/bench_plan.py).
    """
    unique = list(dict.fromkeys(keys))
    if not unique:
        return {}
    workers = max(1, min(threads, len(unique)))
    names = [marker_key(key) for key in unique]
    if workers == 1:
        blobs = [store.get_bytes(name) for name in names]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            blobs = list(pool.map(store.get_bytes, names))
    return {key: parse_marker(key, data) for key, data in zip(unique, blobs, strict=True)}


def plan_run(
    models: Sequence[ModelRow],
    store: Store,
    parameters: Mapping[str, Any],
    *,
    overwrite: bool = False,
    skip_failed: bool = False,
    threads: int = 16,
) -> Plan:
    """Split models into todo / done / skipped_failed (and stale, a part of todo).

    done iff `<key>/result.json` exists and its "parameters" equal `parameters` (compared
    after a JSON round trip, as the worker stores them). overwrite: every model is todo and
    no marker is read. skip_failed: models whose failure record is not retryable go to
    skipped_failed unless done (also with overwrite); by default they are tried again.
    Only the markers of listed models are read.
    """
    wanted = canonical_parameters(parameters)
    markers: dict[str, dict[str, Any] | None] = {}
    if not overwrite:
        present = list_markers(store)
        markers = read_markers(
            store, [m.key for m in models if m.key in present], threads=threads
        )
    permanent: set[str] = set()
    if skip_failed:
        permanent = {
            key for key, record in read_failures(store, threads=threads).items()
            if not record.retryable
        }

    todo: list[ModelRow] = []
    done: list[ModelRow] = []
    skipped: list[ModelRow] = []
    stale: list[ModelRow] = []
    for model in models:
        key = model.key
        marker = markers.get(key)
        if marker is not None and marker.get("parameters") == wanted:
            done.append(model)
            continue
        if key in permanent:
            skipped.append(model)
            continue
        if marker is not None:
            stale.append(model)
        todo.append(model)
    return Plan(
        todo=tuple(todo), done=tuple(done), skipped_failed=tuple(skipped), stale=tuple(stale)
    )
