"""The supervisor of `esd-worker --shards` and `--models`: the batch runs in a child process,
and a model that crashes, hangs or leaks memory costs that model's retries only.

Owns the parent process: starting the child (the same command line, SUPERVISED_ENV set, in
its own process group, its protocol lines forwarded unchanged), watching it (the model in
progress against its no-progress limit, esd_worker.core.watchdog; the child's resident
memory against --memory-limit), killing it (SIGKILL: its SIGTERM handler would clear the
model's attempt note, and the note is what charges the model), charging the model in
progress with the cause (`last_error` in its attempt note: the next child's batch turns it
into the poison record once the model is out of retries, esd_worker.serve.batch), restarts,
the rounds after a transient exit, and the process's exit code. A shard's progress document
lives here, fed the children's events (esd_worker.serve.shardprogress). Torch-free: the parent stays
small and outlives whatever the child does. Does not own the per-model loop (batch), the
no-progress policy (watchdog), nor which shard a pod takes (runner); `--serve` is watched by
its controller instead (controller.backends.local).

Exit codes (esd_worker.serve.runner's contract, and):
- a child that crashes (a signal, or an exit other than 0, 2, 3, 4, 6) with a model in
  progress, or is killed here for that model: the model is charged, a new child goes on
  (the cause: ModelTimeout, HostOutOfMemory past --memory-limit or when the cgroup counts
  the SIGKILL as the kernel's OOM kill, GpuOutOfMemoryError for the batch's exit 5 after a
  CUDA out-of-memory it cannot go on from (esd_worker.serve.batch.ProcessPoisoned), else
  WorkerCrashed and the signal or code);
- a child that exits 2 (usage), 3 (store unusable; --models: some models failed for good),
  6 (device fault), or dies with no model in progress: that code at once (128+N for signal
  N): a fault of the pod or its node, which Kubernetes counts;
- a child that exits 4 (some model failed in a way a retry may fix): up to --max-retries
  more rounds after a short backoff; then --shards exits 0 when every model of the shard had
  an outcome in the last round (the retryable records: the next `esd-sweep run` retries
  them), --models exits 4;
- SIGTERM or SIGINT to the parent: SIGTERM to the child (it clears its note: a stop is not
  the model's fault), then exit 4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, BinaryIO

from esd_worker.core.errors import (
    EXIT_DEVICE,
    EXIT_MEANINGS,
    EXIT_OK,
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    EXIT_USAGE,
    classify_exit,
    signal_name,
)
from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.redact import redact
from esd_worker.core.store.layout import RECORD_BYTES, attempt_key
from esd_worker.core.store.records import utc_now
from esd_worker.core.store.stores import Store
from esd_worker.core.watchdog import DEFAULT_MODEL_TIMEOUT_S, ModelWatch
from esd_worker.serve.hostmemory import (
    CGROUP_EVENTS_FILE,
    container_memory_limit,
    group_rss,
    oom_kills,
)
from esd_worker.serve.shardprogress import ShardProgress, shard_progress

if TYPE_CHECKING:
    from esd_worker.serve.runner import Shard

log = logging.getLogger("esd_worker")

SUPERVISED_ENV = "ESD_WORKER_SUPERVISED"  # set in the child: its number (1 for the first)
HOST_OUT_OF_MEMORY = "HostOutOfMemory"
WORKER_CRASHED = "WorkerCrashed"
POLL_S = 0.5
BACKOFF_S = 2.0  # before a transient round: times the round's number
STOP_GRACE_S = 25.0  # a stopped child's time to clear its note (Kubernetes gives 30 s)
LIMIT_SHARE = 0.9  # of the container's: the parent and the page cache need the rest
FAULT_EXITS = (EXIT_USAGE, EXIT_PERMANENT, EXIT_DEVICE)  # the pod's or node's: exit at once


def supervised_child(environ: Mapping[str, str] = os.environ) -> int:
    """This process's number as a supervised child (1 for the first), 0 when it is none."""
    raw = environ.get(SUPERVISED_ENV, "")
    return int(raw) if raw.isdigit() else 0


