"""Log setup for both commands: plain lines for people, JSON lines for clusters (stderr), and
the log files of a run.

Owns how a log line leaves the process: every handler redacts it (esd_worker.core.redact), files
included, and log files are created owner-only (0600: even redacted, a log names private
repos and paths) and only as regular files of our own (a symlink, a FIFO or another user's
file planted at a log's name is refused: esd_worker.core.files). What counts as a secret is
esd_worker.core.redact's.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, TextIO, cast

from esd_worker.core.files import open_regular
from esd_worker.core.redact import redact

LOG_FORMATS = ("text", "json")
_QUIET = ("urllib3", "httpx", "httpcore", "filelock", "huggingface_hub", "botocore", "boto3",
          "s3transfer")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (for cluster log pipelines)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry)


class RedactingFormatter(logging.Formatter):
    """Plain lines with secrets redacted, the traceback included."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class LogFile(logging.FileHandler):
    """A run's log file that, when it can no longer be written (disk full, quota, file too
    large), says so once on stderr and stops, rather than a traceback for every later line;
    the run goes on, logging to stderr."""

    failed = False

    def _open(self) -> io.TextIOWrapper:
        # As open_private: 0600, and a symlink, a FIFO or another user's file at the name is
        # refused (Python's own handler opens through a symlink).
        return cast(io.TextIOWrapper, open(self.baseFilename, self.mode, encoding=self.encoding,
                                           errors=self.errors, opener=_owner_only))

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed = True
        _write_stderr(redact(f"log file {self.baseFilename} cannot be written "
                             f"({error.strerror or error}): logging to stderr only\n"))
        with contextlib.suppress(OSError, ValueError):
            self.close()


def _formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    return RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")


def open_private(path: Path, mode: Literal["ab", "a+b"] = "ab") -> IO[bytes]:
    """A log file opened for appending, readable and writable by its owner only (0600),
    whatever the umask; a file an older version left readable to others is tightened.
    esd_worker.core.files.NotRegularFileError when something other than a regular file is at the
    path (a symlink: its target is neither opened nor chmod'ed), NotOwnedFileError when
    another user's file is (it is left as it is: they could read what we append); OSError
    when it cannot be opened."""
    return cast(IO[bytes], open(path, mode, opener=_owner_only))


def _owner_only(path: str, flags: int) -> int:
    fd = open_regular(path, flags, 0o600, owned=True)
    with contextlib.suppress(OSError):  # ours, but on a file system without modes
        os.fchmod(fd, 0o600)
    return fd


def setup_logging(
    *,
    verbose: bool = False,
    fmt: str = "text",
    stream: TextIO | None = None,
    log_file: Path | None = None,
) -> None:
    """Log to stderr (and to `log_file` when given, always with timestamps, 0600), every
    line redacted; uncaught exceptions print redacted too."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_formatter(fmt))
    handlers: list[logging.Handler] = [handler]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = LogFile(log_file, encoding="utf-8")  # opens it (_open): OSError here
        file_handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            if fmt == "text" else JsonFormatter()
        )
        handlers.append(file_handler)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Third-party chatter (HTTP requests, file locks) only when asked for.
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    # Only Python's own hooks are replaced (a test runner's stay).
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _print_uncaught
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _print_uncaught_in_thread


def _print_uncaught(kind: type[BaseException], error: BaseException,
                    tb: TracebackType | None) -> None:
    """sys.excepthook: the traceback as Python prints it, redacted (an error message may
    hold a URL with its password)."""
    _write_stderr(redact("".join(traceback.format_exception(kind, error, tb))))


def _print_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as Python's own hook: a thread's exit is no error
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    _write_stderr(f"Exception in thread {name}:\n" + redact(text))


def _write_stderr(text: str) -> None:
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()
