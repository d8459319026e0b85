"""`esd-worker --models FILE`, `--shards URL` and `--serve`: wire the inbox, the prefetcher and
the batch loop.

Owns the process side of a long-lived worker: which shard of a sharded run a pod takes
(`locate_shard`), the protocol stream (stdout kept for protocol lines only: stray prints go
to stderr), the batch's exit code, the one-line summary, and the results-tables writer's
life (esd_worker.serve.tablewriter: written as the batch goes, and when it ends or stops).
Imports torch only once the store has been checked (esd_worker.cli). Does not own the shard
keys (esd_worker.core.store.layout) nor how the controller splits a run into shards.

Exit codes of a batch (the codes themselves are esd_worker.core.errors'):

- every mode: 6 the device is broken (a node fault, never a model's): the device check
  before the first model failed (with a CUDA device asked for: esd_worker.serve.selfcheck,
  under a second), or a model met an error that poisons the CUDA context or says the GPU is
  gone (esd_worker.core.errors.device_fault). Nothing is recorded against any model (that
  model's result is retryable, exit_code 6, and its attempt note goes); the error line
  names the node ($NODE_NAME, and this host). Run the work on another node.
- `--models`, `--serve`: 0 every model done or skipped; 3 some failed permanently (each has
  its failure record); 4 some failure a retry may fix, a stop (SIGTERM, Ctrl+C), or a CUDA
  out-of-memory error after which the process exits.
- `--shards` (a contract: the controller's Indexed Job podFailurePolicy maps these):
  0 every model of the shard has its outcome in the store: done, skipped, or failed
    permanently (the failure record is the outcome: where --models exits 3, --shards
    exits 0, so that Kubernetes counts the index complete and does not retry it);
  4 some model failed in a way a retry may fix (its record says retryable), a CUDA
    out-of-memory error, or a stop: Kubernetes retries the index (backoffLimitPerIndex)
    and the next pod skips what is done, and what failed permanently in this run
    (--run-id: that record is the model's outcome; records of earlier runs are tried
    again unless --skip-failed);
  2 the shard cannot run at all: no index (neither --shard-index nor JOB_COMPLETION_INDEX),
    an index that is not a whole number >= 0, the shard missing or not a model list;
  3 (as for any worker) the store is unusable as configured (no bucket, access denied) or a
    bug outside any model; a store that cannot be reached just now is 4;
  6 as in every mode (the pod's node is broken): the index is retried elsewhere.

--cache-budget is a hard bound for one model: a model that does not fit in it with its base
fails at once (permanently, exit 3), naming its size, the budget, the flag and in a shard the
resource class, before a byte is downloaded (esd_worker.serve.prefetch).

Under a supervisor (esd_worker.serve.supervisor, the parent of `--models` and `--shards`;
`--serve` is watched by its controller): the batch runs in its child, and a model that kills
the child, shows no progress for its limit (--model-timeout) or passes --memory-limit costs
that model's retries only: a new child goes on, and once --max-retries are spent the model's
record names the cause (WorkerCrashed, ModelTimeout, HostOutOfMemory). After a 4 the batch
runs again, up to --max-retries more times; then --shards exits 0 when every model had its
outcome (retryable records: the next run retries them), --models 4. A child that dies with
no model in progress ends the process with 128+N (signal N): the pod's or node's fault.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.command.workerparser import SHARD_INDEX_ENV
from esd_worker.core.errors import (
    EXIT_OK,
    EXIT_PERMANENT,
    DeviceError,
    ModelListError,
    UsageError,
)
from esd_worker.core.protocol import Request, event_line
from esd_worker.core.redact import redact
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.stores import Store
from esd_worker.serve.batch import Batch, BatchSettings, Heartbeat, ProcessPoisoned, node_label
from esd_worker.serve.inbox import Inbox, requests_from_list

log = logging.getLogger("esd_worker")

_WHOLE_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of the shard folder `folder`: the model list at `url`."""

    folder: str
    index: int

    @property
    def url(self) -> str:
        return f"{self.folder.rstrip('/')}/{self.index}.csv"


