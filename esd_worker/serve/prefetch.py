"""Download the next models while the current one is analysed, within a disk budget, and evict
what the workers downloaded into their own cache once no later model needs it.

Owns the read-ahead of a long-lived worker: which upcoming models to fetch (`depth` of them,
each sized from the hub's file metadata before a byte is downloaded), the bytes held on disk
against `budget`, the hard bound `limit` on what one model needs (with its base: both are on
disk at once), and when a model's repo may go (only with `own_cache`: never the user's HF
cache). Which folders may be deleted, and sharing one cache between workers, is
esd_worker.fetch.cachedir's. Does not talk HTTP itself (esd_worker.fetch.resolve) nor decide what
comes
next (esd_worker.serve.inbox).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from esd_worker.core.errors import PermanentModelError, TransientError
from esd_worker.core.models.naming import is_local_path, split_model_ref
from esd_worker.core.protocol import Request
from esd_worker.fetch.cachedir import CacheDir, Hold
from esd_worker.fetch.resolve import (
    ModelFiles,
    ResolvedModel,
    model_files,
    resolve_model,
)
from esd_worker.serve.inbox import Inbox

log = logging.getLogger(__name__)

_IDLE_S = 0.2


@dataclass
class _Entry:
    """One model reference fetched (or being fetched) ahead."""

    ref: str
    model_id: str
    size: int | None  # None while it is being sized
    adapter: bool = False  # its files hold an adapter_config.json: a base comes with it
    result: Future[ResolvedModel] = field(default_factory=Future)
    hold: Hold | None = None  # its repo's lock in the worker's own cache (own_cache only)


class Prefetcher:
    """`resolve` is analyse_model's resolver: a model fetched ahead is handed over at once, one
    being fetched is waited for, any other is fetched now.

    depth: models fetched ahead of the current one (0: none). budget: bytes on disk for the
    current model and those ahead; a model that does not fit waits, and none is fetched
    ahead while the current model's own needs are not known (an adapter's base). limit: the
    most bytes one model may need with its base (None: no bound); a model beyond it fails
    with PermanentModelError before a byte of it is downloaded, naming `budget_source`
    (where the limit comes from: the flag, a shard's class). cache_dir: where downloads go
    (None: the user's HF cache). own_cache: evict a model's repo from cache_dir once no
    queued model needs it (esd_worker.fetch.cachedir: only repos the workers created, none
    another worker holds). sized: told the current model's bytes (with its base) once they
    are known, before its download (the heartbeat: a long download is not a hang).
    """

    def __init__(self, inbox: Inbox, *, depth: int = 1, budget: int | None = None,
                 limit: int | None = None, budget_source: str = "--cache-budget",
                 cache_dir: Path | None = None, own_cache: bool = False,
                 sized: Callable[[int, int | None], None] | None = None) -> None:
        self.inbox = inbox
        self.depth = depth
        self.budget = budget
        self.limit = limit
        self.budget_source = budget_source
        self.sized = sized
        self.cache_dir = cache_dir
        self._cache = CacheDir(cache_dir) if own_cache and cache_dir is not None else None
        self._entries: dict[str, _Entry] = {}
        self._current: set[str] = set()  # refs the model in progress uses
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a model started or finished: look ahead now
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._loop, name="esd-prefetch", daemon=True)
            self._thread.start()

    # -- the main thread's side ---------------------------------------------------------------

    def resolve(self, ref: str) -> ResolvedModel:
        self._wake.set()  # a model is starting: what comes after it may be fetched now
        with self._lock:
            self._current.add(ref)
            ahead = self._entries.get(ref)
        if ahead is not None:
            if self.sized is not None and ahead.size and not ahead.result.done():
                # Still downloading ahead: its size now, not after the rest of the download.
                self.sized(0, ahead.size + self._current_bytes(ref))
            try:
                return ahead.result.result()
            except TransientError as e:  # it may have been the network then: try again now
                log.info("prefetch of %s failed (%s); fetching again", ref, e)
                with self._lock:
                    if self._entries.get(ref) is ahead:
                        del self._entries[ref]
                self._let_go(ahead, evict=False)
        if is_local_path(ref):
            return resolve_model(ref)
        # Held from now on (its size once known), so the read-ahead leaves it room.
        entry = _Entry(ref, split_model_ref(ref)[0], None)
        with self._lock:
            # The read-ahead may have registered it since (a base an upcoming adapter names):
            # one entry per reference, or a second lock on the repo would outlive the entry
            # that holds it and keep the repo from ever being evicted.
            ahead = self._entries.setdefault(ref, entry)
        if ahead is not entry:
            return self.resolve(ref)
        try:
            entry.hold = self._hold(entry.model_id)
            files = model_files(ref, cache_dir=self.cache_dir)
            need = files.total_bytes + self._current_bytes(ref)
            self._check_limit(ref, files.total_bytes, need)
        except PermanentModelError:
            # Not kept: a base too big for one adapter may fit alone for its own row.
            with self._lock:
                self._entries.pop(ref, None)
            self._let_go(entry, evict=False)
            raise
        except BaseException as e:
            entry.result.set_exception(e)
            raise
        entry.size, entry.adapter = files.total_bytes, _is_adapter(files)
        if self.sized is not None:
            self.sized(0, need)
        self._download(entry, files)
        return entry.result.result()

    def _current_bytes(self, ref: str) -> int:
        """Bytes of the other references the model in progress holds (an adapter's, for its
        base): they are on disk together."""
        with self._lock:
            return sum(self._entries[r].size or 0 for r in self._current
                       if r != ref and r in self._entries)

    def _check_limit(self, ref: str, size: int, need: int) -> None:
        """PermanentModelError when `need` bytes (ref's `size` and what the model in
        progress holds besides) exceed the hard bound."""
        if self.limit is None or need <= self.limit:
            return
        with_base = f" ({_gib(size)} for {ref} itself, with its adapter)" if need > size else ""
        raise PermanentModelError(
            f"{ref} needs {_gib(need)} on disk{with_base}, more than the download budget of "
            f"{_gib(self.limit)} ({self.budget_source}): not downloaded; give it more disk "
            "(a larger --cache-budget, or a class with more ephemeral storage)")

    def finished(self, request: Request) -> None:
        """The model is analysed: its downloads go unless a queued model needs them too."""
        self._wake.set()
        with self._lock:
            used, self._current = self._current | {request.model}, set()
            gone = [self._entries.pop(ref) for ref in used
                    if ref in self._entries and not self.inbox.needs(ref)]
        for entry in gone:
            keep = self.inbox.needs_repo(entry.model_id) or not entry.result.done()
            if self._let_go(entry, evict=not keep):
                log.info("evicted %s from the worker's cache (%s)", entry.model_id,
                         _gib(entry.size or 0))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:  # what a later run may need stays (the exit would free it too)
            self._let_go(entry, evict=False)

    def _hold(self, model_id: str) -> Hold | None:
        return self._cache.hold(model_id) if self._cache is not None else None

    def _let_go(self, entry: _Entry, *, evict: bool) -> bool:
        """Release the entry's repo in the worker's cache; True when its folder was deleted."""
        hold, entry.hold = entry.hold, None
        if hold is None or self._cache is None:
            return False
        try:
            return self._cache.release(hold, evict=evict)
        except OSError as e:  # a failed eviction costs disk, never a model
            log.warning("could not evict %s from %s: %s", entry.model_id, self._cache.root, e)
            return False

    # -- the prefetch thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(_IDLE_S)
            self._wake.clear()
            if self._current_unsized():
                continue  # the model just taken comes first: its size is not known yet
            for request in self.inbox.upcoming(self.depth):
                # all() stops at the first ref that must wait for room in the budget.
                if self._stop.is_set() or not all(self._fetch(r, request)
                                                  for r in request.refs):
                    break
                self._fetch_adapter_base(request)

    def _current_unsized(self) -> bool:
        """The model in progress is not sized yet, or it is an adapter whose base (named by
        its adapter_config.json) is not: what it needs comes before any read-ahead."""
        current = self.inbox.current
        if current is None or is_local_path(current.model):
            return False
        with self._lock:
            entry = self._entries.get(current.model)
            if entry is None or entry.size is None:
                return True
            if current.base_model is not None or not entry.adapter:
                return False  # a base given in the list is in current.refs: fetched first
            # Its base is known once the analysis resolves it (it joins _current).
            return not any(r != current.model for r in self._current)

    def _fetch(self, ref: str, request: Request) -> bool:
        """Fetch ref (which `request` needs) ahead; False when it must wait for room in the
        budget."""
        with self._lock:
            if ref in self._entries:
                return True
        if is_local_path(ref):
            return True  # nothing to download
        try:
            files = model_files(ref, cache_dir=self.cache_dir)
        except Exception as e:  # its turn will resolve it again and report the error
            log.info("prefetch: cannot size %s yet (%s)", ref, e)
            entry = _Entry(ref, split_model_ref(ref)[0], 0)
            entry.result.set_exception(e)
            with self._lock:
                if self._ahead(request):
                    self._entries.setdefault(ref, entry)
            return True
        if self.limit is not None and files.total_bytes > self.limit:
            entry = _Entry(ref, files.model_id, 0)  # its turn raises this, nothing fetched
            try:
                self._check_limit(ref, files.total_bytes, files.total_bytes)
            except PermanentModelError as e:
                entry.result.set_exception(e)
            with self._lock:
                if self._ahead(request):
                    self._entries.setdefault(ref, entry)
            return True
        with self._lock:
            if ref in self._entries or not self._ahead(request):
                return True  # its turn came while it was sized: the main thread fetches it
            sizes = [e.size for e in self._entries.values()]
            held = sum(size or 0 for size in sizes)
            if None in sizes or (self.budget is not None and held
                                 and held + files.total_bytes > self.budget):
                return False
            entry = _Entry(ref, files.model_id, files.total_bytes, _is_adapter(files))
            self._entries[ref] = entry
        log.info("prefetch: %s (%s)", ref, _gib(files.total_bytes))
        try:
            entry.hold = self._hold(entry.model_id)
        except Exception as e:  # its turn will resolve it again and report the error
            entry.result.set_exception(e)
            return True
        self._download(entry, files)
        return True

    def _download(self, entry: _Entry, files: ModelFiles) -> None:
        try:
            entry.result.set_result(resolve_model(entry.ref, cache_dir=self.cache_dir,
                                                  files=files))
        except Exception as e:
            entry.result.set_exception(e)

    def _ahead(self, request: Request) -> bool:
        """Whether `request` is still queued (under self._lock). Sizing is an HTTP call: the
        main thread may have taken the request meanwhile, fetched it itself, analysed it and
        evicted its repo; an entry made now would download it again for no one."""
        return any(queued is request for queued in self.inbox.upcoming(self.depth))

    def _fetch_adapter_base(self, request: Request) -> None:
        """An adapter whose base is not given: its adapter_config.json names it."""
        if request.base_model:
            return
        with self._lock:
            entry = self._entries.get(request.model)
        if entry is None or not entry.result.done() or entry.result.exception() is not None:
            return
        config = entry.result.result().directory / "adapter_config.json"
        try:
            base = json.loads(config.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(base, str) and base:
            self._fetch(base, request)


def _is_adapter(files: ModelFiles) -> bool:
    return "adapter_config.json" in files.names


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.1f} MiB"
