"""The output's lease: one sweep at a time writes an output, and a second one says who does.

Owns the lease record (`Owner`: host, pid, user, command, run id, since when, until when),
the decision free / held / expired (`decide`), the one-line message a second sweep exits 2
with, and the two ways of holding an output:

- A local output (`LocalStore`): `fcntl.flock` on `<output>/_lease.json`, with the holder's
  record written in the file for the second sweep's message. The kernel drops the lock when
  its process ends, however it ends (SIGKILL, the OOM killer), so a crashed holder frees the
  output at once and no expiry is needed. A pid file made with O_EXCL would outlive a crash
  and leave a guess at whether its pid still runs, which no other machine can make. On a
  shared filesystem the lock is as good as the filesystem's locks: Linux maps flock to the
  server's locks on NFS (v4, or v3 with lockd), so two machines exclude each other there; a
  filesystem without locks (some FUSE mounts) refuses flock, and the sweep runs unguarded
  after a warning. The file is deleted before it is unlocked, and a contender checks that
  the file it locked is still the one at the path, so a waiter never holds a deleted file.
- An S3 output: a lease object `<prefix>/_lease.json` holding the record and its time to
  live. The holder renews it every ttl/3 from a background thread; a contender takes it over
  only when it has not been written for longer than its TTL, as the store's clock says
  (`S3Store.get_versioned`: the reply's Date less Last-Modified), so skewed clocks of the
  machines do not matter. Every write is conditional (create: If-None-Match '*'; renew and
  take over: If-Match the ETag read; release: delete If-Match our ETag), so when two sweeps
  race the store picks one, and a sweep never deletes a lease that is no longer its own.

Taken by `esd-sweep run` (not --dry-run) and `esd-sweep refit`; never by `esd-worker`, whose
pods (a sweep's shards) all write one output at once. Does not decide what a sweep does
while it holds the output (controller.run.sweep) nor where bytes live
(esd_worker.core.store.stores, .s3).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import getpass
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from controller.errors import EXIT_USAGE, InfrastructureError, SweepError
from controller.output.tenure import Tenure
from esd_worker.core.command.flags import WEEK_S, add_flag, float_in
from esd_worker.core.errors import StoreError, StorePermanentError
from esd_worker.core.files import NotRegularFileError, open_regular, same_file
from esd_worker.core.store.layout import LEASE_KEY
from esd_worker.core.store.records import utc_now
from esd_worker.core.store.stores import LocalStore, Store

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0  # an S3 lease not renewed for this long may be taken over
# Both times an S3 age comes from are HTTP dates (whole seconds): wait one more second.
CLOCK_SLACK_S = 1.0
LOCAL_POLL_S = 1.0  # --wait-lock: seconds between tries on a local output
S3_POLL_S = 5.0  # ... on an S3 output (each try is a GET)
PROGRESS_EVERY_S = 60.0  # --wait-lock: a line saying who is still waited for
RENEW_RETRY_S = 5.0  # a renewal that failed (the store busy) is tried again this soon
# flock errors that mean "this filesystem has no locks", not "someone holds it".
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS,
                       errno.EINVAL})

FREE, HELD, EXPIRED = "free", "held", "expired"

L = TypeVar("L")


class LeaseHeldError(SweepError):
    """Another sweep holds the output (exit 2): the message says who and what to do."""

    exit_code = EXIT_USAGE


class LeaseFileError(SweepError):
    """Something other than a regular file is at `<output>/_lease.json` (a symlink, a FIFO):
    not used, exit 2, like any other output that cannot be this sweep's."""

    exit_code = EXIT_USAGE


