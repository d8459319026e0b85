"""The `esd-worker` command: flags to settings; one model (`--model`) or many in one process
(`--models FILE`, a shard of a Kubernetes run with `--shards URL`, or `--serve` for a
controller), or the device check (`--self-check`, esd_worker.serve.selfcheck); the hub rate limit
(`--hub-rate`); each failure one line + exit code.

A batch's per-model loop is esd_worker.serve.batch's, its read-ahead esd_worker.serve.prefetch's,
which
shard a pod takes and a batch's exit code esd_worker.serve.runner's.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from esd_worker import __version__
from esd_worker.core.errors import (
    ERROR_PREFIX,
    Terminated,
    UsageError,
    WorkerError,
    exit_code_for,
    failure_message,
)
from esd_worker.core.flags import (
    HUB_RATE,
    MAX_PREFETCH,
    MAX_RETRIES,
    MAX_ROWS,
    Parser,
    add_analysis_flags,
    add_flag,
    add_parallel_gpu_flags,
    analysis_from_args,
    int_in,
    size_in,
)
from esd_worker.core.logs import LOG_FORMATS, setup_logging
from esd_worker.core.models.modellist import dotdot_problem
from esd_worker.core.models.naming import is_local_path, normalize_model_ref, symlink_before_dotdot
from esd_worker.core.ratelimit import TokenBucket
from esd_worker.core.redact import redact
from esd_worker.core.settings import DEVICES, WorkerSettings
from esd_worker.core.store.stores import open_store
from esd_worker.fetch.hub import set_rate_limit
from esd_worker.serve.runner import SHARD_INDEX_ENV, Shard, locate_shard, run_batch

log = logging.getLogger("esd_worker")

PROG = "esd-worker"

EPILOG = f"""exit codes: 0 done (a batch: every model done or skipped); 2 usage (--shards: the
shard cannot run: no index, a bad index, no such shard); 3 permanent (a batch: some models
failed for good, each recorded in _failures/; --shards exits 0 then, the records being the
shard's outcome); 4 transient (network, storage, a stop; a batch: some failure a retry may
fix); 5 out of GPU memory. --self-check: 0 the spectrum matched float64 LAPACK, 2 the device
cannot be used (--device cuda without CUDA), 3 wrong numbers or a device error. --shards
takes shard N of URL, URL/N.csv, N from --shard-index or {SHARD_INDEX_ENV}."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Analyse the weight spectra (ESD, power-law fits) of one model, or of many "
        "in one process, and write <model_key>/layers.csv, eigs.npz and result.json (last) "
        "to the output store.",
        epilog=EPILOG,
    )
    what = p.add_mutually_exclusive_group(required=True)
    add_flag(what, "--model", "--model-id", metavar="ID[@REV]|DIR",
             help="HF model id, optionally with @revision, or a local directory in HF layout")
    add_flag(what, "--models", metavar="CSV|URL",
             help="analyse every model of a model-list CSV (a path or s3:// URL) in this "
             "process; models already done are skipped, each outcome is recorded in the store")
    add_flag(what, "--shards", metavar="URL",
             help="analyse shard N of a sharded run: the model list URL/N.csv (URL a "
             "directory, file:// or s3:// folder), N from --shard-index or "
             f"${SHARD_INDEX_ENV}; as --models, skipping what failed for good in this --run-id")
    what.add_argument("--serve", action="store_true",
                      help="take models as JSON lines on stdin (the controller's protocol: "
                      "esd_worker/core/protocol.py) and answer one JSON line each on stdout")
    what.add_argument("--self-check", action="store_true",
                      help="no model: run a small Gram + eigvalsh on the device --device picks "
                      "(as the analysis does), compare it with float64 LAPACK and print one "
                      "JSON line (device, torch, CUDA, error); no --output needed")
    add_flag(p, "--base-model", "--source-model", metavar="ID[@REV]|DIR",
             help="base model of an adapter (default: base_model_name_or_path of "
             "adapter_config.json)")
    add_flag(p, "--relation", "--base-model-relation", default="",
             help="base_model_relation from the model list (adapter/lora/peft: the model "
             "must be an adapter)")
    # Required by every way of giving work but --self-check: checked in main, with
    # argparse's own wording.
    add_flag(p, "--output", "--output-dir", metavar="URL",
             help="result store: a directory, file:// or s3:// URL (required but with "
             "--self-check)")
    add_flag(p, "--model-key", default=None, help=argparse.SUPPRESS)  # set by the controller
    add_analysis_flags(p)
    add_flag(p, "--device", choices=DEVICES, default="auto",
             help="auto: CUDA when available, else CPU (default auto)")
    add_parallel_gpu_flags(p)
    add_flag(p, "--no-eigs", action="store_true", help="do not write eigs.npz")
    add_flag(p, "--trust-remote-code", action="store_true",
             help="allow model code from the hub to build the layer map (off by default)")
    add_flag(p, "--hub-rate", type=HUB_RATE, default=None, metavar="R",
             help="at most R hub requests a second from this process (model info, each file "
             "download), bursts of up to max(1, R); a 429 holds them all (default: no limit)")
    batch = p.add_argument_group("many models (--models, --shards, --serve)")
    add_flag(batch, "--shard-index", type=int_in(0, MAX_ROWS), default=None, metavar="N",
             help=f"with --shards: the shard to take (default ${SHARD_INDEX_ENV})")
    add_flag(batch, "--run-id", default="", help="stamped on the failure records written")
    add_flag(batch, "--max-retries", type=int_in(0, MAX_RETRIES), default=2,
             help="a model that killed more than this many workers is recorded as a "
             "permanent failure (poison model) and not started again (default 2)")
    add_flag(batch, "--overwrite", action="store_true", help="analyse models that are done")
    add_flag(batch, "--skip-failed", action="store_true",
             help="skip models with a permanent failure record")
    add_flag(batch, "--prefetch", type=int_in(0, MAX_PREFETCH), default=1, metavar="N",
             help="models downloaded ahead while one is analysed (default 1; 0: none)")
    add_flag(batch, "--cache-budget", type=size_in(0), default=None, metavar="BYTES",
             help="disk for the model in progress and those ahead, e.g. 50G (default: half "
             "the free space where downloads go)")
    add_flag(batch, "--cache-dir", type=Path, default=None, metavar="DIR",
             help="download into this directory, owned by the worker: a model's files are "
             "deleted once no later model needs them (default: the HF cache, never evicted)")
    add_flag(p, "--log-format", choices=LOG_FORMATS,
             default=os.environ.get("ESD_LOG_FORMAT", "text"),
             help="log lines for people (text) or clusters (json); env ESD_LOG_FORMAT")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return p


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    # A local --model is keyed and recorded by its absolute path, as a list's row is: `./m`
    # run in two folders is two models, `/m/` and `/m` one.
    return WorkerSettings(
        model=_model_ref(args.model, "--model") if args.model else "(batch)",
        output=args.output,
        analysis=analysis_from_args(args),
        base_model=_model_ref(args.base_model, "--base-model") if args.base_model else None,
        relation=args.relation or "",
        device=args.device,
        save_eigs=not args.no_eigs,
        trust_remote_code=args.trust_remote_code,
        parallel_gpu=args.parallel_gpu,
    )


