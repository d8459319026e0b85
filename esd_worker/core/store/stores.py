"""Result stores behind one small interface: where bytes for a key live (no torch, no analysis).

Owns the interface (Store), its keys' rules (normalize_key) and the store in a folder
(LocalStore, with its OS errors sorted by retryability). Which store a URL names is
esd_worker.core.store.opener's; the S3 store is esd_worker.core.store.s3. Which keys exist,
and what they hold, is esd_worker.core.store.layout's.
"""

from __future__ import annotations

import abc
import errno
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from esd_worker.core.errors import StoreError, StorePathError, WorkerError
from esd_worker.core.files import describe_mode, write_atomic

# OS errors that say a local folder cannot be used as configured: the same call fails the
# same way on every retry until a person changes a path or a permission (a file where a
# folder should be, or the reverse; no permission; a read-only mount; a name or a link the
# filesystem refuses). A retry costs a model's attempts and minutes of backoff for nothing,
# so these are permanent (exit 3). Everything else stays transient (exit 4), because it can
# clear with the configuration unchanged: ENOSPC / EDQUOT (another job frees the disk), EIO
# and ESTALE (a flaky disk, an NFS server back), ENOENT (a folder removed under a write),
# EINTR, EAGAIN, ENOMEM, EMFILE, ENFILE, ETIMEDOUT.
_PERMANENT_ERRNOS = frozenset({
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
    errno.EEXIST,  # mkdir(exist_ok=True) where a file holds the folder's name
    errno.ENAMETOOLONG, errno.ELOOP,
})


READ_PART = 2**20  # bytes a part of Store.get_parts holds at most
# What get_bytes reads at most unless its caller names the bound of the kind it reads
# (esd_worker.core.store.layout: markers, records, parts, summaries): a document of the
# store's own is a few kB, and a reader must never be walked into reading without end.
READ_LIMIT = 64 * 2**20


class StoreRefusal(StorePathError):
    """A key whose value a reader will not read: not a regular file (a FIFO would block the
    reader forever, a link to /dev/zero feed it until memory runs out) or larger than the
    bound of what it should hold. Its message is one line naming the key and why; a reader
    treats the key as unreadable (a marker: the model is not done; a record: left out).
    Permanent: reading it again meets the same thing until a person removes it."""


