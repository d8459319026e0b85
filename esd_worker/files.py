"""Opening a file that others may have put in place: only a regular file, never through a
symbolic link at its name, never hanging on a FIFO.

Owns the one refusal (`NotRegularFileError`) for the files a run writes in place in a
folder that other users may write to (a shared results folder): the lease file and the log
files. Without it a symlink planted at `_lease.json` or `esd-sweep.log` makes the sweep
truncate, append to or chmod whatever file the link names, as the user running it. Does not
decide what is written, nor the modes (controller.lease, esd_worker.logs); files written
whole by rename (esd_worker.store) replace the name itself and need none of this.
"""

from __future__ import annotations

import contextlib
import os
import stat


class NotRegularFileError(OSError):
    """The path is a symbolic link, a FIFO, a device, a socket or a folder: not opened.

    An OSError, so that whoever handles a file it cannot write handles this one the same
    way; its message is one line for after the path ("cannot write <path>: <message>").
    """

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"it is {kind}, not a regular file; refused (remove it if it is "
                         "not yours)")
        self.filename = os.fspath(path)

    def __str__(self) -> str:
        return str(self.args[0])


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """os.open(path, flags, mode) that opens (or creates) a regular file and nothing else:
    NotRegularFileError when something else is at the path, OSError when the file cannot
    be opened. The descriptor is blocking, as usual."""
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
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise NotRegularFileError(path, _describe(found))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _other_kind(path: str | os.PathLike[str]) -> str | None:
    """What is at the path when it is there and not a regular file; else None."""
    with contextlib.suppress(OSError):
        found = os.lstat(path).st_mode
        if not stat.S_ISREG(found):
            return _describe(found)
    return None


def _describe(mode: int) -> str:
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((name for test, name in kinds if test(mode)), "not a plain file")