def _model_ref(ref: str, flag: str) -> str:
    """A model flag's reference in its one spelling; UsageError for a local path whose '..'
    would leave a symlink (a list row with it is refused the same way)."""
    link = symlink_before_dotdot(ref) if is_local_path(ref.strip()) else None
    if link is not None:
        raise UsageError(f"{flag} {dotdot_problem(ref.strip(), link)}")
    return normalize_model_ref(ref)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"terminated by signal {signum} before the result was written")


def _fail(error: BaseException, model: str) -> None:
    """The one line a person (or the controller's failure record) reads, redacted."""
    print(ERROR_PREFIX + redact(failure_message(error, model)), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output is None and not args.self_check:
        parser.error("the following arguments are required: --output/--output-dir")
    setup_logging(verbose=args.verbose, fmt=args.log_format)
    if args.self_check:
        from esd_worker.serve.selfcheck import run_self_check  # torch: only now

        return run_self_check(args.device)
    previous = _install_sigterm()
    previous_limit = set_rate_limit(TokenBucket(args.hub_rate) if args.hub_rate else None)
    try:
        settings = settings_from_args(args)
        settings.validate()
        shard = _shard(args)
        # The store is checked before torch is imported: a wrong bucket or missing
        # credentials fail in a second, not after seconds of imports.
        store = open_store(settings.output)
        store.check()
        if not args.model:
            return run_batch(args, settings, store, shard)
        from esd_worker.analysis.analyze import analyse_model

        analyse_model(settings, store=store, model_key=args.model_key)
    except WorkerError as e:
        if args.log_format == "json":
            log.error("%s", e, extra={"exit_code": e.exit_code})
        _fail(e, args.model)
        return exit_code_for(e)
    except (KeyboardInterrupt, Terminated, MemoryError) as e:
        _fail(e, args.model)
        return exit_code_for(e)
    except Exception as e:
        # A bug, not a model problem: keep the traceback for the failure record.
        log.exception("unexpected error analysing %s", args.model)
        _fail(e, args.model)
        return exit_code_for(e)
    finally:
        set_rate_limit(previous_limit)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _shard(args: argparse.Namespace) -> Shard | None:
    """The shard of --shards (before the store is asked anything: a pod without its index
    fails at once), None for the other ways of giving work."""
    if args.shards is not None:
        index = None if args.shard_index is None else str(args.shard_index)
        return locate_shard(args.shards, index)
    if args.shard_index is not None:
        raise UsageError("--shard-index goes with --shards")
    return None


def _install_sigterm() -> signal.Handlers | Any | None:
    """Turn SIGTERM into Terminated; the previous handler, or None off the main thread."""
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (main() called from a test or a thread pool)
        return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