def normalize_key(key: str) -> str:
    """`key` with empty parts dropped; StoreError for an empty key or a '.' / '..' part."""
    parts = [p for p in key.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise StoreError(f"invalid store key {key!r}")
    return "/".join(parts)


def local_store_error(what: str, e: OSError) -> WorkerError:
    """The store error for `e` met trying to `what` ("write /out/m/result.json"):
    StorePathError when no retry can help (see _PERMANENT_ERRNOS), StoreError otherwise."""
    if e.errno in _PERMANENT_ERRNOS:
        return StorePathError(f"cannot {what}: {e.strerror or e}: fix the output folder "
                              "or its permissions")
    return StoreError(f"cannot {what}: {e.strerror or e}")


class Store(abc.ABC):
    """Keys are '/'-separated relative paths; values are bytes."""

    url: str

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write atomically: readers see the old value or the whole new one, never a part."""

    @abc.abstractmethod
    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        """The value, or None when the key does not exist. StoreRefusal, before anything
        is read, when the value is not a regular file or is more than `limit` bytes: the
        one door through which every reader of the store comes."""

    def put_parts(self, key: str, parts: Iterable[bytes]) -> None:
        """Write the parts joined, as put_bytes does (atomically), holding a bounded share of
        them at a time where the store can (LocalStore, S3Store): a file of millions of
        rows is written as it is made. This default joins them first."""
        self.put_bytes(key, b"".join(parts))

    def get_parts(self, key: str, *, limit: int = READ_LIMIT) -> Iterator[bytes] | None:
        """The value in parts of at most READ_PART bytes where the store can (the start of
        a large value is read without reading it all), or None when the key does not exist;
        refused as get_bytes refuses, the size bound checked before the first part. This
        default is get_bytes' value in one part."""
        data = self.get_bytes(key, limit=limit)
        return None if data is None else iter((data,))

    def move(self, key: str, new_key: str) -> None:
        """Put the value of `key` under `new_key` and remove `key` (what compact sets aside
        it never deletes). This default copies through memory; stores override it with
        their own rename or server-side copy."""
        data = self.get_bytes(key, limit=2**62)
        if data is not None:
            self.put_bytes(new_key, data)
            self.delete(key)

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Every key under prefix, in no particular order."""

    @abc.abstractmethod
    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every key under prefix, from the same listing as
        list_keys: sizes come with it (S3 returns them; a local folder, one stat a file)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove a key; a missing key is not an error."""

    def check(self) -> None:  # noqa: B027 (optional hook, nothing to check by default)
        """Fail fast, before hours of work, when the store cannot be written as configured."""


class LocalStore(Store):
    """A directory on this machine (or a shared filesystem)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*normalize_key(key).split("/"))

    def check(self) -> None:
        """The root, or the nearest folder above it that exists, must be a writable folder:
        StorePathError when it is not (a retry cannot help).

        Creates nothing: a run that fails before writing leaves no empty output folder.
        """
        path = self.root
        try:
            while not path.exists():
                path = path.parent
        except OSError as e:
            raise local_store_error(f"write to {self.root}", e) from e
        if not path.is_dir():
            raise StorePathError(f"cannot write to {self.root}: {path} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise StorePathError(f"cannot write to {self.root}: {path} is not writable "
                                 "(permission denied or a read-only filesystem)")

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Results follow the umask, as the files of any other tool (0644 under 022, 0640
            # under 027), so that a shared results folder or a web server can read them;
            # logs, which may hold secrets, are esd_worker.core.logs' (0600). A symlink planted
            # at the key's name is replaced, its target untouched (write_atomic).
            write_atomic(path, data, 0o666)
        except OSError as e:
            raise local_store_error(f"write {path}", e) from e

    def put_parts(self, key: str, parts: Iterable[bytes]) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, parts, 0o666)  # as put_bytes: each part written as it comes
        except OSError as e:
            raise local_store_error(f"write {path}", e) from e

    def _open(self, key: str, limit: int) -> tuple[BinaryIO, Path, int] | None:
        """The key's file opened for reading, checked to be a regular file of at most
        `limit` bytes; None when there is none. A symlink is followed (a results folder may
        be assembled from links) but what it names must be a regular file too. O_NONBLOCK:
        opening a FIFO for reading would otherwise wait for a writer forever."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise local_store_error(f"read {path}", e) from e
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise StoreRefusal(f"refused to read {path}: it is "
                                   f"{describe_mode(found.st_mode)}, not a regular file: "
                                   "fix the output folder (remove it if it is not yours)")
            if found.st_size > limit:
                raise StoreRefusal(f"refused to read {path}: {found.st_size} bytes, more "
                                   f"than the {limit} it may hold")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb"), path, found.st_size
        except BaseException:
            os.close(fd)
            raise

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        opened = self._open(key, limit)
        if opened is None:
            return None
        f, path, size = opened
        with f:
            try:
                # read(n) allocates n bytes first: ask for the size fstat gave (and one
                # more), then, for a file that grew since, bounded parts up to the limit.
                data = f.read(size + 1)
                while len(data) <= limit and (more := f.read(READ_PART)):
                    data += more
            except OSError as e:
                raise local_store_error(f"read {path}", e) from e
        if len(data) > limit:
            raise StoreRefusal(f"refused to read {path}: more than the {limit} bytes it "
                               "may hold")
        return data

    def get_parts(self, key: str, *, limit: int = READ_LIMIT) -> Iterator[bytes] | None:
        opened = self._open(key, limit)
        return None if opened is None else self._read_parts(*opened[:2])

    def move(self, key: str, new_key: str) -> None:
        path, target = self._path(key), self._path(new_key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return
        except OSError as e:
            raise local_store_error(f"move {path} to {target}", e) from e

    @staticmethod
    def _read_parts(f: BinaryIO, path: Path) -> Iterator[bytes]:
        with f:
            try:
                while part := f.read(READ_PART):
                    yield part
            except OSError as e:
                raise local_store_error(f"read {path}", e) from e

    def exists(self, key: str) -> bool:
        path = self._path(key)
        try:  # is_file() is False for a missing path, but raises for a folder we may not enter
            return path.is_file()
        except OSError as e:
            raise local_store_error(f"look up {path}", e) from e

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        for key, _entry in self._entries(prefix):
            yield key

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        for key, entry in self._entries(prefix):
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # deleted since the folder was read: not there
                continue
            except OSError as e:
                raise local_store_error(f"list {entry.path}", e) from e
            yield key, size

    def _entries(self, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        base = self.root / prefix if prefix else self.root
        try:
            if not base.is_dir():
                return
            yield from self._walk(str(base), prefix.strip("/"))
        except OSError as e:
            raise local_store_error(f"list {base}", e) from e

    def _walk(self, folder: str, rel: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Keys under `folder` (`rel` from the root), depth first as the folder is read:
        a store of millions of models is never listed into memory (os.walk keeps the
        path of every sub-folder of a folder, millions of them under the root)."""
        with os.scandir(folder) as entries:
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir():
                    if not entry.is_symlink():  # as os.walk: a linked folder is not entered
                        yield from self._walk(entry.path, key)
                elif not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                    yield key, entry

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise local_store_error(f"delete {key}", e) from e