@dataclass(frozen=True)
class SupervisorSettings:
    """How the child is run and watched.

    argv: the child's command line. max_retries: --max-retries (the rounds after a transient
    exit; a model's crashes are bounded by its attempt note). model_timeout_s: the floor of
    the no-progress limit, seconds. memory_limit: the child group's resident bytes (None:
    none); memory_source: where that number comes from, for the error; oom_events: the
    cgroup's memory.events (None: not read). sharded: --shards.
    keys: the models' keys when known (None: the list could not be read here; the child
    reports it). run_id: of the notes. poll_s, backoff_s, stop_grace_s: seconds.
    """

    argv: Sequence[str]
    max_retries: int = 2
    model_timeout_s: float = DEFAULT_MODEL_TIMEOUT_S
    memory_limit: int | None = None
    memory_source: str = "--memory-limit"
    oom_events: Path | None = None
    sharded: bool = False
    keys: frozenset[str] | None = None
    run_id: str = ""
    poll_s: float = POLL_S
    backoff_s: float = BACKOFF_S
    stop_grace_s: float = STOP_GRACE_S


@dataclass
class Child:
    """How one child ended: its exit code or signal, the model in progress then (None: none),
    why it was killed here (None: it ended by itself), whether the kernel's OOM killer killed
    it, the keys it gave a result for."""

    code: int | None = None
    signal: int | None = None
    key: str | None = None
    killed_for: str | None = None
    oom_killed: bool = False
    results: set[str] = field(default_factory=set)


