"""The long-lived worker's machine protocol: JSON lines between a controller and
`esd-worker --serve`.

Owns the message format, both directions, and the stderr lines that tell which model a log
line belongs to. Pure (no torch, no store): the controller imports it.

    controller → worker (stdin), one JSON object per line:
        {"op": "analyse", "key": K, "model": REF, "relation": R, "base_model": B, "attempt": N}
        {"op": "drain"}     finish the model in progress, start no other, exit 0
        end of input        analyse what was sent, then exit 0
    worker → controller (stdout), one JSON object per line:
        {"event": "ready", "pid": P}                       imports done, taking requests
        {"event": "start", "key": K}                       K is being analysed: a crash now is K's
                                                           (none for a model found done)
        {"event": "progress", "key": K, "layers": L,
         "bytes": B}                                       a heartbeat: a weight file fetched
                                                           or a layer analysed (L layers done
                                                           so far; B the model's bytes once
                                                           known, else null): "hung" is no
                                                           such line for a while
                                                           (esd_worker.core.watchdog)
        {"event": "result", "key": K, "status": S, "exit_code": C, "error": E,
         "retryable": B, "seconds": T}                     S: done, failed or skipped

Logs stay on stderr. Before a model's first log line the worker writes a `MODEL_BEGIN`
line and after its last a `MODEL_END` line, so whoever reads stderr can file each line under
its model (the controller keeps per-model logs and failure tails that way).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from esd_worker.core.models.naming import KEY_MAX, is_model_key

if TYPE_CHECKING:
    from esd_worker.core.models.modellist import ModelRow

MODEL_BEGIN = "::esd-model-begin "
MODEL_END = "::esd-model-end "

DONE, FAILED, SKIPPED = "done", "failed", "skipped"


@dataclass(frozen=True)
class Request:
    """One model to analyse. attempt: which attempt this is (1 for the first), for records."""

    key: str
    model: str
    relation: str = ""
    base_model: str | None = None
    attempt: int = 1

    @property
    def refs(self) -> tuple[str, ...]:
        """The model references it needs: the model, and the base it names, if any."""
        return (self.model, self.base_model) if self.base_model else (self.model,)

    @classmethod
    def for_row(cls, row: ModelRow, attempt: int = 1) -> Request:
        """The request for a model-list row (the controller's slots and the worker's own
        `--models` list build it the same way)."""
        return cls(key=row.key, model=row.ref, relation=row.relation,
                   base_model=row.source_model, attempt=attempt)

    def to_line(self) -> str:
        return json.dumps({"op": "analyse", **asdict(self)}, ensure_ascii=False) + "\n"


@dataclass(frozen=True)
class Result:
    """How one model ended in the worker.

    status: done (marker written), failed (failure record written), skipped (already done,
    or a permanent failure record and --skip-failed). exit_code: what a one-model worker
    would have exited with (esd_worker.core.errors). error: "" or "<Class>: <message>".
    """

    key: str
    status: str
    exit_code: int
    error: str = ""
    retryable: bool = False
    seconds: float = 0.0

    def to_line(self) -> str:
        return json.dumps({"event": "result", **asdict(self)}, ensure_ascii=False) + "\n"


DRAIN = "drain"


def parse_op(line: str) -> Request | str:
    """A request line: a Request, or "drain". ValueError naming what is wrong otherwise."""
    doc = _object(line)
    op = doc.get("op")
    if op == DRAIN:
        return DRAIN
    if op != "analyse":
        raise ValueError(f"unknown op {op!r}")
    try:
        key, model = doc["key"], doc["model"]
    except KeyError as e:
        raise ValueError(f"analyse request lacks {e.args[0]!r}") from e
    base, attempt = doc.get("base_model"), doc.get("attempt", 1)
    if not (isinstance(key, str) and key and isinstance(model, str) and model):
        raise ValueError("key and model must be non-empty strings")
    if not is_model_key(key):
        # The key names the model's folder, record and note in the store: one that
        # model_key could not have made ('..', 'a/b', a NUL, 300 characters) is refused here,
        # before it reaches a store call, and the worker goes on with the next line.
        raise ValueError(f"key {key[:100]!r} is not a model key ([a-z0-9-], at most "
                         f"{KEY_MAX} characters)")
    if not (base is None or isinstance(base, str)) or not isinstance(attempt, int):
        raise ValueError("base_model must be a string or null, attempt an integer")
    return Request(key, model, str(doc.get("relation") or ""), base or None, attempt)


def parse_event(line: str) -> dict[str, Any]:
    """A worker event as a dict with at least "event"; ValueError when the line is not one."""
    doc = _object(line)
    if not isinstance(doc.get("event"), str):
        raise ValueError("not a worker event (no 'event')")
    return doc


def result_from(doc: dict[str, Any]) -> Result:
    """The Result of a "result" event (ValueError when malformed)."""
    try:
        return Result(key=str(doc["key"]), status=str(doc["status"]),
                      exit_code=int(doc["exit_code"]), error=str(doc.get("error", "")),
                      retryable=bool(doc.get("retryable", False)),
                      seconds=float(doc.get("seconds", 0.0)))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed result event: {e}") from e


def event_line(event: str, **fields: Any) -> str:
    return json.dumps({"event": event, **fields}, ensure_ascii=False) + "\n"


PROGRESS = "progress"


def progress_line(key: str, *, layers: int, size_bytes: int | None = None) -> str:
    """The heartbeat of the model in progress (the watch resets its no-progress timer)."""
    return event_line(PROGRESS, key=key, layers=layers, bytes=size_bytes)


def begin_line(key: str, attempt: int) -> str:
    return f"{MODEL_BEGIN}{json.dumps({'key': key, 'attempt': attempt})}\n"


def end_line(key: str) -> str:
    return f"{MODEL_END}{json.dumps({'key': key})}\n"


def _object(line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc
