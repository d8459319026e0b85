"""The failed models `esd-sweep status` lists: one line (or JSON object) per listed model with a
failure record, permanent ones first, then by model id; the first N kept, the rest counted.

Owns what a listed failure shows (model, cause, exit code, attempts, retryable, last error
line) and the bound on what is held: records arrive one at a time (the plan reads them a
batch at a time: controller.run.plan) and at most 2·N entries are kept, whatever the number
of records. Not owned: the record format (esd_worker.core.store.records), what an exit code
means (esd_worker.core.errors), how untrusted text is shown (esd_worker.core.echo: every
text from a record is redacted, escaped and cut there), which models are listed (the plan).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from esd_worker.core.echo import echo
from esd_worker.core.errors import (
    ERROR_PREFIX,
    EXIT_MEANINGS,
    KILLED_BY_SIGNAL,
    classify_exit,
    signal_name,
)
from esd_worker.core.store.records import FailureRecord

#: Failed models `status` lists unless told (--failures N|all).
SHOWN = 20
# A record's texts are a worker's: an id or an error line may be kilobytes; a line shows this
# much of each (echo says how much was cut).
ID_CHARS = 120
ERROR_CHARS = 200
CLASS_CHARS = 60
_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class FailedModel:
    """One listed model with a failure record, as shown (every text already through echo)."""

    model_id: str
    model_key: str
    cause: str
    exit_code: int | None
    attempts: int
    retryable: bool
    last_error: str | None

    @classmethod
    def of(cls, model_key: str, record: FailureRecord) -> FailedModel:
        return cls(model_id=echo(record.model, limit=ID_CHARS), model_key=model_key,
                   cause=cause(record), exit_code=record.exit_code, attempts=record.attempts,
                   retryable=record.retryable, last_error=last_error(record))

    @property
    def order(self) -> tuple[bool, str, str]:
        """Permanent first, then retryable; by model id (then key: two revisions)."""
        return self.retryable, self.model_id, self.model_key

    def line(self) -> str:
        what = ("retryable: the next run tries it again" if self.retryable
                else "permanent: run --skip-failed skips it")
        tail = f" | {self.last_error}" if self.last_error else ""
        return f"  {self.model_id}: {self.cause}; {self.attempts} attempt(s); {what}{tail}"

    def as_json(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "model_key": self.model_key, "cause": self.cause,
                "exit_code": self.exit_code, "attempts": self.attempts,
                "retryable": self.retryable, "last_error": self.last_error}


def cause(record: FailureRecord) -> str:
    """The error class and what it means: `PermanentModelError (exit 3: retrying cannot
    help)`, `KilledBySignal (SIGKILL)`. The class is the record's (`<Class>: <what>`), or
    the one its exit code and signal give (esd_worker.core.errors.classify_exit)."""
    named = record.error.split(":", 1)[0].strip()
    cls = named if _CLASS.fullmatch(named) else classify_exit(record.exit_code,
                                                              record.signal)[0]
    how = []
    if record.signal:
        how.append(f"killed by {signal_name(record.signal)}")
    elif record.exit_code is not None:
        how.append(f"exit {record.exit_code}")
    meaning = EXIT_MEANINGS.get(cls)
    if meaning is None and cls == KILLED_BY_SIGNAL[0] and not record.signal:
        meaning = "killed by a signal"
    if meaning:
        how.append(meaning)
    shown = echo(cls, limit=CLASS_CHARS)
    return f"{shown} ({': '.join(how)})" if how else shown


def last_error(record: FailureRecord) -> str | None:
    """The record's last error line: the last `esd-worker: error:` line of its stderr tail,
    else what its error says after the class, else the tail's last line; None when empty."""
    tail = [line for line in record.stderr_tail if line.strip()]
    said = [line for line in tail if line.startswith(ERROR_PREFIX)]
    _, sep, after = record.error.partition(":")
    text = (said[-1][len(ERROR_PREFIX):] if said
            else after if sep and after.strip()
            else tail[-1] if tail else "")
    text = text.strip()  # what is inside is escaped by echo (a newline shows as \n)
    return echo(text, limit=ERROR_CHARS) if text else None


class FailureList:
    """The first `limit` failed models in `FailedModel.order` (None: all) of those added one
    at a time, and how many there were: permanent and retryable. Holds at most 2·limit."""

    def __init__(self, limit: int | None = SHOWN) -> None:
        self.limit = limit
        self.permanent = 0
        self.retryable = 0
        self._kept: list[FailedModel] = []

    @property
    def total(self) -> int:
        return self.permanent + self.retryable

    def add(self, model_key: str, record: FailureRecord) -> None:
        if record.retryable:
            self.retryable += 1
        else:
            self.permanent += 1
        if self.limit == 0:
            return
        self._kept.append(FailedModel.of(model_key, record))
        if self.limit is not None and len(self._kept) >= 2 * self.limit:
            self._trim()

    def _trim(self) -> None:
        self._kept.sort(key=lambda failed: failed.order)
        if self.limit is not None:
            del self._kept[self.limit:]

    def shown(self) -> list[FailedModel]:
        """The failed models shown, in order."""
        self._trim()
        return list(self._kept)

    def lines(self) -> list[str]:
        """What `status` prints after its counts: a heading, a line per model shown and one
        that counts the rest; nothing when no listed model failed or with --failures 0."""
        if not self.total or self.limit == 0:
            return []
        shown = self.shown()
        lines = [f"{self.total:,} listed model(s) with a failure record ({self.permanent:,} "
                 f"permanent, {self.retryable:,} retryable):",
                 *(failed.line() for failed in shown)]
        if self.total > len(shown):
            lines.append(f"  … and {self.total - len(shown):,} more (--failures all)")
        return lines

    def as_json(self) -> dict[str, Any]:
        """The keys `status --json` adds: `failures` (those shown) and `failures_total`."""
        return {"failures": [failed.as_json() for failed in self.shown()],
                "failures_total": self.total}