def locate_shard(folder: str, index: str | None,
                 environ: Mapping[str, str] = os.environ) -> Shard:
    """The shard this process takes: `index` (--shard-index) when given, else
    $JOB_COMPLETION_INDEX; UsageError naming the folder and the index when there is none or
    it is not a whole number >= 0."""
    if not folder.strip():
        raise UsageError("--shards needs the URL of a shard folder")
    where = "--shard-index" if index is not None else SHARD_INDEX_ENV
    raw = index if index is not None else environ.get(SHARD_INDEX_ENV)
    if raw is None or not raw.strip():
        raise UsageError(f"no shard index for {folder}: pass --shard-index N or set "
                         f"{SHARD_INDEX_ENV} (Kubernetes sets it in Indexed Job pods)")
    if not _WHOLE_NUMBER.fullmatch(raw.strip()):
        raise UsageError(f"shard index {raw!r} ({where}) of {folder} is not a whole "
                         "number >= 0")
    return Shard(folder, int(raw.strip()))


def run_batch(args: argparse.Namespace, template: WorkerSettings, store: Store,
              shard: Shard | None = None, *, resumed: bool = False,
              supervised: bool = False) -> int:
    """Analyse every model of --models or of `shard` (--shards), or of the requests on stdin
    with --serve; the exit code as the module docstring says. resumed: a supervised child
    after the first (esd_worker.serve.supervisor), which skips what failed for good in this
    run as a shard's pod retry does; supervised: any supervised child, where an error the
    process cannot go on after ends it as that model's crash (batch.ProcessPoisoned)."""
    if args.max_retries < 0:  # --prefetch is checked by its flag (flags.PREFETCH_COUNT)
        raise UsageError("--max-retries must be >= 0")
    started = time.perf_counter()
    if args.serve:
        inbox = Inbox()
    elif shard is not None:
        requests = _shard_requests(shard)
        inbox = Inbox(requests, closed=True)
        log.info("shard %d of %s: %d model(s)", shard.index, shard.folder, len(requests))
    else:
        requests = requests_from_list(args.models)
        inbox = Inbox(requests, closed=True)
        log.info("%d model(s) from %s", len(requests), args.models)
    protocol = _protocol_stream()

    def emit(line: str) -> None:
        protocol.write(redact(line))  # a result's error may quote a URL or a config value
        protocol.flush()

    heartbeat = Heartbeat(emit)  # the model in progress: its size, then its layers

    from esd_worker.serve.prefetch import Prefetcher  # no torch: downloads start during imports

    cache_dir: Path | None = args.cache_dir
    budget = download_budget(args.cache_budget, cache_dir, shard)
    try:
        prefetcher = Prefetcher(inbox, depth=args.prefetch, budget=budget.read_ahead,
                                limit=budget.limit, budget_source=budget.source,
                                cache_dir=cache_dir, own_cache=cache_dir is not None,
                                sized=heartbeat)
    except OSError as e:  # the cache folder cannot be made or written
        raise UsageError(f"--cache-dir {cache_dir}: {e.strerror or e}") from e
    from esd_worker.analysis.analyze import analyse_model  # torch: after the store check
    from esd_worker.analysis.metamodel import warm_up

    # transformers and CUDA start while the first model downloads (not a daemon: a thread
    # killed inside an import at exit can abort the interpreter).
    threading.Thread(target=warm_up, kwargs={"cuda": template.device != "cpu"},
                     name="esd-warm-up").start()
    if template.device != "cpu":
        try:
            check_device(template.device)
        except DeviceError:
            prefetcher.close()
            raise
    if args.serve:  # after the check: a worker on a broken node answers no request
        inbox.read_from(sys.stdin)

    # The finished models' table rows, written as parts as the batch goes and when it ends
    # or stops (a SIGTERM, a drain, a poisoned process: the `finally` below).
    from esd_worker.core.store.tables import DoneModel  # pyarrow: only a batch needs it
    from esd_worker.serve.tablewriter import TableWriter

    tables = TableWriter(store).start()

    def add_to_tables(marker: Marker, rows: Sequence[dict[str, Any]]) -> None:
        tables.add(DoneModel(marker, rows))

    def analyse(settings: WorkerSettings, target: Store, key: str) -> Any:
        return analyse_model(settings, store=target, model_key=key, resolve=prefetcher.resolve,
                             progress=heartbeat, done=add_to_tables)

    batch = Batch(
        # A shard's pod retry must not retry what failed for good in this run: that record is
        # the model's outcome. A later run tries it again, as `esd-sweep run` does.
        BatchSettings(template=template, run_id=args.run_id, max_retries=args.max_retries,
                      overwrite=args.overwrite, skip_failed=args.skip_failed,
                      skip_own_failures=shard is not None or resumed,
                      fatal_is_crash=supervised),
        store, analyse, emit, finished=prefetcher.finished, heartbeat=heartbeat,
    )
    emit(event_line("ready", pid=os.getpid()))
    try:
        tally = batch.run(iter(inbox))
    except ProcessPoisoned as e:  # the supervisor charges the model in progress
        log.error("the worker cannot go on after this model's error: exiting %d so that a "
                  "fresh one takes the next models", e.exit_code)
        return e.exit_code
    finally:
        try:  # first: a stop's grace period (the supervisor's, a pod's) is for this
            tables.close()
        finally:
            prefetcher.close()
        if tables.parts_written:
            log.info("results tables: %d model(s) written in %d part(s)", tables.models_written,
                     tables.parts_written)
    log.info("batch: %d done, %d failed, %d skipped in %.1fs", tally.done, tally.failed,
             tally.skipped, time.perf_counter() - started)
    return batch_exit_code(batch.exit_code, sharded=shard is not None)


