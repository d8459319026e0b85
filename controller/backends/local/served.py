"""One long-lived worker (`esd-worker --serve`) as a local subprocess: send it models, read what
it says, file its log lines under the model they belong to.

Owns the controller's side of esd_worker.core.protocol: request lines on the worker's stdin,
events read from its stdout by a thread, and its stderr split by the worker's model
begin/end lines into `<log_dir>/workers/<model_key>.log` (one header per attempt) and a
tail per model (a crashed model's failure record). Lines outside any model (start-up)
go to `<log_dir>/workers/_worker-<slot>.log`. Every line is redacted (esd_worker.core.redact)
before it is kept or written, and the logs are 0600. The stderr reader drains the pipe to
the end whatever the log files do (a full disk: controller.backends.local.process.WorkerLogs),
since a worker whose stderr nobody reads blocks. Does not decide what to send or what an
exit means (controller.backends.local.slots).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import shlex
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from controller.backends.local.process import (
    STDERR_TAIL_LINES,
    LogDirError,
    WorkerLogs,
    die_with_parent,
    signal_group,
    wait_or_kill,
    worker_env,
)
from esd_worker.core.protocol import DRAIN, MODEL_BEGIN, MODEL_END, Request, parse_event
from esd_worker.core.redact import redact

log = logging.getLogger(__name__)

_READER_JOIN_S = 5.0
# A model's result comes on stdout after its last log line went to stderr; the two pipes are
# read by two threads, so the tail waits this long at most for the stderr reader to catch up.
_TAIL_WAIT_S = 5.0


class ServedWorker:
    """A running `esd-worker --serve`: `send` models, `events` what it said since.

    gpus: its CUDA_VISIBLE_DEVICES (empty: none visible); threads: OMP_NUM_THREADS unless set;
    logs: the run's worker logs. Raises LogDirError when its log cannot be opened,
    OSError/ValueError when the command cannot start.
    """

    def __init__(
        self, argv: Sequence[str], *, slot: int, gpus: tuple[int, ...], env: Mapping[str, str],
        logs: WorkerLogs, threads: int | None,
    ) -> None:
        self.argv = tuple(argv)
        self.slot = slot
        self.gpus = gpus
        self.logs = logs
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._tails: dict[str, deque[str]] = {}
        self._logs: dict[str, Path] = {}
        self._worker_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._lock = threading.Condition()
        self._ended: set[str] = set()  # models whose end line the stderr reader has read
        self._stderr_done = False
        worker_log = self._open(f"_worker-{slot}")  # raises LogDirError first: nothing started
        logs.write(worker_log, f"=== {_now()} worker slot={slot} gpus="
                   f"{','.join(map(str, gpus)) or 'cpu'} ===\n$ {redact(shlex.join(argv))}\n")
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=worker_env(gpus, threads, env), start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self._readers = [
            threading.Thread(target=self._read_events, name=f"esd-events-{slot}", daemon=True),
            threading.Thread(target=self._read_logs, args=(worker_log,),
                             name=f"esd-logs-{slot}", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    # -- requests ---------------------------------------------------------------------------

    def send(self, request: Request) -> bool:
        """Queue a model in the worker; False when it can no longer take input (it died: the
        exit is noticed by `running`)."""
        return self._write_input(request.to_line())

    def drain(self) -> None:
        """Finish the model in progress, start no other, exit."""
        self._write_input(json.dumps({"op": DRAIN}) + "\n")
        self.close_input()

    def close_input(self) -> None:
        """End of input: the worker analyses what it was sent, then exits."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()

    def _write_input(self, line: str) -> bool:
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            return False
        try:
            stdin.write(line.encode("utf-8"))
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def events(self) -> list[dict[str, Any]]:
        """The events read since the last call, in order."""
        got: list[dict[str, Any]] = []
        while True:
            try:
                got.append(self._events.get_nowait())
            except queue.Empty:
                return got

    # -- ending ---------------------------------------------------------------------------

    def signal(self, sig: signal.Signals) -> None:
        signal_group(self.proc, sig)

    def wait(self, timeout_s: float) -> None:
        """Wait for the process; SIGKILL it after `timeout_s`."""
        wait_or_kill(self.proc, timeout_s)
        self.finish_reading()

    def finish_reading(self) -> None:
        """After the exit: let the readers take the last lines and events."""
        for reader in self._readers:
            reader.join(_READER_JOIN_S)
        self.close_input()

    def tail(self, key: str | None, *, ended: bool = False) -> tuple[str, ...]:
        """The last log lines of a model (None: of the worker outside any model). ended: the
        worker said the model ended (its result), so its end line is on the way: wait for
        the stderr reader to have read it (at most _TAIL_WAIT_S), or the error line that
        explains the result may be missing from the tail."""
        with self._lock:
            if key is not None and ended:
                self._lock.wait_for(lambda: key in self._ended or self._stderr_done,
                                    _TAIL_WAIT_S)
            lines = self._tails.get(key) if key is not None else self._worker_tail
            return tuple(lines or ())

    def forget(self, key: str) -> None:
        """Drop what is kept of a model that ended (a worker may analyse millions)."""
        with self._lock:
            self._tails.pop(key, None)
            self._logs.pop(key, None)
            self._ended.discard(key)

    def log_path(self, key: str) -> str | None:
        path = self._logs.get(key)
        return str(path) if path is not None else None

    # -- reader threads ---------------------------------------------------------------------

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                self._events.put(parse_event(line))
            except ValueError as e:
                log.warning("worker slot %d: ignored a line that is not an event (%s): %.200s",
                            self.slot, e, line)

    def _read_logs(self, worker_log: IO[bytes] | None) -> None:
        # To the pipe's end, whatever the logs do: self.logs never raises on a write or close.
        assert self.proc.stderr is not None
        current: str | None = None
        out = worker_log
        try:
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith(MODEL_BEGIN):
                    if out is not worker_log:  # a model that never said it ended
                        self.logs.close(out)
                    current, attempt = _begin(line)
                    out = self._open_model(current, attempt) if current else worker_log
                    continue
                if line.startswith(MODEL_END):
                    if out is not worker_log:
                        self.logs.close(out)
                    with self._lock:
                        if current is not None:
                            self._ended.add(current)
                        self._lock.notify_all()
                    current, out = None, worker_log
                    continue
                line = redact(line)  # the worker's own logs are; a library's print may not be
                with self._lock:
                    tail = self._tails.get(current) if current else self._worker_tail
                    if tail is not None:
                        tail.append(line.rstrip())
                self.logs.write(out, line + "\n")
        finally:
            with self._lock:
                self._stderr_done = True
                self._lock.notify_all()
            if out is not worker_log:
                self.logs.close(out)
            self.logs.close(worker_log)

    def _open_model(self, key: str, attempt: int) -> IO[bytes] | None:
        with self._lock:
            self._tails[key] = deque(maxlen=STDERR_TAIL_LINES)
        try:
            out = self._open(key)
        except LogDirError as e:  # the worker goes on; its tail is still kept
            log.error("%s", e)
            return None
        self.logs.write(out, f"\n=== {_now()} attempt {attempt} key={key} gpus="
                        f"{','.join(map(str, self.gpus)) or 'cpu'} worker pid={self.pid} ===\n")
        return out

    def _open(self, name: str) -> IO[bytes] | None:
        opened = self.logs.open(name)  # closed by the reader thread
        if opened is None:
            return None
        out, self._logs[name] = opened
        return out


def _begin(line: str) -> tuple[str | None, int]:
    try:
        doc = json.loads(line[len(MODEL_BEGIN):])
        return str(doc["key"]), int(doc.get("attempt", 1))
    except (ValueError, KeyError, TypeError):
        return None, 1


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
