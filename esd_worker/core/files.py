"""Writing files in folders that others may write to (a shared results folder, a CI
workspace, a team's hub cache): never through a symbolic link planted at a name we write,
never hanging on a FIFO, never into another user's file.

Owns the refusals (`NotRegularFileError`, `NotOwnedFileError`) for the files a run writes in
place (the lease file and the log files: open_regular) and the one way a file is written
whole (write_atomic: the store's objects, --report, compare --out, the hub cache's refs).
Without them a symlink planted at `_lease.json`, `esd-sweep.log` or a fixed temporary name
makes the run truncate, overwrite, append to or chmod whatever file the link names, as the
user running it. Does not decide what is written, nor the modes (their callers).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable

# A temporary name is `.<name>.<random>.tmp` (esd_worker.core.store.stores skips such names when it
# lists
# keys); the name is cut to 50 characters (200 bytes at most in UTF-8) so that the whole stays
# within a file system's 255 bytes for any name that fits.
_TEMP_STEM = 50
_TEMP_TRIES = 100


class RefusedFileError(OSError):
    """A file at `path` that is not opened or replaced: `why`, then what to do.

    An OSError, so that whoever handles a file it cannot write handles this one the same
    way; its message is one line for after the path ("cannot write <path>: <message>").
    """

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(f"{why}; refused (remove it if it is not yours)")
        self.filename = os.fspath(path)

    def __str__(self) -> str:
        return str(self.args[0])


class NotRegularFileError(RefusedFileError):
    """The path is a symbolic link, a FIFO, a device, a socket or a folder: not opened."""

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(path, f"it is {kind}, not a regular file")


class NotOwnedFileError(RefusedFileError):
    """The path is a regular file that another user owns (open_regular's owned=True): not
    opened, since that user could read what is written to it."""

    def __init__(self, path: str | os.PathLike[str], uid: int) -> None:
        super().__init__(path, f"it belongs to another user (uid {uid}), who could read "
                         "what is written to it")


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o600, *,
                 owned: bool = False) -> int:
    """os.open(path, flags, mode) that opens (or creates) a regular file and nothing else:
    NotRegularFileError when something else is at the path, OSError when the file cannot
    be opened. The descriptor is blocking, as usual.

    owned: the file must be the effective user's (a log, whose lines must stay ours to
    read): NotOwnedFileError when another user owns it, say one they created 0666 at the
    name in a folder both may write. Without it (the lease, shared by several users'
    sweeps) any owner's file is opened.
    """
    # O_NOFOLLOW: a symlink at the name fails with ELOOP instead of opening its target.
    # O_NONBLOCK: opening a planted FIFO for writing would otherwise wait for a reader
    # forever; on a regular file it changes nothing, and it is cleared below.
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        kind = _other_kind(path)
        if kind is not None:
            raise NotRegularFileError(path, kind) from e
        raise
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise NotRegularFileError(path, describe_mode(found.st_mode))
        if owned and found.st_uid != os.geteuid():
            raise NotOwnedFileError(path, found.st_uid)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(path: str | os.PathLike[str], data: bytes | Iterable[bytes],
                 mode: int = 0o666) -> None:
    """Write `data` (bytes, or parts written as they come: a file larger than memory) to
    `path` whole: into a temporary file beside it, flushed to disk, then
    renamed over `path`, so that a reader finds the old file or the new one, never part of
    one, and a crash leaves at most a `.<name>.<random>.tmp`. OSError when it cannot be
    written (the temporary file is removed; the folder must exist); an error raised by the
    parts' iterator removes it too and comes out as it was.

    mode is given at creation, so the umask clears bits as for any file a tool creates.
    The temporary name is random and created exclusively, never through a symlink
    (O_CREAT | O_EXCL | O_NOFOLLOW): a link planted at a name we might use (a fixed
    `<name>.tmp` was one, a pid another) is passed over, and the file it names is never
    written. A symlink at `path` itself is replaced, not followed: rename(2) acts on the
    name, so the link goes and the file it named keeps its bytes (a folder there: OSError).
    Only a link to a regular file (or to nothing) is replaced: one to a device, a FIFO or a
    process's descriptor (`/dev/stdout`) is NotRegularFileError, as is a FIFO or a device at
    the name, since replacing it would remove a system file when run as root.
    """
    _check_replaceable(path)
    folder, name = os.path.split(os.fspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_TRIES):
        tmp = os.path.join(folder, f".{name[:_TEMP_STEM]}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:  # ours from another thread, or planted: another name
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {os.fspath(path)}")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (data,) if isinstance(data, bytes | bytearray | memoryview) else data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def same_file(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether the open `fd` is still the file at `path` (not one unlinked or replaced
    since): a lock taken on a file that another process removed under its own lock locks
    nothing (controller.output.lease, esd_worker.fetch.cachedir)."""
    try:
        opened, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)


def _check_replaceable(path: str | os.PathLike[str]) -> None:
    """NotRegularFileError unless `path` is missing, a regular file, a folder (rename's own
    error), or a symlink to a regular file or to nothing."""
    try:
        here = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(here) or stat.S_ISDIR(here):
        return
    if not stat.S_ISLNK(here):
        raise NotRegularFileError(path, describe_mode(here))
    try:
        there = os.stat(path).st_mode
    except FileNotFoundError:
        return  # a dangling link: replaced, its target never created
    if not stat.S_ISREG(there):
        raise NotRegularFileError(path, f"a symbolic link to {describe_mode(there)}")


def _other_kind(path: str | os.PathLike[str]) -> str | None:
    """What is at the path when it is there and not a regular file; else None."""
    with contextlib.suppress(OSError):
        found = os.lstat(path).st_mode
        if not stat.S_ISREG(found):
            return describe_mode(found)
    return None


def describe_mode(mode: int) -> str:
    """What a file of this st_mode is, as a refusal names it ("a FIFO", "a device")."""
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((name for test, name in kinds if test(mode)), "not a plain file")
