"""Many models in one worker process: each model's outcome in the store, one bad model never
stops the others, and a broken device is charged to no model.

Owns the per-model loop of a long-lived worker: skip what is done, the attempt note that
finds a model which crashed a predecessor ("poison model"), analysis, the failure record a
failed model gets (the controller's schema: esd_worker.core.store.records), one protocol
result per model and its progress heartbeats (esd_worker.core.protocol), and the stop on a
device fault (esd_worker.core.errors.device_fault: no record, exit 6, run elsewhere). Does
not parse flags (esd_worker.cli), read requests (esd_worker.serve.inbox), download ahead
(esd_worker.serve.prefetch) nor check the device before the first model
(esd_worker.serve.runner).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO

from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.echo import echo
from esd_worker.core.errors import (
    ERROR_PREFIX,
    EXIT_DEVICE,
    EXIT_GPU_OOM,
    EXIT_OK,
    EXIT_TRANSIENT,
    EXIT_USAGE,
    FAILURE_CHARS,
    Terminated,
    WorkerError,
    classify_exit,
    device_fault,
    exit_code_for,
    failure_message,
    host_out_of_memory,
)
from esd_worker.core.models.naming import is_model_key
from esd_worker.core.protocol import (
    DONE,
    FAILED,
    SKIPPED,
    Request,
    Result,
    begin_line,
    end_line,
    event_line,
    progress_line,
)
from esd_worker.core.redact import redact
from esd_worker.core.store.layout import (
    RECORD_BYTES,
    attempt_key,
    check_files,
    get_checked,
    read_marker,
)
from esd_worker.core.store.marker import canonical_parameters
from esd_worker.core.store.records import (
    FailureRecord,
    clear_failure,
    read_failure,
    utc_now,
    write_failure,
)
from esd_worker.core.store.stores import Store

log = logging.getLogger("esd_worker")

TAIL_LINES = 20
_CAUSE = re.compile(r"[A-Z][A-Za-z]{0,63}: \S")  # an attempt note's last_error
BEAT_INTERVAL_S = 0.5  # at most two progress lines a second (thousands of tiny layers)


@dataclass(frozen=True)
class BatchSettings:
    """What a long-lived worker does with every model.

    template: the analysis settings (its `model` is replaced per request). run_id: stamped on
    the failure records. max_retries: a model whose attempt note shows more than this many
    starts without an outcome crashed every worker that tried it: recorded as a permanent
    failure and not started again. overwrite: analyse models that are done. skip_failed:
    skip models with a permanent failure record. skip_own_failures: skip models with a
    permanent failure record of this run (a shard's pod retry: that record is the model's
    outcome, while records of earlier runs are tried again, as `esd-sweep run` does).
    fatal_is_crash: a supervised child (esd_worker.serve.supervisor): an error after which
    the process cannot go on ends it as a crash of that model (ProcessPoisoned), so that the
    model's attempt note charges it and a fresh child goes on with the rest; unsupervised
    (--serve), the model gets a retryable record and the batch stops.
    """

    template: WorkerSettings
    run_id: str = ""
    max_retries: int = 2
    overwrite: bool = False
    skip_failed: bool = False
    skip_own_failures: bool = False
    fatal_is_crash: bool = False


class ProcessPoisoned(Exception):
    """A model's error left this process unable to go on (a CUDA out-of-memory past torch's
    allocator): in a supervised child it ends the process with `exit_code`, no record and no
    result, the model's attempt note kept, as a crash would: the supervisor charges the
    model and a fresh child takes the rest, so the model cannot hold up its shard."""

    exit_code = EXIT_GPU_OOM


class ModelLog(logging.Handler):
    """The last log lines of the model in progress (its failure record's tail)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a log line must never fail a model
            self.handleError(record)


@dataclass
class Tally:
    """Outcomes so far; `exit_code` is theirs (Batch.exit_code adds the stops): 0 all done
    or skipped, 4 some failure a retry may fix, 3 only permanent failures."""

    done: int = 0
    failed: int = 0
    skipped: int = 0
    retryable: int = 0

    def add(self, result: Result) -> None:
        if result.status == DONE:
            self.done += 1
        elif result.status == SKIPPED:
            self.skipped += 1
        else:
            self.failed += 1
            self.retryable += result.retryable

    @property
    def exit_code(self) -> int:
        if self.retryable:
            return EXIT_TRANSIENT
        return 3 if self.failed else EXIT_OK


class Heartbeat:
    """The progress lines of the model in progress (esd_worker.core.protocol.progress_line):
    layers done so far and its bytes on disk, so that a watch (esd_worker.core.watchdog)
    tells a hung model from a slow one.

    Called from the analysis' stream threads and the prefetcher, hence the lock. Throttled
    to one line per `interval_s`: a model of thousands of tiny layers must not flood the
    protocol stream; a new size (it raises the model's limit) and the first layer (the
    analysis is under way) go at once.
    """

    def __init__(self, emit: Callable[[str], None], *, interval_s: float = BEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._key: str | None = None
        self._layers = 0
        self._size: int | None = None
        self._sent_at = float("-inf")

    def begin(self, key: str) -> None:
        with self._lock:
            self._key, self._layers, self._size = key, 0, None
            self._sent_at = float("-inf")

    def end(self) -> None:
        with self._lock:
            self._key = None  # a late call (a reader thread) says nothing for the next model

    def __call__(self, layers: int = 0, size_bytes: int | None = None) -> None:
        """`layers` done so far (never goes back); `size_bytes` the model's bytes on disk
        once known (None: unchanged)."""
        with self._lock:
            if self._key is None:
                return
            first_layer = self._layers == 0 < layers
            self._layers = max(self._layers, layers)
            sized = size_bytes is not None and size_bytes != self._size
            if sized:
                self._size = size_bytes
            now = self._clock()
            if not (sized or first_layer) and now - self._sent_at < self._interval_s:
                return
            self._sent_at = now
            # Under the lock: lines leave in order, and never after end().
            self._emit(progress_line(self._key, layers=self._layers, size_bytes=self._size))


Analyse = Callable[[WorkerSettings, Store, str], Any]


class Batch:
    """Analyse requests one by one; `emit` gets one protocol line per event (stdout).

    heartbeat: the model in progress's progress lines (the analysis step and the prefetcher
    call it; default: one on `emit`). A device fault (esd_worker.core.errors.device_fault)
    charges no model: the model in progress gets a retryable result with exit code 6 and
    neither failure record nor attempt note, and the batch stops (`exit_code` 6)."""

    def __init__(self, settings: BatchSettings, store: Store, analyse: Analyse,
                 emit: Callable[[str], None], stderr: TextIO | None = None,
                 finished: Callable[[Request], None] | None = None,
                 heartbeat: Heartbeat | None = None) -> None:
        self.settings = settings
        self.store = store
        self.analyse = analyse
        self.emit = emit
        self.stderr = stderr or sys.stderr
        self.finished = finished  # after each model (the prefetcher evicts what it used)
        self.heartbeat = heartbeat or Heartbeat(emit)
        self.tally = Tally()
        self.fatal = False  # the process cannot go on (a CUDA context error): exit after this
        self.device_broken = False  # ... because the device is broken: exit EXIT_DEVICE
        self._params = canonical_parameters(settings.template.analysis.as_dict())

    def run(self, requests: Iterator[Request]) -> Tally:
        for request in requests:
            try:
                result = self.one(request)
            except BaseException:
                self._finished(request)
                raise
            self.tally.add(result)
            self.emit(result.to_line())  # first: whoever waits on it need not wait for eviction
            self._finished(request)
            if self.fatal:
                log.error("the worker cannot go on after this error; exiting so that a fresh "
                          "one%s takes the next models",
                          " on another node" if self.device_broken else "")
                break
        return self.tally

    @property
    def exit_code(self) -> int:
        """The batch's: 6 the device broke (no model charged), 4 a CUDA error ended the
        process, else the tally's."""
        if self.device_broken:
            return EXIT_DEVICE
        return EXIT_TRANSIENT if self.fatal else self.tally.exit_code

    def _finished(self, request: Request) -> None:
        if self.finished is not None:
            self.finished(request)

    def one(self, request: Request) -> Result:
        """Analyse one model and record how it ended; never raises but for a stop."""
        started = time.perf_counter()
        self.stderr.write(begin_line(request.key, request.attempt))
        self.stderr.flush()
        tail = ModelLog()
        tail.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(tail)
        self.heartbeat.begin(request.key)
        try:
            result = self._one(request, tail)
        finally:
            self.heartbeat.end()
            logging.getLogger().removeHandler(tail)
            self.stderr.write(end_line(request.key))
            self.stderr.flush()
        return replace(result, seconds=round(time.perf_counter() - started, 3))

    def _one(self, request: Request, tail: ModelLog) -> Result:
        key = request.key
        if not is_model_key(key):  # the protocol refuses these; a list never makes one
            error = f"UsageError: {key[:100]!r} is not a model key: nothing was written"
            log.error("model=%s %s", request.model, error)
            return Result(key, FAILED, EXIT_USAGE, error=error)
        try:
            skip = self._skip_reason(key)
            if skip:
                log.info("model=%s key=%s skipped: %s", request.model, key, skip)
                return Result(key, SKIPPED, EXIT_OK, error=skip)
            starts, cause = self._note_start(request)
        except Exception as e:  # the store, before the model started: this model's outcome
            return self._error(request, e, tail)
        # After the note: a worker killed from here on is found by the next one.
        self.emit(event_line("start", key=key))
        if starts > self.settings.max_retries + 1:
            # The cause its supervisor wrote into the note (esd_worker.serve.supervisor:
            # ModelTimeout, HostOutOfMemory, WorkerCrashed by which signal) is the record's.
            error = (f"{cause}; {starts - 1} attempt(s) ended without an outcome: a poison "
                     "model, not tried again") if cause else (
                f"WorkerCrashed: {starts - 1} worker(s) died analysing {request.model} "
                "(out of host memory, a segfault or a fatal CUDA error): a poison model, "
                "not tried again")
            log.error("model=%s key=%s %s", request.model, key, error)
            return self._failed(request, error, None, False, tail, attempts=starts - 1)
        settings = replace(self.settings.template, model=request.model,
                           base_model=request.base_model, relation=request.relation)
        try:
            self.analyse(settings, self.store, key)
        except (KeyboardInterrupt, Terminated):
            self._clear_note(key)  # a stop, not the model's fault
            raise
        except Exception as e:
            return self._error(request, e, tail)
        _release_gpu_memory()
        try:
            clear_failure(self.store, key)
            self._clear_note(key)
        except Exception as e:  # the marker is written: done; a stale record or note stays
            log.warning("model=%s key=%s done, but its old failure record or attempt note "
                        "could not be removed: %s", request.model, key, redact(str(e)))
        return Result(key, DONE, EXIT_OK)

    def _error(self, request: Request, e: Exception, tail: ModelLog) -> Result:
        if device_fault(e):
            return self._device_fault(request, e)
        code = exit_code_for(e)
        if _cuda_out_of_memory(e):  # the GPU was full: the model's size, retried with more
            code, self.fatal = EXIT_GPU_OOM, True
        elif not isinstance(e, WorkerError) and not host_out_of_memory(e):
            log.error("unexpected error analysing %s", request.model, exc_info=e)
        message = redact(failure_message(e, request.model))  # stderr is a pod's log
        self.stderr.write(ERROR_PREFIX + message + "\n")
        tail.lines.append(ERROR_PREFIX + message)
        if self.fatal and self.settings.fatal_is_crash:
            raise ProcessPoisoned(message) from e
        cls, retryable = classify_exit(code, None)
        return self._failed(request, f"{cls}: {message}", code, retryable, tail,
                            attempts=request.attempt)

    def _device_fault(self, request: Request, e: Exception) -> Result:
        """The device broke under the model: nothing recorded against it (its attempt note
        goes: it did not crash the worker, the node did); a retryable result with exit code
        6 so that whoever runs the worker tries it on another node; the batch stops."""
        self.fatal = self.device_broken = True
        error = redact(f"DeviceError: {failure_message(e, request.model)} ({node_label()}): "
                       "nothing recorded against the model")
        log.error("model=%s key=%s %s", request.model, request.key, error)
        self.stderr.write(ERROR_PREFIX + error + "\n")
        try:
            self._clear_note(request.key)
        except Exception as cleared:  # the next worker counts one start too many, no more
            log.warning("model=%s key=%s attempt note not removed: %s", request.model,
                        request.key, redact(str(cleared)))
        return Result(request.key, FAILED, EXIT_DEVICE, error=error, retryable=True)

    def _skip_reason(self, key: str) -> str:
        if not self.settings.overwrite:
            marker = read_marker(self.store, key)
            if marker is not None and marker.parameters == self._params:
                damage = check_files(self.store, marker)
                if damage is None:
                    return "done already (same parameters)"
                log.warning("model_key=%s result damaged (%s): analysing it again", key,
                            damage)
        if self.settings.skip_failed or self.settings.skip_own_failures:
            record = read_failure(self.store, key)
            if record is not None and not record.retryable and (
                    self.settings.skip_failed or record.run_id == self.settings.run_id):
                return f"permanent failure record ({record.error})"
        return ""

    def _failed(self, request: Request, error: str, code: int | None, retryable: bool,
                tail: ModelLog, *, attempts: int) -> Result:
        _release_gpu_memory()
        record = FailureRecord(
            model=request.model, model_key=request.key, error=error, exit_code=code,
            signal=None, retryable=retryable, attempts=attempts, stderr_tail=tuple(tail.lines),
            run_id=self.settings.run_id, time=utc_now(),
        )
        try:
            write_failure(self.store, record)
            self._clear_note(request.key)
        except Exception as e:
            # The store refuses now (an outage, a full disk): the outcome is not recorded, so
            # it must be retryable, or a shard's pod would count the model as settled.
            log.error("model=%s key=%s failure record not written: %s", request.model,
                      request.key, redact(str(e)))
            retryable = True
        return Result(request.key, FAILED, code if code is not None else 3, error=error,
                      retryable=retryable)

    # -- the attempt note: a model that kills its worker is found by the next one ------------

    def _note_start(self, request: Request) -> tuple[int, str]:
        """Record that this worker starts the model; the number of starts so far, this one
        included (earlier starts without an outcome are crashes), and the cause the last one
        ended with when a supervisor wrote it ("": none)."""
        key = attempt_key(request.key)
        data = get_checked(self.store, key, RECORD_BYTES)  # refused: written afresh
        earlier, cause = (0, "") if data is None else self._earlier_starts(key, data)
        starts = 1 + earlier
        note = {"model": request.model, "starts": starts, "run_id": self.settings.run_id,
                "host": platform.node(), "pid": os.getpid(), "time": utc_now()}
        self.store.put_bytes(key, (json.dumps(note) + "\n").encode())
        return starts, cause

    def _earlier_starts(self, key: str, data: bytes) -> tuple[int, str]:
        """The starts a note counts for this run, and its `last_error` (_note_cause).
        Another run's note counts none: that run
        recorded the model (its controller counted the crashes and removes the note with the
        record) or was stopped under it, and `--retry-failed` means try again. A note that
        is not one (forged, or more starts than this run allows: the start after the last
        allowed one records the model and removes the note) counts none either: it must not
        make an untried model poison."""
        try:
            note = json.loads(data)
            starts, run_id = note["starts"], note.get("run_id", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("attempt note %s is not one: ignored", key)
            return 0, ""
        if (isinstance(starts, bool) or not isinstance(starts, int)
                or not 1 <= starts <= self.settings.max_retries + 1 or not isinstance(run_id, str)):
            log.warning("attempt note %s holds starts=%.40r: ignored", key, starts)
            return 0, ""
        if run_id != self.settings.run_id:
            log.info("attempt note %s is run %.80r's (%d start(s)): this run %.80r counts "
                     "its own", key, run_id, starts, self.settings.run_id)
            return 0, ""
        return starts, _note_cause(note.get("last_error"))

    def _clear_note(self, key: str) -> None:
        self.store.delete(attempt_key(key))


def _cuda_out_of_memory(e: BaseException) -> bool:
    """A CUDA error that says the GPU was full ("CUDA error: out of memory", cuBLAS's
    ALLOC_FAILED), raised past torch's OutOfMemoryError: the process exits after it, its
    allocator may not recover (device_fault leaves these to the model)."""
    if isinstance(e, WorkerError) or not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return ("cuda" in text or "cublas" in text) and (
        "out of memory" in text or "alloc_failed" in text)


def node_label(environ: Mapping[str, str] | None = None) -> str:
    """Where this worker runs, for the lines that blame a device: the Kubernetes node
    ($NODE_NAME, which the Job's pod gets through the Downward API) and this host (a pod's
    name in a pod)."""
    env = os.environ if environ is None else environ
    host = platform.node() or "unknown host"
    node = env.get("NODE_NAME", "").strip()
    return f"node={node} host={host}" if node and node != host else f"node={host}"


def _note_cause(value: object) -> str:
    """The cause a supervisor wrote into a note, "Class: message" on one line and bounded;
    "" when there is none or it is not one (a forged note must not name a class)."""
    if not isinstance(value, str) or not _CAUSE.match(value):
        return ""
    return echo(" ".join(value.split()), limit=FAILURE_CHARS)


def _release_gpu_memory() -> None:
    """Give cached GPU blocks back between models (the next may need them all)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


