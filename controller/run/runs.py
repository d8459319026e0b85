"""What one `esd-sweep run` did: its id and `runs/<run_id>.json` (counts, failures, timings).

Owns the run id and the run report's encoding; the sweep decides what goes in it. The
report is for people and CI; nothing reads it back to decide what to run (`esd-sweep
status` only quotes the latest report's bad nodes: `last_bad_nodes`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from esd_worker.core.redact import redact, redact_data
from esd_worker.core.store.layout import (
    DOCUMENT_BYTES,
    RUNS_PREFIX,
    SUMMARY_KEY,
    get_checked,
    run_report_key,
)
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import Store


class Tally(Protocol):
    """What a run did, task by task (controller.run.recorder.Recorder is one)."""

    @property
    def done_count(self) -> int: ...
    @property
    def failed(self) -> Mapping[str, FailureRecord]: ...  # the first ones (all are counted)
    @property
    def failed_count(self) -> int: ...
    @property
    def cancelled(self) -> Sequence[str]: ...
    @property
    def durations(self) -> Mapping[str, float]: ...
    @property
    def waits(self) -> Sequence[float]: ...


def new_run_id(now: datetime | None = None) -> str:
    """A sortable, unique run id: UTC time to the second, then 6 random hex digits.

    E.g. 20261123T070501Z-3fa9c2. Ids of runs started in different seconds sort by start
    time; the random part keeps two controllers started in the same second apart.
    """
    now = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def _json_safe(value: Any) -> Any:
    """NaN/inf → None (JSON has neither); tuples and sets → lists; mappings → dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return value


def write_run_report(store: Store, run_id: str, report: Mapping[str, Any]) -> str:
    """Write the run report to `runs/<run_id>.json`; returns that key.

    NaN and inf become null; values JSON cannot hold (datetimes, paths) become strings;
    every string is redacted (esd_worker.core.redact).
    """
    key = run_report_key(run_id)
    text = json.dumps(redact_data(_json_safe(report)), indent=2, allow_nan=False,
                      default=lambda value: redact(str(value)))
    store.put_bytes(key, (text + "\n").encode("utf-8"))
    return key


def run_report(
    *,
    run_id: str,
    started_at: str,
    finished_at: str,
    output: str,
    mode: str,
    backend: str,
    backend_report: Mapping[str, Any],
    parameters: Mapping[str, Any],
    counts: Mapping[str, int],
    tally: Tally,
    summary_rows: int,
    runtime_s: float,
    interrupted: bool,
) -> dict[str, Any]:
    """The run report's document. counts: models, bad_rows, already_done, skipped_failed;
    the tally adds what this run did. backend_report: the backend's own part ("device",
    "gpus", "running" and a section under its name)."""
    extra = dict(backend_report)
    device, gpus, running = extra.pop("device", "cpu"), extra.pop("gpus", []), extra.pop(
        "running", None)
    attempted = tally.done_count + tally.failed_count
    all_counts = {**counts, "attempted": attempted, "done": tally.done_count,
                  "failed": tally.failed_count, "cancelled": len(tally.cancelled)}
    if running is not None:
        all_counts["running"] = running
    return {
        "run_id": run_id,
        "started_at": started_at,
        "finished_at": finished_at,
        "output": output,
        "mode": mode,
        "backend": backend,
        "device": device,
        "gpus": gpus,
        "parameters": dict(parameters),
        "counts": all_counts,
        "success_rate": round(tally.done_count / attempted, 4) if attempted else None,
        "avg_wait_s": round(sum(tally.waits) / len(tally.waits), 3) if tally.waits else None,
        "durations_s": dict(tally.durations),
        "failures": {
            key: {"model": r.model, "error": r.error, "exit_code": r.exit_code,
                  "retryable": r.retryable, "attempts": r.attempts}
            for key, r in tally.failed.items()
        },
        # The first failures only (controller.run.recorder.LISTED_FAILURES): each has its
        # record in _failures/.
        "failures_not_listed": tally.failed_count - len(tally.failed),
        "summary": SUMMARY_KEY if summary_rows else None,
        "summary_rows": summary_rows,
        "total_runtime_s": round(runtime_s, 3),
        "interrupted": interrupted,
        "host": platform.node(),
        "pid": os.getpid(),
        **extra,
    }


def last_bad_nodes(store: Store) -> dict[str, Any] | None:
    """The nodes whose GPUs the latest run found broken ({"run_id", "nodes": [...]}, from its
    report's kubernetes.bad_nodes), None when it names none. Run ids start with their UTC
    time, so the latest report's key sorts last; a report that cannot be read names none."""
    keys = [k for k in store.list_keys(RUNS_PREFIX) if k.endswith(".json")]
    if not keys:
        return None
    latest = max(keys)
    try:
        report = json.loads(get_checked(store, latest, DOCUMENT_BYTES) or b"{}")
        nodes = [str(bad["node"]) for bad in report["kubernetes"]["bad_nodes"]]
    except (ValueError, KeyError, TypeError):
        return None
    if not nodes:
        return None
    return {"run_id": latest.removeprefix(RUNS_PREFIX).removesuffix(".json"), "nodes": nodes}
