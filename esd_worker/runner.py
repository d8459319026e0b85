"""`esd-worker --models FILE` and `--serve`: wire the inbox, the prefetcher and the batch loop.

Owns the process side of a long-lived worker: the protocol stream (stdout kept for protocol
lines only: stray prints go to stderr), the batch's exit code, and the one-line summary.
Imports torch only once the store has been checked (esd_worker.cli).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from esd_worker.batch import Batch, BatchSettings
from esd_worker.errors import EXIT_TRANSIENT, UsageError
from esd_worker.inbox import Inbox, requests_from_list
from esd_worker.protocol import event_line
from esd_worker.settings import WorkerSettings
from esd_worker.store import Store

log = logging.getLogger("esd_worker")


def run_batch(args: argparse.Namespace, template: WorkerSettings, store: Store) -> int:
    """Analyse every model of --models (or of the requests on stdin with --serve); the exit
    code: 0 all done or skipped, 3 some permanent failures, 4 a failure a retry may fix or a
    stop (esd_worker.batch.Tally)."""
    if args.prefetch < 0 or args.max_retries < 0:
        raise UsageError("--prefetch and --max-retries must be >= 0")
    protocol = _protocol_stream()
    started = time.perf_counter()
    if args.serve:
        inbox = Inbox()
    else:
        requests = requests_from_list(args.models)
        inbox = Inbox(requests, closed=True)
        log.info("%d model(s) from %s", len(requests), args.models)

    from esd_worker.prefetch import Prefetcher  # no torch: downloads start during imports

    cache_dir: Path | None = args.cache_dir
    prefetcher = Prefetcher(inbox, depth=args.prefetch,
                            budget=args.cache_budget or _default_budget(cache_dir),
                            cache_dir=cache_dir, own_cache=cache_dir is not None)
    if args.serve:
        inbox.read_from(sys.stdin)
    from esd_worker.analyze import analyse_model  # torch: after the store check
    from esd_worker.layers import warm_up

    # transformers and CUDA start while the first model downloads (not a daemon: a thread
    # killed inside an import at exit can abort the interpreter).
    threading.Thread(target=warm_up, kwargs={"cuda": template.device != "cpu"},
                     name="esd-warm-up").start()

    def analyse(settings: WorkerSettings, target: Store, key: str) -> Any:
        return analyse_model(settings, store=target, model_key=key, resolve=prefetcher.resolve)

    def emit(line: str) -> None:
        protocol.write(line)
        protocol.flush()

    batch = Batch(
        BatchSettings(template=template, run_id=args.run_id, max_retries=args.max_retries,
                      overwrite=args.overwrite, skip_failed=args.skip_failed),
        store, analyse, emit, finished=prefetcher.finished,
    )
    emit(event_line("ready", pid=os.getpid()))
    try:
        tally = batch.run(iter(inbox))
    finally:
        prefetcher.close()
    log.info("batch: %d done, %d failed, %d skipped in %.1fs", tally.done, tally.failed,
             tally.skipped, time.perf_counter() - started)
    return EXIT_TRANSIENT if batch.fatal else tally.exit_code


def _protocol_stream() -> Any:
    """The real stdout for protocol lines; fd 1 then points at stderr, so a print from a
    library (or C code) cannot corrupt the protocol."""
    sys.stdout.flush()
    stream = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    return stream


def _default_budget(cache_dir: Path | None) -> int:
    """Half the free space where downloads go (the HF cache when no --cache-dir)."""
    where = cache_dir or Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME")
                              or Path.home() / ".cache" / "huggingface")
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free // 2
    except OSError:
        return 0  # unknown: fetch ahead one model at a time whatever its size
