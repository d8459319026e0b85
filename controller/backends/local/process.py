"""One worker attempt as a local subprocess: start it, watch it, stop it, read how it ended.

Owns the OS side of the local backend: argv lists (never a shell), the worker's environment
(GPUs, threads), its own session and parent-death signal, the worker log files (`WorkerLogs`:
one header per attempt, written until the disk refuses, then one warning: logging never
stops the work), the output tail, SIGTERM → SIGKILL escalation, and what an exit status
means for people. Does not decide what runs when, or whether to retry
(controller.backends.local.backend).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

from esd_worker.core.cpus import CPU_SHARE_ENV, usable_cpus
from esd_worker.core.errors import EXIT_MEANINGS, classify_exit, signal_name
from esd_worker.core.logs import open_private
from esd_worker.core.redact import redact

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024


class LogDirError(OSError):
    """The worker log under --log-dir cannot be opened (the sweep stops: exit 2)."""


class WorkerLogs:
    """The worker logs of one run: `<log_dir>/workers/<name>.log` (log_dir None: none).

    Opened 0600 (a custom command's output goes there as it is, unredacted) and only as
    regular files (esd_worker.core.logs.open_private). Written until a write fails (disk full,
    quota, a file too large): then one warning, and the controller opens and writes none of
    them for the rest of the run. A write or close never raises, so a thread that drains a
    worker's stderr into a log keeps draining it (a worker whose pipe nobody reads blocks
    for ever), and the tails kept in memory still reach the failure records. Shared by the
    threads that read the workers' output.
    """

    def __init__(self, log_dir: Path | None) -> None:
        self.log_dir = log_dir
        self.failed = False
        self._lock = threading.Lock()

    def open(self, name: str, mode: Literal["ab", "a+b"] = "ab") -> tuple[IO[bytes], Path] | None:
        """The log `name` opened for appending, and its path; None without a log dir, or
        once a write failed (no more files in a folder that refuses them). LogDirError when
        it cannot be opened (not a regular file, no permission)."""
        if self.log_dir is None or self.failed:
            return None
        directory = self.log_dir / "workers"
        path = directory / f"{safe_name(name)}.log"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return open_private(path, mode), path
        except OSError as e:
            raise LogDirError(f"cannot write the worker log {path}: {e.strerror or e}") from e

    def write(self, out: IO[bytes] | None, text: str) -> None:
        """Append `text` to an open log, unless writing one has failed already."""
        if out is None or self.failed:
            return
        try:
            out.write(text.encode("utf-8", "replace"))
            out.flush()
        except ValueError:  # closed under us (the attempt was reaped): nothing to keep
            pass
        except OSError as e:
            self._fail(e)

    def close(self, out: IO[bytes] | None) -> None:
        """Close a log; what a full disk left in its buffer is dropped, never raised."""
        if out is None:
            return
        try:
            out.close()
        except ValueError:
            pass
        except OSError as e:  # close() flushes: the buffer a refused write left behind
            self._fail(e)

    def _fail(self, error: OSError) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        # Without a log dir the only files are the attempts' temporary ones (for the tail).
        where = self.log_dir / "workers" if self.log_dir is not None else tempfile.gettempdir()
        log.warning("worker logs in %s cannot be written (%s): no more worker output is logged "
                    "there for this run; failure records keep each model's last lines", where,
                    error.strerror or error)


def describe_exit(returncode: int) -> tuple[str, bool]:
    """(error, retryable) for a Popen return code; ("", False) for success.

    The class and whether to retry come from esd_worker.core.errors.classify_exit (the one
    mapping of the worker's exit codes); this adds what happened, for people.
    """
    exit_code, sig = (None, -returncode) if returncode < 0 else (returncode, None)
    cls, retryable = classify_exit(exit_code, sig)
    if not cls:
        return "", False
    if sig is not None:
        return f"{cls}: the worker was killed by {signal_name(sig)}", retryable
    meaning = EXIT_MEANINGS.get(cls)
    detail = f"{meaning} (exit {returncode})" if meaning else f"the worker exited {returncode}"
    return f"{cls}: {detail}", retryable


@dataclass(frozen=True)
class Ended:
    """How an attempt ended: the process's exit (or signal), its output tail, the error."""

    exit_code: int | None
    signal: int | None
    stderr_tail: tuple[str, ...]
    error: str
    retryable: bool


class Attempt:
    """One running worker process: output appended to its log under a header.

    start: the attempt's argv (a list), extra env, GPUs (CUDA_VISIBLE_DEVICES; empty: none
    visible) and CPU threads (OMP_NUM_THREADS unless set). Its output goes to the log `key`
    of `logs` (none: a temporary file, for the tail). Raises LogDirError when the log cannot
    be opened, OSError/ValueError when the command cannot start; a log that cannot be
    written (a full disk) is no reason not to start.
    """

    def __init__(
        self, key: str, argv: Sequence[str], *, number: int, gpus: tuple[int, ...],
        env: Mapping[str, str], logs: WorkerLogs, threads: int | None,
    ) -> None:
        self.gpus = gpus
        self._logs = logs
        opened = logs.open(key, "a+b")  # closed when the attempt is reaped
        self.output: IO[bytes]
        self.log_path: Path | None
        # No log (none asked for, or the folder refused a write): a temporary file all the
        # same, for the tail.
        self.output, self.log_path = opened or (tempfile.TemporaryFile(), None)  # noqa: SIM115
        header = (
            f"\n=== {datetime.now(UTC).isoformat(timespec='seconds')} "
            f"attempt {number} key={key} gpus={','.join(map(str, gpus)) or 'cpu'} ===\n"
            f"$ {redact(shlex.join(argv))}\n"
        )
        logs.write(self.output, header)
        self._offset = self.output.tell()
        try:
            self.proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=self.output,
                stderr=subprocess.STDOUT, env=worker_env(gpus, threads, env),
                start_new_session=True, preexec_fn=die_with_parent(),
            )
        except (OSError, ValueError) as e:
            logs.write(self.output, f"could not start: {redact(str(e))}\n")
            logs.close(self.output)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def ended(self) -> Ended:
        """How the (reaped) process ended; closes its log."""
        tail = read_tail(self.output, self._offset)
        self._logs.close(self.output)
        rc = self.proc.returncode
        error, retryable = describe_exit(rc)
        return Ended(rc if rc >= 0 else None, -rc if rc < 0 else None, tail, error, retryable)

    def signal(self, sig: signal.Signals) -> None:
        signal_group(self.proc, sig)

    def wait(self, timeout_s: float) -> None:
        """Wait for the process; SIGKILL it after `timeout_s`."""
        wait_or_kill(self.proc, timeout_s)
        self._logs.close(self.output)


def signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """Signal a worker's whole process group (its own session), the worker included.

    Only while the worker itself is unreaped: its pid, which is the group id, cannot have
    been reused then.
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def wait_or_kill(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Wait for a worker; SIGKILL its group after `timeout_s`."""
    try:
        proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def worker_env(gpus: tuple[int, ...], threads: int | None,
               env: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: the controller's (secrets reach workers this way, never in
    argv), its GPUs, its CPU threads and the task's extra variables."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # keep the tail complete if it is killed
    full_env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML's numbering, which the tracker uses
    if threads is not None:
        full_env.setdefault("OMP_NUM_THREADS", str(threads))
    full_env.update(env)
    full_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return full_env


def cpu_share_env(gpus: tuple[int, ...], capacity: int) -> dict[str, str]:
    """A GPU worker's share of this machine's CPUs ($ESD_CPU_SHARE: its GPUs' part of the
    usable ones, `capacity` GPUs in all), which its host eigensolvers stay within
    (esd_worker.analysis.hostsolve): one worker per GPU, each sizing its pool to the whole
    machine, would run several threads per core. None for a CPU worker; a share the run's
    environment sets is kept."""
    if not gpus or capacity < 1 or CPU_SHARE_ENV in os.environ:
        return {}
    return {CPU_SHARE_ENV: f"{usable_cpus() * len(gpus) / max(len(gpus), capacity):.2f}"}


def safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@+=" else "_" for c in key) or "task"


def read_tail(output: IO[bytes], offset: int) -> tuple[str, ...]:
    """The last STDERR_TAIL_LINES lines written after `offset` (this attempt's output)."""
    try:
        output.flush()
        end = output.seek(0, os.SEEK_END)
        start = max(offset, end - _TAIL_BYTES)
        output.seek(start)
        data = output.read()
    except (OSError, ValueError):
        return ()
    lines = data.decode("utf-8", "replace").splitlines()
    if start > offset and lines:
        lines = lines[1:]  # the first line is cut
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return tuple(lines[-STDERR_TAIL_LINES:])


_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Any | None:
    """libc's prctl, looked up once in the controller (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that SIGTERMs the worker if the controller dies (Linux), else None.

    Workers run in their own session, so nothing else would stop them when the controller
    is SIGKILLed; orphans would keep their GPUs and race the next run on the same models.
    prctl is looked up in the parent, so the child only makes one foreign call before exec.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the controller died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
