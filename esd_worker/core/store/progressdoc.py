"""THE progress document of a running shard: its fields, its JSON, and reading it back (pure).

A sharded run's pod (its supervisor, esd_worker.serve.shardprogress) writes one document
for its shard at `_shards/<run_id>/<class>/<index>.progress.json`
(esd_worker.core.store.layout.shard_progress_key); the controller reads those of the running
shards for per-model progress (controller.backends.kubernetes.sharded.progress). Owns the
format both sides share, nothing else: neither when it is written nor how it is read.

    {"schema": 1, "run_id": R, "class": C, "index": I, "node": N, "pod": P,
     "models": M, "done": D, "failed": F, "skipped": S, "in_progress": KEY | null,
     "bytes_downloaded": B, "device_busy_s": T, "worker_s": W,
     "started_at": ISO, "updated_at": ISO, "state": "running" | "exited",
     "exit_code": null | CODE}

done / failed / skipped: the shard's models by their last outcome in this pod (skipped:
already done, or failed for good, before it started them); in_progress: the model being
analysed; bytes_downloaded: the bytes of the models it fetched; device_busy_s: seconds of
analysis (the markers' discover_s + analyse_s; the protocol's first layer to result for a
model with no marker); worker_s: seconds since the pod's supervisor started; state
"exited" (with the pod's exit code) once it has ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCHEMA = 1
RUNNING, EXITED = "running", "exited"


@dataclass(frozen=True)
class ShardProgressDoc:
    """One shard's progress as its pod last wrote it (see the module docstring)."""

    run_id: str
    class_name: str
    index: int
    node: str = ""
    pod: str = ""
    models: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    in_progress: str | None = None
    bytes_downloaded: int = 0
    device_busy_s: float = 0.0
    worker_s: float = 0.0
    started_at: str = ""
    updated_at: str = ""
    state: str = RUNNING
    exit_code: int | None = None

    @property
    def finished_models(self) -> int:
        """Models with an outcome (done, failed, or skipped as done before)."""
        return self.done + self.failed + self.skipped

    def to_json(self) -> bytes:
        doc = {"schema": SCHEMA, "run_id": self.run_id, "class": self.class_name,
               "index": self.index, "node": self.node, "pod": self.pod,
               "models": self.models, "done": self.done, "failed": self.failed,
               "skipped": self.skipped, "in_progress": self.in_progress,
               "bytes_downloaded": self.bytes_downloaded,
               "device_busy_s": round(self.device_busy_s, 3),
               "worker_s": round(self.worker_s, 3), "started_at": self.started_at,
               "updated_at": self.updated_at, "state": self.state,
               "exit_code": self.exit_code}
        return (json.dumps(doc, ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> ShardProgressDoc:
        """The document in `data`; ValueError naming what is wrong when it is not one this
        version reads (another schema, a field of the wrong type, a negative count)."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}, not {SCHEMA}")
        in_progress = doc.get("in_progress")
        if in_progress is not None and not isinstance(in_progress, str):
            raise ValueError("in_progress is neither a model key nor null")
        exit_code = doc.get("exit_code")
        if exit_code is not None and (isinstance(exit_code, bool)
                                      or not isinstance(exit_code, int)):
            raise ValueError("exit_code is neither a whole number nor null")
        state = _text(doc, "state") or RUNNING
        if state not in (RUNNING, EXITED):
            raise ValueError(f"state {state[:40]!r}")
        return cls(run_id=_text(doc, "run_id"), class_name=_text(doc, "class"),
                   index=_count(doc, "index"), node=_text(doc, "node"), pod=_text(doc, "pod"),
                   models=_count(doc, "models"), done=_count(doc, "done"),
                   failed=_count(doc, "failed"), skipped=_count(doc, "skipped"),
                   in_progress=in_progress, bytes_downloaded=_count(doc, "bytes_downloaded"),
                   device_busy_s=_seconds(doc, "device_busy_s"),
                   worker_s=_seconds(doc, "worker_s"), started_at=_text(doc, "started_at"),
                   updated_at=_text(doc, "updated_at"), state=state, exit_code=exit_code)


def _text(doc: dict[str, Any], name: str) -> str:
    value = doc.get(name, "")
    if not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    return value


def _count(doc: dict[str, Any], name: str) -> int:
    value = doc.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is not a whole number >= 0")
    return value


def _seconds(doc: dict[str, Any], name: str) -> float:
    value = doc.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} is not a number of seconds >= 0")
    return float(value)