def batch_exit_code(code: int, *, sharded: bool) -> int:
    """The process's exit for the batch's `code`: a shard whose models all have their
    outcome (3: the permanent ones' records) is complete (0); every other code, 6 (the
    device) included, is the batch's."""
    if sharded and code == EXIT_PERMANENT:
        return EXIT_OK  # every model has its outcome in the store: the index is complete
    return code


def check_device(requested: str) -> None:
    """Before the first model: the self-check (esd_worker.serve.selfcheck, under a second)
    on the device the analysis would use; DeviceError naming the node and the reason when
    it cannot be used, so that no model is started, let alone charged."""
    from esd_worker.serve.selfcheck import self_check  # torch

    code, report = self_check(requested)
    if code != EXIT_OK:
        raise DeviceError(
            f"the device check before the first model failed on {node_label()}: "
            f"{report['error']}; no model was started or recorded (exit 6: run this work on "
            "another node)")
    log.info("device check passed on %s (%s) in %.3f s", report["device"],
             report["device_name"], report["seconds"])


def _shard_requests(shard: Shard) -> list[Request]:
    """The shard's models; a shard that is missing or no model list is one usage error that
    names the folder and the index (the store's own errors pass through)."""
    try:
        return requests_from_list(shard.url)
    except ModelListError as e:
        raise ModelListError(f"shard {shard.index} of {shard.folder} cannot run: {e}") from e


def _protocol_stream() -> Any:
    """The real stdout for protocol lines; fd 1 then points at stderr, so a print from a
    library (or C code) cannot corrupt the protocol."""
    sys.stdout.flush()
    stream = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    return stream


@dataclass(frozen=True)
class DownloadBudget:
    """Bytes on disk for downloads. read_ahead: the current model and those fetched ahead
    (0: one model at a time); limit: the most one model (with its base) may need, a hard
    bound (None: not known); source: where the numbers come from, for the error a model
    too big for them gets (the flag, and in a shard its resource class)."""

    read_ahead: int
    limit: int | None
    source: str


def download_budget(flag: int | None, cache_dir: Path | None,
                    shard: Shard | None = None) -> DownloadBudget:
    """--cache-budget as read-ahead budget and hard bound (a pod's disk request less its
    headroom: a model beyond it would get the pod evicted); without it, half the free space
    where downloads go (the HF cache when no --cache-dir) for the read-ahead and no bound
    (a model the user has cached already needs no free space)."""
    # The shard folder's last part is its resource class (esd_worker.core.store.layout's
    # shard_prefix): the class whose disk the model does not fit.
    of_class = (f", resource class {shard.folder.rstrip('/').rsplit('/', 1)[-1]}"
                if shard is not None else "")
    if flag:
        return DownloadBudget(flag, flag, f"--cache-budget{of_class}")
    where = cache_dir or Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME")
                              or Path.home() / ".cache" / "huggingface")
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = 0  # unknown: fetch ahead one model at a time whatever its size
    return DownloadBudget(free // 2, None, f"--cache-budget not set{of_class}")
