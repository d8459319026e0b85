"""The progress document of a shard's pod: kept by its supervisor, written to the store.

Owns what `esd-worker --shards`'s supervisor (esd_worker.serve.supervisor, long-lived across
its children) tells the controller of its shard while it runs: the counts follow the
children's protocol lines (esd_worker.core.protocol) and live in the parent, so a child's
crash or restart loses none; the document (esd_worker.core.store.progressdoc) goes next to
the shard's list (esd_worker.core.store.layout.shard_progress_name) when the supervisor
starts, after a model's outcome at most every WRITE_EVERY_S seconds (outcomes in between
are written by the supervisor's next tick once that much time has passed), and when it
exits. A write that fails is logged once and never fails the shard: the document is
progress for people, never an outcome (those are the markers and failure records). Does not
own the document's format (progressdoc) nor who reads it (the controller's
sharded.progress).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from esd_worker.core.protocol import DONE, SKIPPED
from esd_worker.core.redact import redact
from esd_worker.core.store.layout import read_marker, shard_progress_name
from esd_worker.core.store.progressdoc import EXITED, ShardProgressDoc
from esd_worker.core.store.records import utc_now
from esd_worker.core.store.stores import Store

log = logging.getLogger("esd_worker")

WRITE_EVERY_S = 15.0
_ANALYSIS_TIMINGS = ("discover_s", "analyse_s")  # the marker's: the device's share


class ShardProgress:
    """One shard's counts, followed from its children's events, and their document.

    target: the store the document goes to (the shard folder, or the output store with the
    folder's prefix in `key`); results: the output store, whose markers give a done model's
    analysis time (None: the protocol's timing only). clock: monotonic seconds."""

    def __init__(self, target: Store, key: str, doc: ShardProgressDoc, *,
                 results: Store | None = None, every_s: float = WRITE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target, self.key, self.results = target, key, results
        self.every_s = every_s
        self.clock = clock
        self.writes = 0
        self._doc = replace(doc, started_at=doc.started_at or utc_now())
        self._started = clock()
        self._status: dict[str, str] = {}  # key → its last outcome in this pod
        self._sizes: dict[str, int] = {}  # key → its bytes once known
        self._first_layer: dict[str, float] = {}  # key → when its first layer was done
        self._busy = 0.0
        self._in_progress: str | None = None
        self._written_at = float("-inf")
        self._dirty = False
        self._warned = False

    # -- what the supervisor calls ----------------------------------------------------------

    def start(self) -> None:
        """Before the first child: the document with nothing done yet."""
        self._write()

    def follow(self, event: Mapping[str, Any]) -> None:
        """One protocol event of a child (a parsed line); writes when an outcome is due."""
        kind, key = event.get("event"), event.get("key")
        if not isinstance(key, str):
            return
        now = self.clock()
        if kind == "start":
            self._in_progress, self._dirty = key, True
        elif kind == "progress":
            size, layers = event.get("bytes"), event.get("layers")
            if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
                self._sizes[key] = max(size, self._sizes.get(key, 0))
            if isinstance(layers, int) and layers > 0:
                self._first_layer.setdefault(key, now)
        elif kind == "result" and isinstance(event.get("status"), str):
            self._outcome(key, str(event["status"]), now)
            self.tick()

    def child_ended(self) -> None:
        """A child exited (or was killed): the model it had in progress is no longer being
        analysed; the time it spent on the device counts."""
        if self._in_progress is not None:
            since = self._first_layer.pop(self._in_progress, None)
            if since is not None:
                self._busy += max(self.clock() - since, 0.0)
            self._in_progress, self._dirty = None, True

    def tick(self) -> None:
        """Write the document when something changed and WRITE_EVERY_S have passed."""
        if self._dirty and self.clock() - self._written_at >= self.every_s:
            self._write()

    def finish(self, exit_code: int) -> None:
        """The supervisor exits with `exit_code`: the last document."""
        self._in_progress = None
        self._write(exit_code)

    def document(self, exit_code: int | None = None) -> ShardProgressDoc:
        """The document as it stands (`exit_code`: the pod's, once it exits)."""
        statuses = list(self._status.values())
        return replace(
            self._doc, done=statuses.count(DONE), skipped=statuses.count(SKIPPED),
            failed=len(statuses) - statuses.count(DONE) - statuses.count(SKIPPED),
            in_progress=self._in_progress, bytes_downloaded=sum(self._sizes.values()),
            device_busy_s=self._busy, worker_s=max(self.clock() - self._started, 0.0),
            updated_at=utc_now(), state=EXITED if exit_code is not None else self._doc.state,
            exit_code=exit_code)

    # -- inside -----------------------------------------------------------------------------

    def _outcome(self, key: str, status: str, now: float) -> None:
        # A model done (or failed) by an earlier child is skipped by the next one, which
        # runs the shard again from its start: it keeps the outcome it had.
        if not (status == SKIPPED and key in self._status):
            self._status[key] = status
        if self._in_progress == key:
            self._in_progress = None
        since = self._first_layer.pop(key, None)
        busy = self._analysis_s(key) if status == DONE else None
        if busy is None and since is not None:
            busy = now - since  # no marker: from its first layer to its result
        self._busy += max(busy or 0.0, 0.0)
        self._dirty = True

    def _analysis_s(self, key: str) -> float | None:
        """The done model's analysis seconds from its marker (None: not read)."""
        if self.results is None:
            return None
        try:
            marker = read_marker(self.results, key)
        except Exception:  # the store: the protocol's timing stands in
            return None
        if marker is None:
            return None
        values = [marker.timings.get(name) for name in _ANALYSIS_TIMINGS]
        return sum(float(v) for v in values if isinstance(v, (int, float)))

    def _write(self, exit_code: int | None = None) -> None:
        self._written_at, self._dirty = self.clock(), False
        try:
            self.target.put_bytes(self.key, self.document(exit_code).to_json())
            self.writes += 1
        except Exception as e:  # progress only: the shard goes on whatever the store says
            if not self._warned:
                self._warned = True
                log.warning("shard progress %s not written (logged once; the shard goes "
                            "on): %s", self.key, redact(str(e)))


def shard_progress(folder: str, index: int, *, run_id: str, keys: frozenset[str] | None,
                   results: Store, environ: Mapping[str, str] = os.environ,
                   ) -> ShardProgress | None:
    """The progress of shard `index` of the shard folder `folder` (its URL), written into
    that folder; None, logged, when the folder cannot be opened as a store (the shard runs
    on without it)."""
    from esd_worker.core.store.opener import open_store

    try:
        target = open_store(folder)
    except Exception as e:
        log.warning("shard progress not written: %s", redact(str(e)))
        return None
    class_name = folder.rstrip("/").rsplit("/", 1)[-1]  # layout.shard_prefix's last part
    doc = ShardProgressDoc(run_id=run_id, class_name=class_name, index=index,
                           node=environ.get("NODE_NAME", ""), pod=environ.get("HOSTNAME", ""),
                           models=len(keys) if keys is not None else 0)
    return ShardProgress(target, shard_progress_name(index), doc, results=results)
