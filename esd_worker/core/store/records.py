"""Failure records (`_failures/<model_key>.json`): what failed, how, and whether a retry may help.

Owns the record format; what counts as a secret is esd_worker.core.redact's (a record is
redacted as it is encoded). Where records live is esd_worker.core.store.layout's; what an exit code
means is esd_worker.core.errors'. Does not decide when to retry: the backend does, from
`retryable`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from esd_worker.core.redact import redact
from esd_worker.core.store.layout import (
    RECORD_BYTES,
    failure_key,
    fetch_all,
    get_checked,
    list_failure_keys,
)
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

RECORD_SCHEMA = 1
# Records fetched at once by iter_failures: a batch of small JSON objects held, never all.
FETCH_BATCH = 1000


def utc_now(now: datetime | None = None) -> str:
    """ISO-8601 UTC time to the second, e.g. 2026-11-23T07:05:01+00:00: a record's `time`
    (whoever writes it: the worker or the controller) and the run report's times."""
    now = now or datetime.now(UTC)
    return now.astimezone(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class FailureRecord:
    """Why a model failed, as stored in `_failures/<model_key>.json`.

    error: error class name (esd_worker.core.errors.classify_exit); exit_code / signal: how the
    worker ended (None when not known); retryable: whether another attempt may help; attempts: how
    many attempts failed so far; stderr_tail: last stderr lines, secrets redacted;
    run_id: the sweep run that wrote it; time: ISO-8601 UTC.
    """

    model: str
    model_key: str
    error: str
    exit_code: int | None
    signal: int | None
    retryable: bool
    attempts: int
    stderr_tail: tuple[str, ...]
    run_id: str
    time: str

    def to_json(self) -> bytes:
        """JSON of the record; the error and stderr lines are redacted here, so nothing stored
        holds a secret."""
        doc = {
            "schema": RECORD_SCHEMA,
            "model": self.model,
            "model_key": self.model_key,
            "error": redact(self.error),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "retryable": self.retryable,
            "attempts": self.attempts,
            "stderr_tail": [redact(line) for line in self.stderr_tail],
            "run_id": self.run_id,
            "time": self.time,
        }
        return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> FailureRecord:
        """Parse a stored record; ValueError naming the problem when it is not one."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON failure record: {e}") from e
        if not isinstance(doc, dict):
            raise ValueError("not a JSON failure record: expected an object")
        try:
            tail = doc.get("stderr_tail") or []
            if not isinstance(tail, list):
                raise TypeError("stderr_tail must be a list")
            return cls(
                model=_as(doc["model"], str, "model"),
                model_key=_as(doc["model_key"], str, "model_key"),
                error=_as(doc.get("error", ""), str, "error"),
                exit_code=_opt_int(doc.get("exit_code"), "exit_code"),
                signal=_opt_int(doc.get("signal"), "signal"),
                retryable=_as(doc.get("retryable", False), bool, "retryable"),
                attempts=_as(doc.get("attempts", 0), int, "attempts"),
                stderr_tail=tuple(str(line) for line in tail),
                run_id=_as(doc.get("run_id", ""), str, "run_id"),
                time=_as(doc.get("time", ""), str, "time"),
            )
        except KeyError as e:
            raise ValueError(f"failure record lacks {e.args[0]!r}") from e
        except TypeError as e:
            raise ValueError(f"bad failure record: {e}") from e


def _as(value: Any, kind: type, name: str) -> Any:
    # bool is an int subclass: keep them apart both ways.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name} must be {kind.__name__}, got {value!r}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else int(_as(value, int, name))


def write_failure(store: Store, record: FailureRecord) -> None:
    store.put_bytes(failure_key(record.model_key), record.to_json())


def read_failures(store: Store, *, threads: int = 16) -> dict[str, FailureRecord]:
    """model_key → record for every readable record, from one listing of _failures/.

    Records are read concurrently (stores may be remote). An unreadable record is logged
    and left out: it cannot say whether to retry, so the model is treated as having none.
    """
    keys = list_failure_keys(store)
    where = list(keys.values())
    blobs = fetch_all(store, where, threads=threads, limit=RECORD_BYTES)
    records = {key: _parse(at, data) for key, at, data in zip(keys, where, blobs, strict=True)}
    return {key: record for key, record in records.items() if record is not None}


def iter_failures(store: Store, model_keys: Iterable[str], *, batch: int = FETCH_BATCH,
                  threads: int = 16) -> Iterator[tuple[str, FailureRecord]]:
    """(model_key, record) for each of `model_keys` that has a readable record, fetched
    `batch` at a time (concurrently within a batch), so that at most one batch of records
    is held whatever the number of keys. A key without a record, or with one that cannot
    be read (logged), gives nothing."""
    keys = iter(model_keys)
    while chunk := list(islice(keys, max(1, batch))):
        where = [failure_key(key) for key in chunk]
        for key, at, data in zip(chunk, where, fetch_all(store, where, threads=threads,
                                                             limit=RECORD_BYTES),
                                 strict=True):
            record = _parse(at, data)
            if record is not None:
                yield key, record


def read_failure(store: Store, model_key: str) -> FailureRecord | None:
    """A model's failure record; None when it has none or it cannot be read (logged)."""
    where = failure_key(model_key)
    return _parse(where, get_checked(store, where, RECORD_BYTES))


def _parse(where: str, data: bytes | None) -> FailureRecord | None:
    """The record stored at `where`; None when gone (cleared since a listing) or unreadable
    (logged: it cannot say whether to retry, so the model counts as having none)."""
    if data is None:
        return None
    try:
        return FailureRecord.from_json(data)
    except ValueError as e:
        log.warning("failure record %s ignored: %s", where, e)
        return None


def clear_failure(store: Store, model_key: str) -> None:
    """Remove a model's failure record (after it succeeded); a missing record is fine."""
    store.delete(failure_key(model_key))
