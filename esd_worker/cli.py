"""The `esd-worker` command: flags to settings; one model (`--model`) or many in one process
(`--models FILE`, a shard of a Kubernetes run with `--shards URL`, or `--serve` for a
controller), or the device check (`--self-check`, esd_worker.serve.selfcheck); the hub rate limit
(`--hub-rate`); each failure one line + exit code.

A batch's per-model loop is esd_worker.serve.batch's, its read-ahead esd_worker.serve.prefetch's,
which
shard a pod takes and a batch's exit code esd_worker.serve.runner's; `--models` and `--shards`
run the batch in a child of esd_worker.serve.supervisor's.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from esd_worker.core.command.flags import analysis_from_args
from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.command.workerparser import build_parser  # the command's flags; also tests'
from esd_worker.core.errors import (
    ERROR_PREFIX,
    Terminated,
    UsageError,
    WorkerError,
    exit_code_for,
    failure_message,
    host_out_of_memory,
)
from esd_worker.core.logs import setup_logging
from esd_worker.core.models.naming import folder_warning, normalize_model_ref, symlink_problem
from esd_worker.core.ratelimit import TokenBucket
from esd_worker.core.redact import redact
from esd_worker.core.store.opener import open_store
from esd_worker.fetch.hub import set_rate_limit
from esd_worker.serve.runner import Shard, locate_shard, run_batch
from esd_worker.serve.supervisor import supervise, supervised_child

log = logging.getLogger("esd_worker")


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
        host_eigensolvers=args.host_eigensolvers,
    )


def _model_ref(ref: str, flag: str) -> str:
    """A model flag's reference in its one spelling (esd_worker.core.models.naming's rule, as
    a list's row); UsageError for a local path whose '..' would leave a symlink (a list row
    with it is refused the same way); a warning for a hub id that is also a folder here."""
    why = symlink_problem(ref)
    if why is not None:
        raise UsageError(f"{flag} {why}")
    warning = folder_warning(ref)
    if warning is not None:
        log.warning("%s %s", flag, warning)
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
            child = supervised_child()
            if not args.serve and not child:
                # A model that crashes, hangs or leaks must cost its own retries only: the
                # batch runs in a watched child (--serve is watched by its controller).
                return supervise(args, sys.argv[1:] if argv is None else list(argv), store,
                                 shard)
            return run_batch(args, settings, store, shard, resumed=child > 1,
                             supervised=child > 0)
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
        # A bug, not a model problem: keep the traceback for the failure record (torch's
        # host allocator error is no bug: the machine ran out of memory).
        if not host_out_of_memory(e):
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
