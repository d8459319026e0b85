"""Per-model progress of a sharded run: its shards' progress documents, read from the store.

Owns which documents a poll reads and what they add up to. An Indexed Job's status knows
whole shards only (completedIndexes, failedIndexes, active pods); each shard's pod writes a
progress document next to its list (esd_worker.serve.shardprogress;
esd_worker.core.store.layout.shard_progress_key), and this reads them by key, never listing
the store: at most `max_gets` GETs a read, `threads` at a time. A Job's running shards are
taken as its `active` lowest indexes neither completed nor failed (the Job controller starts
the lowest pending indexes first), and any other unfinished index whose document last said
it runs (a retried index can sit above them); they are read round-robin, so that every one
is refreshed within ceil(running / max_gets) reads. Budget left over reads the final
document of each finished index once (its totals stay in the class's). The counts per run
go to IndexedRun.counted (exact models done / failed / running instead of the estimate),
and per class into controller.progress.ClassProgress. Does not own the document's format
(esd_worker.core.store.progressdoc) nor the Job's status (.status).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from controller.backends.kubernetes.sharded.status import IndexedRun, ShardCounts
from controller.progress import ClassProgress
from esd_worker.core.store.layout import RECORD_BYTES, shard_progress_key
from esd_worker.core.store.progressdoc import EXITED, RUNNING, ShardProgressDoc
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

MAX_GETS = 64  # documents read per read: a poll's cost is bounded whatever the run's size
THREADS = 8
READ_EVERY_S = 30.0

Shard = tuple[IndexedRun, int]


@dataclass
class _Seen:
    """What the last read of one shard's document found (None: no document yet) and
    whether that read came after its index finished (never read again then)."""

    doc: ShardProgressDoc | None
    final: bool = False


@dataclass
class _Totals:
    done: int = 0
    failed: int = 0
    running: int = 0
    bytes_downloaded: int = 0
    device_busy_s: float = 0.0
    worker_s: float = 0.0
    read: bool = False  # any document of the run counted


class ShardProgressReader:
    """Reads the running shards' documents of a run's Indexed Jobs (see the module
    docstring); `poll` is what the backend calls each time it looks at its Jobs."""

    def __init__(self, store: Store, *, max_gets: int = MAX_GETS, threads: int = THREADS,
                 every_s: float = READ_EVERY_S) -> None:
        self.store = store
        self.max_gets = max(max_gets, 1)
        self.threads = max(threads, 1)
        self.every_s = every_s
        self.gets = 0  # documents asked for, in all
        self._seen: dict[tuple[str, int], _Seen] = {}  # (Job name, index)
        self._cursor = 0
        self._read_at: float | None = None
        self._warned = False

    def poll(self, runs: Sequence[IndexedRun], now: float) -> list[ClassProgress]:
        """Read the documents when `every_s` have passed since the last read (the first
        call reads at once), then the classes from what is known (the Jobs' status is
        newer than the documents: a shard that finished since counts as finished)."""
        if self._read_at is None or now - self._read_at >= self.every_s:
            self._read_at = now
            self.read(runs)
        return self.classes(runs)

    # -- reading ----------------------------------------------------------------------------

    def read(self, runs: Sequence[IndexedRun]) -> None:
        """One read: the running shards round-robin, then finished ones not read since."""
        running, finished = self._wanted(runs)
        start = self._cursor % len(running) if running else 0
        turn = (running[start:] + running[:start])[:self.max_gets]
        self._cursor = start + len(turn)
        picked = [(shard, False) for shard in turn]
        picked += [(shard, True) for shard in finished[:self.max_gets - len(picked)]]
        if not picked:
            return
        with ThreadPoolExecutor(max_workers=min(self.threads, len(picked))) as pool:
            docs = list(pool.map(lambda item: self._get(*item[0]), picked))
        self.gets += len(picked)
        for ((run, index), final), doc in zip(picked, docs, strict=True):
            if doc is not None or (run.name, index) not in self._seen or final:
                self._seen[(run.name, index)] = _Seen(doc, final)

    def _wanted(self, runs: Sequence[IndexedRun]) -> tuple[list[Shard], list[Shard]]:
        running: list[Shard] = []
        finished: list[Shard] = []
        for run in runs:
            ended = set(run.completed) | set(run.failed)
            lowest: list[int] = []
            for index in range(run.completions):
                if len(lowest) >= run.active:
                    break
                if index not in ended:
                    lowest.append(index)
            others = [index for (name, index), seen in self._seen.items()
                      if name == run.name and index not in ended and index not in lowest
                      and seen.doc is not None and seen.doc.state == RUNNING]
            running += [(run, index) for index in lowest + sorted(others)]
            finished += [(run, index) for index in sorted(ended)
                         if index not in run.replaced
                         and not self._seen.get((run.name, index), _Seen(None)).final]
        return running, finished

    def _get(self, run: IndexedRun, index: int) -> ShardProgressDoc | None:
        """Shard `index`'s document; None when there is none, or it is not this shard's
        (another run's or index's) or not one (logged once: progress only, never fatal)."""
        try:
            data = self.store.get_bytes(shard_progress_key(run.run_id, run.class_name, index),
                                        limit=RECORD_BYTES)
            if data is None:
                return None
            doc = ShardProgressDoc.from_json(data)
        except Exception as e:
            self._warn(f"shard {index} of job {run.name}: progress document not read: {e}")
            return None
        if doc.run_id != run.run_id or doc.index != index:
            self._warn(f"shard {index} of job {run.name}: its progress document is shard "
                       f"{doc.index} of run {doc.run_id[:80]!r}: ignored")
            return None
        return doc

    def _warn(self, line: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s (logged once)", line)
        else:
            log.debug("%s", line)

    # -- adding up --------------------------------------------------------------------------

    def classes(self, runs: Sequence[IndexedRun]) -> list[ClassProgress]:
        """One ClassProgress per class (in the order of `runs`); sets each run's counted."""
        out: dict[str, ClassProgress] = {}
        for run in runs:
            totals = self._totals(run)
            run.counted = (ShardCounts(totals.done, totals.failed, totals.running)
                           if totals.read else None)
            before = out.get(run.class_name, ClassProgress(run.class_name, 0))
            out[run.class_name] = ClassProgress(
                name=run.class_name,
                models=before.models + run.models - run.models_replaced,
                done=before.done + run.models_done,
                failed=before.failed + run.models_failed,
                running=before.running + run.models_running,
                shards=before.shards + run.completions - len(run.replaced),
                shards_done=before.shards_done + len(run.completed),
                shards_failed=before.shards_failed + len(run.failed) - len(run.replaced),
                shards_running=before.shards_running + run.ready,
                bytes_downloaded=before.bytes_downloaded + totals.bytes_downloaded,
                device_busy_s=before.device_busy_s + totals.device_busy_s,
                worker_s=before.worker_s + totals.worker_s)
        return list(out.values())

    def _totals(self, run: IndexedRun) -> _Totals:
        """The run's models by state, shard by shard: a completed shard's models are done
        but for the failures its final document counts; a failed shard's are failed but
        for what its document counts done; a running shard's are as its document says."""
        totals = _Totals()
        completed, failed = set(run.completed), set(run.failed)
        average = round(run.models / max(run.completions, 1))
        for index in range(run.completions):
            if index in run.replaced:
                continue  # its models are counted in the replacement Job
            seen = self._seen.get((run.name, index))
            doc = seen.doc if seen is not None else None
            known = run.shard_models(index)
            models = known if known is not None else (doc.models if doc else average)
            if doc is not None:
                totals.read = True
                totals.bytes_downloaded += doc.bytes_downloaded
                totals.device_busy_s += doc.device_busy_s
                totals.worker_s += doc.worker_s
            if index in completed:
                done = doc.done + doc.skipped if doc is not None and doc.state == EXITED \
                    else models
                totals.done += min(done, models)
                totals.failed += models - min(done, models)
            elif index in failed:
                done = min(doc.done + doc.skipped, models) if doc is not None else 0
                totals.done += done
                totals.failed += models - done
            elif doc is not None:
                totals.done += doc.done + doc.skipped
                totals.failed += doc.failed
                totals.running += doc.in_progress is not None
        return totals
