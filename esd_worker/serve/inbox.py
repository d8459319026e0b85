"""Where a long-lived worker's models come from: a model list (`--models`), or requests on stdin
(`--serve`), queued so that the prefetcher can see what comes next.

Owns the batch's queue and the thread that reads protocol requests. Does not analyse or
download; the order of a list (bases before their adapters) is esd_worker.core.models.modellist's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import TextIO

from esd_worker.core.models.modellist import (
    FolderWarnings,
    bad_rows_log,
    base_first,
    read_model_list,
)
from esd_worker.core.models.naming import split_model_ref
from esd_worker.core.protocol import DRAIN, Request, parse_op

log = logging.getLogger(__name__)

_WAIT_S = 0.5  # a waiting worker wakes this often, so SIGTERM is handled promptly


def requests_from_list(url: str) -> list[Request]:
    """The requests of a model-list CSV (local path or store URL), bases before adapters.

    Bad rows are left out; the first few are logged (`esd-sweep status --bad-rows` lists
    every one), and so are the first few hub ids that are also folders here.
    """
    models = read_model_list(url)
    shown = bad_rows_log(lambda line: log.error("%s", line))
    for problem in models.problems:
        shown(problem)
    shown.close()
    folders = FolderWarnings(lambda line: log.warning("%s", line))
    for row in models.rows:
        folders(row)
    folders.close()
    return [Request.for_row(row) for row in base_first(models.rows)]


class Inbox:
    """Requests not started yet, in order; thread-safe.

    `take` blocks until a request comes or the inbox is closed (end of input) or drained
    (stop after the model in progress: what is queued is dropped).
    """

    def __init__(self, requests: Sequence[Request] = (), *, closed: bool = False) -> None:
        self._queue: deque[Request] = deque()
        self._closed = closed
        self._cond = threading.Condition()
        # What the queue needs, counted as it changes: whether a later model needs a
        # download is asked after every model, of queues of a million (esd_worker.serve.prefetch).
        self._refs: Counter[str] = Counter()
        self._repos: Counter[str] = Counter()
        self.current: Request | None = None  # the last one taken (being analysed)
        for request in requests:
            self._push(request)

    def _push(self, request: Request) -> None:
        self._queue.append(request)
        self._count(request, 1)

    def _count(self, request: Request, step: int) -> None:
        for ref in request.refs:
            for counter, name in ((self._refs, ref), (self._repos, split_model_ref(ref)[0])):
                counter[name] += step
                if counter[name] <= 0:
                    del counter[name]  # a list of millions: keep only what is still queued

    def put(self, request: Request) -> None:
        with self._cond:
            self._push(request)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            dropped = len(self._queue)
            self._queue.clear()
            self._refs.clear()
            self._repos.clear()
            self._closed = True
            self._cond.notify_all()
        log.info("drain: the model in progress finishes, %d queued dropped", dropped)

    def upcoming(self, limit: int | None = None) -> list[Request]:
        """What will be taken next, in order (a snapshot of the first `limit`)."""
        with self._cond:
            return list(itertools.islice(self._queue, limit))

    def needs(self, ref: str) -> bool:
        """Whether a queued request names this exact model reference."""
        with self._cond:
            return self._refs[ref] > 0

    def needs_repo(self, model_id: str) -> bool:
        """Whether a queued request names any revision of this hub repo."""
        with self._cond:
            return self._repos[model_id] > 0

    def take(self) -> Request | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait(_WAIT_S)
            self.current = self._queue.popleft() if self._queue else None
            if self.current is not None:
                self._count(self.current, -1)
            return self.current

    def __iter__(self) -> Iterator[Request]:
        while (request := self.take()) is not None:
            yield request

    def read_from(self, stream: TextIO) -> threading.Thread:
        """Feed the inbox from protocol lines on `stream` in a daemon thread; end of input
        closes it."""
        thread = threading.Thread(target=self._read, args=(stream,), name="esd-inbox",
                                  daemon=True)
        thread.start()
        return thread

    def _read(self, stream: TextIO) -> None:
        try:
            for line in stream:
                if not line.strip():
                    continue
                try:
                    op = parse_op(line)
                except ValueError as e:
                    log.error("ignored a bad request line (%s): %.200s", e, line.strip())
                    continue
                if op == DRAIN:
                    self.drain()
                    return
                assert isinstance(op, Request)
                self.put(op)
        finally:
            self.close()