class Supervisor:
    """Runs children until the batch is over; `run` returns the process's exit code."""

    def __init__(self, settings: SupervisorSettings, store: Store, *,
                 out: BinaryIO | None = None, environ: Mapping[str, str] | None = None,
                 proc: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic,
                 progress: ShardProgress | None = None) -> None:
        self.settings = settings
        self.progress = progress  # --shards: the shard's progress document (shardprogress)
        self.store = store
        self.out = out or sys.stdout.buffer
        self.environ = dict(os.environ if environ is None else environ)
        self.proc = proc
        self.clock = clock
        self.children = 0
        self.charged: Counter[str] = Counter()
        self._stop: int | None = None

    def run(self) -> int:
        previous = {s: _handle(s, self._on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        code = EXIT_TRANSIENT
        if self.progress is not None:
            self.progress.start()
        try:
            code = self._run()
            return code
        finally:
            if self.progress is not None:
                self.progress.finish(code)
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stop = signum

    def _run(self) -> int:
        rounds = 0
        while True:
            child = self._child() if self._stop is None else Child()
            if self._stop is not None:
                log.warning("stopped by %s: the model in progress was not charged",
                            signal_name(self._stop))
                return EXIT_TRANSIENT
            if child.killed_for is not None or self._crashed(child):
                if not self._charge(child):
                    return EXIT_TRANSIENT
                continue
            if child.signal is not None:
                log.error("the worker was killed by %s with no model in progress: a fault of "
                          "this pod or node", signal_name(child.signal))
                return 128 + child.signal
            code = child.code if child.code is not None else EXIT_TRANSIENT
            if code != EXIT_TRANSIENT:
                return code  # done (0), or a fault of the pod or node (FAULT_EXITS)
            if rounds >= self.settings.max_retries:
                return self._after_rounds(child)
            rounds += 1
            wait = self.settings.backoff_s * rounds
            log.warning("some models failed in a way a retry may fix: round %d of %d in "
                        "%.0f s", rounds, self.settings.max_retries, wait)
            if not self._sleep(wait):
                return EXIT_TRANSIENT

    @staticmethod
    def _crashed(child: Child) -> bool:
        """Died under a model: a signal, or an exit no batch makes on its own."""
        if child.key is None:
            return False
        return child.signal is not None or child.code not in (EXIT_OK, EXIT_TRANSIENT,
                                                              *FAULT_EXITS)

    def _after_rounds(self, child: Child) -> int:
        """The exit once the rounds are spent: a shard whose models all had an outcome in the
        last round is complete (its retryable records are retried by the next run)."""
        keys = self.settings.keys
        if self.settings.sharded and keys is not None and keys <= child.results:
            log.warning("models that failed in a way a retry may fix keep their retryable "
                        "records: the next run retries them")
            return EXIT_OK
        return EXIT_TRANSIENT

    def _sleep(self, seconds: float) -> bool:
        """Wait, unless stopped meanwhile (False)."""
        end = self.clock() + seconds
        while self._stop is None and self.clock() < end:
            time.sleep(min(0.1, max(0.0, end - self.clock())))
        return self._stop is None

    # -- one child ------------------------------------------------------------------------

    def _child(self) -> Child:
        self.children += 1
        env = self.environ | {SUPERVISED_ENV: str(self.children)}
        ooms = oom_kills(self.settings.oom_events)
        proc = subprocess.Popen(list(self.settings.argv), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, env=env, process_group=0,
                                preexec_fn=_die_with_parent)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        watch = ModelWatch(self.settings.model_timeout_s)
        child = Child()
        pending, eof = b"", False
        stopping_since: float | None = None
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not _exited(proc.pid):
                if self._stop is not None and stopping_since is None:
                    stopping_since = self.clock()
                    _kill_group(proc.pid, signal.SIGTERM)
                if eof:  # it closed its stdout and has not exited yet: its cleanup
                    time.sleep(self.settings.poll_s)
                else:
                    selector.select(self.settings.poll_s)
                    pending, eof = self._read(fd, pending, watch, child)
                now = self.clock()
                if self.progress is not None:
                    self.progress.tick()
                if stopping_since is not None:
                    if now - stopping_since > self.settings.stop_grace_s:
                        _kill_group(proc.pid, signal.SIGKILL)
                elif child.killed_for is None and watch.key is not None:
                    cause = watch.overdue(now) or self._over_memory(proc.pid, watch.key)
                    if cause is not None:
                        child.killed_for = cause
                        _kill_group(proc.pid, signal.SIGKILL)
        # Before it is reaped (its group id cannot be reused yet): whatever it started goes
        # with it, so that no process outlives it.
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        _reap_orphans()
        if not eof:
            pending, _ = self._read(fd, pending, watch, child, until_eof=True)
        proc.stdout.close()
        if self.progress is not None:
            self.progress.child_ended()
        child.key = watch.key
        if proc.returncode < 0:
            child.signal = -proc.returncode
            after = oom_kills(self.settings.oom_events)
            child.oom_killed = (child.signal == signal.SIGKILL and ooms is not None
                                and after is not None and after > ooms)
        else:
            child.code = proc.returncode
        return child

    def _read(self, fd: int, pending: bytes, watch: ModelWatch, child: Child,
              until_eof: bool = False) -> tuple[bytes, bool]:
        """Forward the complete lines the child wrote and follow its events; (what is left
        of a line, whether the pipe is at its end)."""
        eof = False
        deadline = self.clock() + 2.0
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                if not until_eof or self.clock() > deadline:
                    break
                time.sleep(0.01)
                continue
            if not chunk:
                eof = True
                break
            pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            self.out.write(line + b"\n")  # unchanged: whoever reads the pod's log reads this
            self._follow(line, watch, child)
        self.out.flush()
        return pending, eof

    def _follow(self, line: bytes, watch: ModelWatch, child: Child) -> None:
        try:
            event = json.loads(line)
            kind, key = event["event"], event.get("key")
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # not a protocol line: forwarded, not followed
        if not isinstance(key, str):
            return
        if self.progress is not None:
            self.progress.follow(event)
        now = self.clock()
        if kind == "start":
            watch.start(key, now)
        elif kind == "progress":
            size = event.get("bytes")
            watch.beat(key, now, size if isinstance(size, int) else None)
        elif kind == "result":
            child.results.add(key)
            if key == watch.key:
                watch.end()

    def _over_memory(self, pgid: int, key: str) -> str | None:
        limit = self.settings.memory_limit
        if limit is None:
            return None
        rss = group_rss(pgid, self.proc)
        if rss <= limit:
            return None
        return memory_cause(self._model(key), limit, rss, self.settings.memory_source)

    # -- charging the model ---------------------------------------------------------------

    def _charge(self, child: Child) -> bool:
        """Write why the child ended into the model's attempt note; False when a model was
        charged more often than its retries allow (the notes do not count: stop)."""
        key = child.key
        assert key is not None
        cause = child.killed_for or self._crash_cause(child, key)
        log.error("model_key=%s %s: a new worker goes on", key, redact(cause))
        self.charged[key] += 1
        self._write_cause(key, cause)
        if self.charged[key] > self.settings.max_retries + 1:
            log.error("model_key=%s charged %d times, more than --max-retries allows: its "
                      "attempt note is not counted (the store?); stopping", key,
                      self.charged[key])
            return False
        return True

    def _crash_cause(self, child: Child, key: str) -> str:
        if child.oom_killed:
            return (f"{HOST_OUT_OF_MEMORY}: the kernel's OOM killer killed the worker (the "
                    f"container's memory limit) analysing {self._model(key)}")
        return crash_cause(self._model(key), signum=child.signal, code=child.code)

    def _model(self, key: str) -> str:
        """The model's reference as its note names it, else its key."""
        note = self._note(key)
        model = note.get("model") if note else None
        return model if isinstance(model, str) and model else key

    def _note(self, key: str) -> dict[str, Any] | None:
        try:
            data = self.store.get_bytes(attempt_key(key), limit=RECORD_BYTES)
            note = json.loads(data) if data is not None else None
        except Exception as e:  # the store, or a note that is not one: written afresh
            log.warning("model_key=%s attempt note not read: %s", key, redact(str(e)))
            return None
        return note if isinstance(note, dict) else None

    def _write_cause(self, key: str, cause: str) -> None:
        write_cause(self.store, key, cause, run_id=self.settings.run_id, note=self._note(key))


def crash_cause(model: str, *, signum: int | None = None, code: int | None = None) -> str:
    """The cause of a child that died under `model`: by signal `signum`, or exit `code`."""
    if signum is None and code is not None:
        cls, _ = classify_exit(code, None)
        if cls in EXIT_MEANINGS and cls != WORKER_CRASHED:  # a batch's own "cannot go on"
            return (f"{cls}: the worker exited {code} ({EXIT_MEANINGS[cls]}; its process "
                    f"could not go on) while analysing {model}")
    how = (f"killed by {signal_name(signum)}" if signum is not None
           else f"exited with code {code}")
    return f"{WORKER_CRASHED}: {how} while analysing {model}"


def memory_cause(model: str, limit: int, rss: int, source: str) -> str:
    """The cause of a child killed for passing the memory limit (`source`: where it is from)."""
    return (f"{HOST_OUT_OF_MEMORY}: the worker passed {limit / 2**30:.2f} GiB ({source}; "
            f"{rss / 2**30:.2f} GiB resident) analysing {model}: killed")


def write_cause(store: Store, key: str, cause: str, *, run_id: str,
                note: dict[str, Any] | None) -> None:
    """Put `cause` into the model's attempt note (`note`: as read, None when missing or not
    one) as its `last_error`: the batch's poison record names it (esd_worker.serve.batch).
    The child wrote the note before it said `start`; a note missing here (removed by hand)
    is written with this one start, so that the crash still counts."""
    note = dict(note) if note is not None else {
        "model": key, "starts": 1, "run_id": run_id, "host": platform.node(),
        "pid": os.getpid(), "time": utc_now()}
    note["last_error"] = cause
    try:
        store.put_bytes(attempt_key(key), (json.dumps(note) + "\n").encode())
    except Exception as e:  # the crash still counts by the note's starts
        log.warning("model_key=%s cause not written to its attempt note: %s", key,
                    redact(str(e)))


def _handle(signum: int, handler: Callable[[int, FrameType | None], None]) -> Any:
    try:
        return signal.signal(signum, handler)
    except ValueError:  # not the main thread: no stop handling (a test's thread)
        return None


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, so that no orphan
    analyses on (SIGTERM: a stop, the model's note is cleared)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _reap_orphans() -> None:
    """As a container's PID 1, reap what the dead child left (its processes are ours then):
    zombies must not pile up over restarts. Elsewhere they are someone else's to reap."""
    if os.getpid() != 1:
        return
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its group id stays its own)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, signum)


def supervise(args: argparse.Namespace, argv: Sequence[str], store: Store,
              shard: Shard | None) -> int:
    """Run `esd-worker` with `argv` (--models or --shards: `shard`) as a supervised child;
    the exit code as the module docstring says. A shard's progress document is kept here."""
    limit, source = args.memory_limit, "--memory-limit"
    if limit is None:
        container = container_memory_limit()
        if container is not None:
            limit = int(container * LIMIT_SHARE)
            source = (f"{LIMIT_SHARE:.0%} of the container's memory limit, "
                      f"{container / 2**30:.2f} GiB; --memory-limit sets it")
    settings = SupervisorSettings(
        argv=[sys.executable, "-m", "esd_worker.cli", *argv],
        max_retries=args.max_retries,
        model_timeout_s=args.model_timeout or DEFAULT_MODEL_TIMEOUT_S,
        memory_limit=limit, memory_source=source, oom_events=CGROUP_EVENTS_FILE,
        sharded=shard is not None,
        keys=_keys(shard.url if shard is not None else args.models), run_id=args.run_id)
    progress = None if shard is None else shard_progress(
        shard.folder, shard.index, run_id=args.run_id, keys=settings.keys, results=store)
    return Supervisor(settings, store, progress=progress).run()


def _keys(url: str) -> frozenset[str] | None:
    """The keys of the list's models; None when it cannot be read here (the child says why)."""
    try:
        return frozenset(row.key for row in read_model_list(url).rows)
    except Exception:
        return None
