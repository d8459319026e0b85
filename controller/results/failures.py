"""The store's failures grouped by cause for the report: count per error class and
retryable, a few example models each, reading at most `max_records` records.

Owns: the grouping, and that every text taken from a record (its error, its model id) is
held as esd_worker.core.echo shows untrusted text: secrets redacted, control characters
escaped, bounded, since a record is a worker's (an old or hostile one holds what its writer's
redaction missed) and the report is the file people share. Not owned: the records' format
(esd_worker.core.store.records) nor their listing (esd_worker.core.store.layout.list_failure_keys);
how they are shown (html.py: HTML-escaped there).

Why a cap: at atlas scale a failed sweep may leave hundreds of thousands of records; the
groups are clear from the first tens of thousands, and the rest are counted by listing only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice

from controller.results.failurelist import ERROR_CHARS, ID_CHARS
from esd_worker.core.echo import echo
from esd_worker.core.store.layout import fetch_all, list_failure_keys
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import Store

#: Records read at most; the rest are counted from the listing.
MAX_RECORDS = 50_000
#: Example model ids kept per group.
EXAMPLES = 5


@dataclass
class FailureGroups:
    """Failures by (error class, retryable): counts and a few example models."""

    listed: int = 0
    read: int = 0
    unreadable: int = 0
    counts: Counter[tuple[str, bool]] = field(default_factory=Counter)
    examples: dict[tuple[str, bool], list[str]] = field(default_factory=dict)

    @property
    def not_read(self) -> int:
        """Records listed but not read (over the cap)."""
        return self.listed - self.read - self.unreadable

    def add(self, record: FailureRecord) -> None:
        # Echoed here, where the texts enter: every output built from the groups (the
        # report's page, anything later) then holds only what echo lets through, and two
        # records that differ only in a secret fall into one group.
        group = (echo(record.error, limit=ERROR_CHARS), record.retryable)
        self.counts[group] += 1
        kept = self.examples.setdefault(group, [])
        if len(kept) < EXAMPLES:
            kept.append(echo(record.model, limit=ID_CHARS))

    def rows(self) -> list[tuple[str, bool, int, list[str]]]:
        """(error, retryable, count, examples), largest group first."""
        return [(error, retryable, n, self.examples[(error, retryable)])
                for (error, retryable), n in sorted(self.counts.items(),
                                                    key=lambda kv: (-kv[1], kv[0]))]


def group_failures(store: Store, *, max_records: int = MAX_RECORDS,
                   threads: int = 8) -> FailureGroups:
    """List _failures/ once, read the first `max_records` records (sorted by key, so the same
    store gives the same page) and group them."""
    keys = list_failure_keys(store)
    groups = FailureGroups(listed=len(keys))
    chosen = [keys[k] for k in islice(sorted(keys), max_records)]
    for data in _fetch(store, chosen, threads):
        try:
            record = FailureRecord.from_json(data) if data is not None else None
        except ValueError:
            record = None
        if record is None:
            groups.unreadable += 1
            continue
        groups.read += 1
        groups.add(record)
    return groups


def _fetch(store: Store, keys: list[str], threads: int) -> Iterator[bytes | None]:
    # A chunk at a time: fetch_all returns a whole list, so this bounds the bytes held.
    for start in range(0, len(keys), 1000):
        yield from fetch_all(store, keys[start:start + 1000], threads=threads)
