"""Across-model outputs of a sweep: `summary.csv` (one row per done model) and `runs/<run_id>.json`.

Owns their columns and encoding. Per-model statistics come from the marker's "summary"
(written by the worker) or, for markers without one, from esd_worker.results.summarize_layers
over layers.csv; this module computes no statistics of its own.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from controller.modellist import ModelRow
from controller.plan import canonical_parameters, list_markers, read_markers
from esd_worker.results import SUMMARY_FIELDS, layers_from_csv, summarize_layers
from esd_worker.store import LAYERS_NAME, Store

SUMMARY_KEY = "summary.csv"
RUNS_PREFIX = "runs/"

# The statistics a marker's "summary" holds (and summarize_layers returns), defined by the worker.
STAT_COLUMNS: tuple[str, ...] = SUMMARY_FIELDS
SUMMARY_COLUMNS: tuple[str, ...] = (
    "model_id",
    "revision",
    "model_key",
    "relation",
    "source_model",
    *STAT_COLUMNS,
    "device",
    "total_s",
    "finished_at",
)

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")


def _device_text(device: Any) -> str | None:
    """The marker's device object as text, e.g. `cuda (NVIDIA H100 80GB HBM3)`, `cpu (x86_64)`."""
    if isinstance(device, Mapping):
        kind, name = device.get("type"), device.get("name")
        if kind and name:
            return f"{kind} ({name})"
        return str(kind or name) if (kind or name) else None
    return None if device is None else str(device)


def _stats(row: ModelRow, marker: Mapping[str, Any], store: Store) -> Mapping[str, Any]:
    summary = marker.get("summary")
    if isinstance(summary, Mapping):
        return summary
    key = marker.get("model_key") or row.key
    outputs = marker.get("outputs")
    name = outputs.get("layers") if isinstance(outputs, Mapping) else None
    data = store.get_bytes(f"{key}/{name or LAYERS_NAME}")
    if data is None:
        return {}
    return summarize_layers(layers_from_csv(data))


def summary_row(row: ModelRow, marker: Mapping[str, Any], store: Store) -> dict[str, Any]:
    """One summary.csv row (SUMMARY_COLUMNS) for a done model.

    Statistics from marker["summary"] when present, else computed from its layers.csv
    (empty when neither is there). Identity columns come from the model list, falling back
    to the marker.
    """
    stats = _stats(row, marker, store)
    timings = marker.get("timings")
    base = marker.get("base_model")
    source = row.source_model or (base.get("model") if isinstance(base, Mapping) else None)
    out: dict[str, Any] = {
        "model_id": row.model_id,
        "revision": row.revision,
        "model_key": marker.get("model_key") or row.key,
        "relation": row.relation or marker.get("relation") or "",
        "source_model": source,
        **{col: stats.get(col) for col in STAT_COLUMNS},
        "device": _device_text(marker.get("device")),
        "total_s": timings.get("total_s") if isinstance(timings, Mapping) else None,
        "finished_at": marker.get("finished_at"),
    }
    return out


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
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(SUMMARY_COLUMNS)
    for row in rows:
        writer.writerow([_cell(row.get(col)) for col in SUMMARY_COLUMNS])
    return buf.getvalue().encode("utf-8")


def write_summary(
    store: Store,
    models: Sequence[ModelRow],
    *,
    threads: int = 16,
    parameters: Mapping[str, Any] | None = None,
) -> int:
    """Write summary.csv for the done models of `models`, in list order; returns the row count.

    A model counts when its marker exists (and, when `parameters` is given, holds those
    parameters). Markers are found by one listing, then read concurrently.
    """
    present = list_markers(store)
    wanted: list[ModelRow] = []
    seen: set[str] = set()
    for model in models:  # the first row of a key wins
        if model.key in present and model.key not in seen:
            seen.add(model.key)
            wanted.append(model)
    markers = read_markers(store, [m.key for m in wanted], threads=threads)
    expected = None if parameters is None else canonical_parameters(parameters)
    done: list[tuple[ModelRow, dict[str, Any]]] = []
    for model in wanted:
        marker = markers.get(model.key)
        if marker is not None and (expected is None or marker.get("parameters") == expected):
            done.append((model, marker))

    def one(item: tuple[ModelRow, dict[str, Any]]) -> dict[str, Any]:
        return summary_row(item[0], item[1], store)

    if done:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(done)))) as pool:
            rows = list(pool.map(one, done))
    else:
        rows = []
    store.put_bytes(SUMMARY_KEY, summary_to_csv(rows))
    return len(rows)


def _json_safe(value: Any) -> Any:
    """NaN/inf → None (JSON has neither); tuples and sets → lists; mappings → dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return value


def run_report_key(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"invalid run id {run_id!r}")
    return f"{RUNS_PREFIX}{run_id}.json"


def write_run_report(store: Store, run_id: str, report: Mapping[str, Any]) -> str:
    """Write the run report to `runs/<run_id>.json`; returns that key.

    NaN and inf become null; values JSON cannot hold (datetimes, paths) become strings.
    """
    key = run_report_key(run_id)
    text = json.dumps(_json_safe(report), indent=2, allow_nan=False, default=str)
    store.put_bytes(key, (text + "\n").encode("utf-8"))
    return key


def new_run_id(now: datetime | None = None) -> str:
    """A sortable, unique run id: UTC time to the second, then 6 random hex digits.

    E.g. 20261123T070501Z-3fa9c2. Ids of runs started in different seconds sort by start
    time; the random part keeps two controllers started in the same second apart.
    """
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"
