"""A download directory that workers own (`--cache-dir`): which repo folders they may evict,
and when, while several workers (`--cpu-workers`, one per GPU) share it.

Owns two rules, kept across processes on one machine:

- Ownership. A repo folder (`models--org--name`) is evicted only if the workers created it:
  the first worker to look for a repo and find no folder leaves a mark (`owned/<folder>`,
  created exclusively) before it downloads. A folder that was there before (a user's HF
  cache pointed at with --cache-dir, their own downloads) has no mark and is never touched,
  nor what a worker adds to it (another revision's files): the user gets a cache hit later.
- Use. A worker holds a shared lock on a repo from before it looks at the folder until the
  model that needs it is done (`hold` … `release`). Eviction takes the exclusive lock
  without waiting: a repo another worker is downloading, has fetched ahead or is analysing
  is never removed under it; the last one to let go evicts. Taking a shared lock waits for
  an eviction in progress, with a deadline.

State lives in `<dir>/.esd-sweep/`: `locks/<folder>.lock` (flock; removed by the evicter,
and a lock on a removed file is taken again) and `owned/<folder>`. An evicted folder is
first renamed into `trash/` (atomic), so that a crash mid-delete leaves no half-deleted
folder that looks usable. flock is per machine (and per open file): workers on other
machines must not share one --cache-dir over a network filesystem.

Does not download (esd_worker.fetch.resolve) nor decide which models are needed next
(esd_worker.serve.prefetch).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from esd_worker.core.errors import TransientError
from esd_worker.core.files import same_file
from esd_worker.fetch.hub import repo_cache_dir

log = logging.getLogger(__name__)

STATE_DIR = ".esd-sweep"
LOCK_WAIT_S = 600.0  # an eviction is a rename and a delete: minutes mean a stuck filesystem
_POLL_S = 0.05


@dataclass
class Hold:
    """A worker's shared lock on one repo of the cache (an open lock file)."""

    model_id: str
    folder: Path
    fd: int


class CacheDir:
    """The workers' download directory `root` (created if missing)."""

    def __init__(self, root: Path, *, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.root = root.expanduser().resolve()
        self.lock_wait_s = lock_wait_s
        state = self.root / STATE_DIR
        self._locks, self._owned, self._trash = state / "locks", state / "owned", state / "trash"
        for folder in (self._locks, self._owned, self._trash):
            folder.mkdir(parents=True, exist_ok=True)
        for left in self._trash.iterdir():  # a crash mid-eviction: ours, and unusable
            shutil.rmtree(left, ignore_errors=True)

    def hold(self, model_id: str) -> Hold:
        """Take the shared lock on model_id's repo (waiting out an eviction in progress) and
        mark the repo as the workers' when its folder does not exist yet. Call before the
        repo's files are looked up or downloaded."""
        folder = repo_cache_dir(model_id, self.root)
        fd = self._lock(folder.name, fcntl.LOCK_SH)
        if not folder.exists():
            with contextlib.suppress(FileExistsError):  # another worker marked it first
                os.close(os.open(self._owned / folder.name,
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        return Hold(model_id, folder, fd)

    def release(self, hold: Hold, *, evict: bool) -> bool:
        """Let go of the repo; with `evict`, delete its folder if the workers created it and
        no one else holds it now. True when it was deleted."""
        try:
            if not evict or not self._try_exclusive(hold):
                return False
            return self._evict(hold)
        finally:
            os.close(hold.fd)

    # -- locks ----------------------------------------------------------------------------------

    def _lock(self, name: str, mode: int) -> int:
        """An open lock file of `name`, locked in `mode`; waits up to lock_wait_s."""
        path = self._locks / f"{name}.lock"
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TransientError(
                        f"the worker cache {self.root} kept {name} locked for "
                        f"{self.lock_wait_s:.0f}s (another worker evicting it is stuck)"
                    ) from e
                time.sleep(_POLL_S)
                continue
            if same_file(fd, path):
                return fd
            os.close(fd)  # the evicter removed this lock file after we opened it: again

    def _try_exclusive(self, hold: Hold) -> bool:
        """Turn the shared lock into an exclusive one, without waiting; False when another
        holder has it (it evicts when it lets go)."""
        try:
            fcntl.flock(hold.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _evict(self, hold: Hold) -> bool:
        """Under the exclusive lock: delete the folder if it is the workers'; drop the lock
        file either way (a waiter on it takes the new one)."""
        name = hold.folder.name
        mark = self._owned / name
        evicted = False
        if mark.exists() and hold.folder.is_dir() and not hold.folder.is_symlink():
            trash = self._trash / f"{name}.{os.getpid()}.{time.monotonic_ns()}"
            os.rename(hold.folder, trash)
            mark.unlink(missing_ok=True)
            shutil.rmtree(trash, ignore_errors=True)
            evicted = True
        elif not hold.folder.exists():
            mark.unlink(missing_ok=True)  # marked, never downloaded (the lookup failed)
        (self._locks / f"{name}.lock").unlink(missing_ok=True)
        return evicted