# -- the record and the decision (pure) ----------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """Who holds an output: the record in the lease file or object.

    command: `esd-sweep run` or `esd-sweep refit` (never the whole command line: it is not
    the lease's to copy arguments, whatever they hold). run_id: the run's, when it has one.
    acquired_at: UTC ISO time. token: tells this holder's lease from another's (a pid and a
    host may recur). ttl_s (S3 only): seconds without renewal after which others may take it
    over. expires_at (S3 only): when, by the holder's clock at its last renewal (for people;
    contenders judge by the store's clock).
    """

    host: str
    pid: int
    user: str
    command: str
    run_id: str | None
    acquired_at: str
    token: str
    ttl_s: float | None = None
    expires_at: str | None = None

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Owner | None:
        """The record in `data`; None when it is none (empty, half written, garbage)."""
        try:
            doc = json.loads(data.decode("utf-8"))
            ttl = doc.get("ttl_s")
            return cls(
                host=str(doc["host"]), pid=int(doc["pid"]), user=str(doc["user"]),
                command=str(doc["command"]), run_id=doc.get("run_id") and str(doc["run_id"]),
                acquired_at=str(doc["acquired_at"]), token=str(doc["token"]),
                ttl_s=float(ttl) if isinstance(ttl, int | float) and ttl > 0 else None,
                expires_at=doc.get("expires_at") and str(doc["expires_at"]),
            )
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def describe(self) -> str:
        run = f" run={self.run_id}" if self.run_id else ""
        return (f"host={self.host} pid={self.pid} user={self.user}{run} ({self.command}) "
                f"since {self.acquired_at}")

    def renewed(self, now: datetime | None = None) -> Owner:
        """The record as written at a renewal: expires ttl_s from now."""
        if self.ttl_s is None:
            return self
        now = now or datetime.now(UTC)
        return replace(self, expires_at=utc_now(now + timedelta(seconds=self.ttl_s)))


def make_owner(*, command: str, run_id: str | None, ttl_s: float | None = None) -> Owner:
    """This process as a lease holder."""
    owner = Owner(host=socket.gethostname(), pid=os.getpid(), user=_user(), command=command,
                  run_id=run_id, acquired_at=utc_now(), token=uuid.uuid4().hex, ttl_s=ttl_s)
    return owner.renewed()


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # a container's uid with no passwd entry and no $USER
        return str(os.getuid())


@dataclass(frozen=True)
class Seen:
    """A lease object as a contender read it: its record (None when unreadable), its ETag,
    and its age in seconds by the store's clock."""

    owner: Owner | None
    etag: str
    age_s: float

    @property
    def ttl_s(self) -> float:
        """The holder's TTL; an unreadable record counts with the default one."""
        return self.owner.ttl_s if self.owner and self.owner.ttl_s else LEASE_TTL_S


def decide(seen: Seen | None) -> str:
    """FREE (no lease object), HELD, or EXPIRED (not written for longer than its TTL)."""
    if seen is None:
        return FREE
    return EXPIRED if seen.age_s > seen.ttl_s + CLOCK_SLACK_S else HELD


@dataclass(frozen=True)
class Held:
    """Someone else holds the output: their record (None when unreadable) and, for an S3
    lease, when it expires unless renewed (this machine's clock)."""

    owner: Owner | None
    expires_at: str | None = None

    @classmethod
    def of(cls, seen: Seen) -> Held:
        left = seen.ttl_s + CLOCK_SLACK_S - seen.age_s
        return cls(seen.owner, utc_now(datetime.now(UTC) + timedelta(seconds=left)))


def held_message(url: str, held: Held, *, waited_s: float | None = None) -> str:
    """The one line a second sweep exits 2 with: who holds `url`, and what to do."""
    who = held.owner.describe() if held.owner else "a process whose record is unreadable"
    until = (f", lease until {held.expires_at} unless renewed (a holder that stopped loses "
             "it then)" if held.expires_at else "")
    if waited_s is not None:
        return (f"{url} is still in use after waiting {waited_s:.0f}s (--wait-lock): {who}"
                f"{until}")
    return (f"{url} is in use by another sweep: {who}{until}; wait for it to end, or run "
            "again with --wait-lock [SECONDS] to wait for it")


# -- a local output: flock ---------------------------------------------------------------------


class FileLease:
    """The lock on `<root>/_lease.json`, held through an open descriptor (module docstring)."""

    def __init__(self, path: Path, fd: int, owner: Owner, *, made_root: bool) -> None:
        self.path = path
        self.owner = owner
        self._fd: int | None = fd
        self._made_root = made_root

    @classmethod
    def attempt(cls, root: Path, owner: Owner) -> FileLease | Held | None:
        """The lease, or who holds it; None when the filesystem has no locks."""
        path = root / LEASE_KEY
        made_root = not root.is_dir()
        for _ in range(100):  # another turn only when a holder let go between open and lock
            try:
                root.mkdir(parents=True, exist_ok=True)
                # Only a regular file: a symlink planted at the name would have us truncate
                # its target (open_regular). O_CLOEXEC: workers must not inherit the lock.
                fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except NotRegularFileError as e:
                raise LeaseFileError(f"cannot lock {path}: {e}") from e
            except OSError as e:
                raise InfrastructureError(f"cannot lock {path}: {e.strerror or e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = Held(_read_owner(fd))
                os.close(fd)
                return held
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_LOCKS:
                    return None
                raise InfrastructureError(f"cannot lock {path}: {e.strerror or e}") from e
            if same_file(fd, path):
                _write_owner(fd, path, owner)
                return cls(path, fd, owner, made_root=made_root)
            os.close(fd)
        raise InfrastructureError(f"cannot lock {path}: it keeps being replaced")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        # Deleted while still locked: a waiter that then locks the old file sees it is no
        # longer at the path and opens the new one (attempt's same_file).
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(fd)
        if self._made_root:  # leave no empty output folder behind (only when it is empty)
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def _read_owner(fd: int) -> Owner | None:
    """The holder's record; it writes it right after locking, so an empty file is re-read
    for a moment."""
    for _ in range(20):
        data = os.pread(fd, 1 << 16, 0)
        if data:
            return Owner.from_json(data)
        time.sleep(0.05)
    return None


def _write_owner(fd: int, path: Path, owner: Owner) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.to_json(), 0)
        os.fsync(fd)
    except OSError as e:  # the lock holds all the same; only the second sweep's message suffers
        log.warning("lease %s: cannot write who holds it: %s", path, e.strerror or e)


# -- an S3 output: a lease object with a TTL -----------------------------------------------------


@runtime_checkable
class ConditionalStore(Protocol):
    """A store whose writes can be conditional (esd_worker.core.store.s3.S3Store)."""

    url: str

    def get_versioned(self, key: str) -> tuple[bytes, str, float] | None: ...

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None: ...

    def delete_if(self, key: str, etag: str) -> bool: ...


def observe(store: ConditionalStore) -> Seen | None:
    """The lease object as it is now; None when there is none."""
    got = store.get_versioned(LEASE_KEY)
    if got is None:
        return None
    data, etag, age_s = got
    return Seen(Owner.from_json(data), etag, age_s)


class ObjectLease:
    """The lease object while this sweep holds it: renewed in the background until released.

    lost (tenure.lost): another sweep took it over (this one failed to renew it within its
    TTL); it is then neither renewed nor deleted, and `tenure` tells the sweep to stop.
    """

    def __init__(self, store: ConditionalStore, owner: Owner, etag: str, *,
                 renew: bool = True, written: float | None = None) -> None:
        """written: when (time.monotonic()) the write the store accepted was sent; now when
        not given. The lease is surely ours for its TTL from then (Tenure.renewed)."""
        self.store = store
        self.owner = owner
        self.etag = etag
        self.tenure = Tenure(store.url)
        self.tenure.renewed((time.monotonic() if written is None else written) + self._ttl_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(target=self._renew, name="esd-lease", daemon=True)
            self._thread.start()

    @property
    def lost(self) -> bool:
        return self.tenure.lost

    @property
    def _ttl_s(self) -> float:
        return self.owner.ttl_s or LEASE_TTL_S

    @classmethod
    def claim(cls, store: ConditionalStore, owner: Owner, seen: Seen | None, *,
              renew: bool = True) -> ObjectLease | Held | None:
        """Take the lease as `seen` (observe) found it: ours when the store accepts the
        conditional write, Held when it is held, None when the store refused because another
        sweep wrote it since `seen` (look again)."""
        state = decide(seen)
        sent = time.monotonic()
        if seen is not None and seen.owner is not None and seen.owner.token == owner.token:
            # our own write, its reply lost: written as long ago as the store says
            return cls(store, owner, seen.etag, renew=renew, written=sent - seen.age_s)
        if state == HELD:
            assert seen is not None
            return Held.of(seen)
        etag = store.put_if(LEASE_KEY, owner.renewed().to_json(),
                            etag=None if seen is None else seen.etag)
        if etag is None:
            return None
        if seen is not None:
            log.warning("took over the expired lease on %s: %s did not renew it for %.0fs",
                        store.url, seen.owner.describe() if seen.owner else "its holder",
                        seen.age_s)
        return cls(store, owner, etag, renew=renew, written=sent)

    @classmethod
    def attempt(cls, store: ConditionalStore, owner: Owner) -> ObjectLease | Held:
        """The lease, or who holds it."""
        for _ in range(5):  # another turn only when a write raced ours
            got = cls.claim(store, owner, observe(store))
            if got is not None:
                return got
        seen = observe(store)
        return Held.of(seen) if seen is not None else Held(None)

    def _renew(self) -> None:
        assert self.owner.ttl_s is not None
        every = self.owner.ttl_s / 3
        wait = every
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                etag = self.store.put_if(LEASE_KEY, self.owner.renewed().to_json(),
                                         etag=self.etag)
            except (StoreError, StorePermanentError) as e:
                # Not lost yet: our ETag still stands until someone takes the lease over.
                log.warning("lease on %s not renewed (%s); trying again", self.store.url, e)
                wait = min(every, RENEW_RETRY_S)
                continue
            if etag is None:
                log.error("lease on %s lost: not renewed within %.0fs and taken over (or "
                          "deleted); another sweep may be writing this output now",
                          self.store.url, self.owner.ttl_s)
                self.tenure.lose()
                return
            self.etag = etag
            self.tenure.renewed(sent + self._ttl_s)
            wait = every

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        try:
            if not self.store.delete_if(LEASE_KEY, self.etag):
                log.warning("lease on %s was no longer ours: left as it is", self.store.url)
        except (StoreError, StorePermanentError) as e:
            log.warning("lease on %s not released (%s): it expires %.0fs after its last "
                        "renewal", self.store.url, e, self.owner.ttl_s or LEASE_TTL_S)


# -- taking and holding ---------------------------------------------------------------------------


def take_lease(
    store: Store, *, command: str, run_id: str | None, wait_s: float | None = None,
    ttl_s: float = LEASE_TTL_S, poll_s: float | None = None,
) -> FileLease | ObjectLease | None:
    """This process's lease on the store's output; None when the output cannot have one
    (a filesystem without locks: a warning says so).

    wait_s: None: LeaseHeldError at once when another sweep holds it; otherwise wait up to
    wait_s seconds (math.inf: as long as it takes), trying every poll_s seconds and logging
    who is waited for every PROGRESS_EVERY_S.
    """
    if isinstance(store, LocalStore):
        owner = make_owner(command=command, run_id=run_id)
        got = _take(lambda: FileLease.attempt(store.root, owner), store.url, wait_s,
                    LOCAL_POLL_S if poll_s is None else poll_s)
        if got is None:
            log.warning("%s: the filesystem refuses file locks; nothing stops another sweep "
                        "from writing this output at the same time", store.url)
        return got
    if isinstance(store, ConditionalStore):
        owner = make_owner(command=command, run_id=run_id, ttl_s=ttl_s)
        return _take(lambda: ObjectLease.attempt(store, owner), store.url, wait_s,
                     S3_POLL_S if poll_s is None else poll_s)
    log.warning("%s: this kind of store takes no lease", store.url)
    return None


def _take(attempt: Callable[[], L | Held], url: str, wait_s: float | None,
          poll_s: float) -> L:
    start = time.monotonic()
    noted = -math.inf
    while True:
        got = attempt()
        if not isinstance(got, Held):
            return got
        now = time.monotonic()
        waited = now - start
        if wait_s is None:
            raise LeaseHeldError(held_message(url, got))
        if waited >= wait_s:
            raise LeaseHeldError(held_message(url, got, waited_s=waited))
        if now - noted >= PROGRESS_EVERY_S:
            noted = now
            who = got.owner.describe() if got.owner else "another sweep"
            log.info("waiting for %s (--wait-lock, %.0fs so far): in use by %s", url, waited,
                     who)
        time.sleep(max(0.0, min(poll_s, wait_s - waited)))


@contextlib.contextmanager
def output_lease(store: Store, *, command: str, run_id: str | None,
                 wait_s: float | None = None, take: bool = True,
                 ttl_s: float = LEASE_TTL_S) -> Iterator[Tenure]:
    """Hold the output's lease for the block (take=False: hold none, e.g. --dry-run); it is
    released however the block ends (an error, Ctrl+C). Yields the Tenure that says when
    the lease is lost: the block stops writing then (a lock on a file is never lost)."""
    lease = (take_lease(store, command=command, run_id=run_id, wait_s=wait_s, ttl_s=ttl_s)
             if take else None)
    try:
        yield lease.tenure if isinstance(lease, ObjectLease) else Tenure(store.url)
    finally:
        if lease is not None:
            lease.release()


# -- the flag ------------------------------------------------------------------------------------


def add_wait_lock_flag(parser: argparse.ArgumentParser | Any) -> None:
    """--wait-lock [SECONDS] (run, refit)."""
    add_flag(parser, "--wait-lock", type=float_in(0, WEEK_S, unit="seconds"), nargs="?",
             const=math.inf, default=None,
             metavar="SECONDS",
             help="when another sweep holds the output, wait for it (up to SECONDS; without "
             "a number, as long as it takes) instead of exiting 2. A crashed holder frees a "
             f"local output at once, an S3 one {LEASE_TTL_S:.0f}s after its last renewal")
