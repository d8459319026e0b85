"""The `esd-sweep` command: subcommands, flags to settings, errors to one line and exit status."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from controller import __version__
from controller.exporter import add_exporter_flags, run_exporter
from controller.gpus import GpuSettings
from controller.local import LocalSettings
from controller.modellist import RELATIONS, ModelListError
from controller.sweep import (
    EXIT_INFRA,
    EXIT_USAGE,
    SweepError,
    SweepSettings,
    format_summary_table,
    load_models,
    models_status,
    run_sweep,
    summary_rows_for,
)
from esd_worker.errors import StoreError, WorkerError
from esd_worker.flags import add_analysis_flags, add_flag, analysis_from_args
from esd_worker.logs import LOG_FORMATS, setup_logging
from esd_worker.settings import DEVICES
from esd_worker.store import open_store

log = logging.getLogger("controller")


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--model-list", type=Path, metavar="CSV",
             help="CSV of models: model_id or full_name (org/name[@rev] or a local dir), "
             "optional base_model_relation and source_model")
    add_flag(p, "--single-model", metavar="ID[@REV]|DIR",
             help="analyse one model instead of a list")
    add_flag(p, "--relation", choices=[r for r in RELATIONS if r], default="",
             help="base_model_relation of --single-model")
    add_flag(p, "--source-model", metavar="ID[@REV]|DIR",
             help="base model of --single-model when it is an adapter")
    add_flag(p, "--output-dir", "--output", required=True, metavar="URL",
             help="result store: a directory, file:// URL or s3://bucket/prefix")
    add_flag(p, "--limit", type=int, metavar="N", help="only the first N valid rows")
    add_analysis_flags(p)


def _add_common(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--log-format", choices=LOG_FORMATS,
             default=os.environ.get("ESD_LOG_FORMAT", "text"),
             help="log lines for people (text) or log pipelines (json); env ESD_LOG_FORMAT")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="esd-sweep",
        description="Weight-spectrum (ESD) analysis of many models: plan what is missing, "
        "run it on this machine's GPUs (or CPU), record failures, summarise.",
    )
    parser.add_argument("--version", action="version", version=f"esd-sweep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the sweep: analyse every model not done yet")
    _add_source_flags(run)
    add_flag(run, "--mode", choices=("esd", "custom"), default="esd",
             help="esd: analyse the model list; custom: run --commands under GPU management")
    add_flag(run, "--commands", type=Path, metavar="FILE",
             help="custom mode: one command line per line")
    add_flag(run, "--backend", choices=("local",), default="local",
             help="where workers run: local = subprocesses on this machine's GPUs or CPU")
    add_flag(run, "--device", choices=DEVICES, default="auto",
             help="auto: free GPUs when NVML sees any, else CPU; cpu; cuda (GPUs required)")
    add_flag(run, "--gpu-mem-threshold", "--gpu-memory-threshold", type=float, default=500.0,
             metavar="MIB", help="a GPU is free while its used memory stays under this "
             "(MiB, default 500)")
    add_flag(run, "--max-checks", "--max-check", type=int, default=10, metavar="N",
             help="consecutive free polls before a GPU is used (default 10)")
    add_flag(run, "--gpu-poll-interval", type=float, default=1.0, metavar="S",
             help="seconds between GPU memory polls (default 1)")
    add_flag(run, "--gpu-list", "--gpus", type=int, nargs="+", metavar="ID",
             help="GPU indices to use, in order of preference (default: all)")
    add_flag(run, "--max-gpus", type=int, metavar="N", help="use at most N GPUs")
    add_flag(run, "--gpus-per-job", "--num-gpus-per-job", type=int, default=1, metavar="N",
             help="GPUs per model (default 1)")
    add_flag(run, "--cpu-workers", type=int, default=1, metavar="N",
             help="models analysed at once on the CPU when no GPU is used (default 1)")
    add_flag(run, "--max-retries", type=int, default=2, metavar="N",
             help="extra attempts for transient failures (network, storage, GPU OOM; default 2)")
    add_flag(run, "--retry-backoff", type=float, default=5.0, metavar="S",
             help="first retry delay in seconds, doubled each attempt, with jitter (default 5)")
    add_flag(run, "--overwrite", action="store_true", help="recompute models that are done")
    failed = run.add_mutually_exclusive_group()
    add_flag(failed, "--skip-failed", action="store_true",
             help="skip models with a permanent failure record (not found, gated, corrupt)")
    add_flag(failed, "--retry-failed", action="store_true",
             help="try models with a failure record again (the default)")
    add_flag(run, "--strict", action="store_true",
             help="any bad row in the model list stops the sweep before it starts")
    add_flag(run, "--log-dir", type=Path, metavar="DIR",
             help="controller log and one log per worker (default: <output-dir>/logs for "
             "local outputs)")
    add_flag(run, "--no-eigs", action="store_true", help="do not store eigenvalues (eigs.npz)")
    add_flag(run, "--trust-remote-code", action="store_true",
             help="let workers run model code from the hub to find layers (off by default)")
    _add_common(run)

    status = sub.add_parser("status", help="how many models of the list are done, to do, failed")
    _add_source_flags(status)
    _add_common(status)

    report = sub.add_parser("report", help="rewrite summary.csv for the list from the store")
    _add_source_flags(report)
    _add_common(report)

    exporter = sub.add_parser(
        "gpu-exporter",
        help="serve this node's GPU memory on :9400/metrics (dcgm-exporter names; a sidecar)",
    )
    add_exporter_flags(exporter)
    _add_common(exporter)
    return parser


def settings_from_args(args: argparse.Namespace) -> SweepSettings:
    """SweepSettings from flags; reports every bad flag value at once."""
    problems: list[str] = []
    custom = getattr(args, "mode", "esd") == "custom"
    if custom and args.commands is None:
        problems.append("--mode custom needs --commands FILE")
    if not custom and bool(args.model_list) == bool(args.single_model):
        problems.append("give exactly one of --model-list FILE and --single-model ID")
    if args.limit is not None and args.limit < 1:
        problems.append(f"--limit: must be >= 1, got {args.limit}")
    gpu = GpuSettings()
    local = LocalSettings()
    log_dir = None
    if args.command == "run":
        gpu = GpuSettings(
            threshold_mib=args.gpu_mem_threshold,
            max_checks=args.max_checks,
            poll_interval_s=args.gpu_poll_interval,
            gpu_list=tuple(args.gpu_list) if args.gpu_list else None,
            max_gpus=args.max_gpus,
            gpus_per_job=args.gpus_per_job,
        )
        try:
            gpu.validate()
        except ValueError as e:
            problems.append(str(e))
        if args.cpu_workers < 1:
            problems.append(f"--cpu-workers: must be >= 1, got {args.cpu_workers}")
        if args.max_retries < 0:
            problems.append(f"--max-retries: must be >= 0, got {args.max_retries}")
        if args.retry_backoff < 0:
            problems.append(f"--retry-backoff: must be >= 0, got {args.retry_backoff}")
        log_dir = args.log_dir or _default_log_dir(args.output_dir)
        local = LocalSettings(
            max_retries=max(args.max_retries, 0),
            backoff_s=max(args.retry_backoff, 0.0),
            cpu_workers=max(args.cpu_workers, 1),
            log_dir=log_dir,
        )
    analysis = analysis_from_args(args)
    try:
        analysis.validate()
    except WorkerError as e:
        problems.append(str(e))
    if problems:
        raise SweepError("; ".join(problems))
    return SweepSettings(
        output=args.output_dir,
        model_list=args.model_list,
        single_model=args.single_model,
        single_relation=args.relation,
        single_source=args.source_model,
        commands=getattr(args, "commands", None) if custom else None,
        limit=args.limit,
        strict=getattr(args, "strict", False),
        overwrite=getattr(args, "overwrite", False),
        skip_failed=getattr(args, "skip_failed", False),
        analysis=analysis,
        device=getattr(args, "device", "auto"),
        gpu=gpu,
        local=local,
        log_dir=log_dir,
        save_eigs=not getattr(args, "no_eigs", False),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        worker_log_format=args.log_format,
    )


def _default_log_dir(output: str) -> Path | None:
    """<output>/logs for a local store; none for object storage (logs stay on this machine)."""
    if "://" in output and not output.startswith("file://"):
        return None
    return Path(output.removeprefix("file://")).expanduser() / "logs"


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    result = run_sweep(settings)
    if settings.commands is None:
        print(format_summary_table(open_store(settings.output)))
    counts = result.report["counts"]
    print(
        f"run {result.run_id}: {counts['done']} done, {counts['failed']} failed, "
        f"{counts['already_done']} already done, {counts['bad_rows']} bad row(s); "
        f"report: {result.report['output']}/runs/{result.run_id}.json"
    )
    return result.exit_code


def _status(args: argparse.Namespace) -> int:
    print(json.dumps(models_status(settings_from_args(args)), indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    store = open_store(settings.output)
    written = summary_rows_for(
        store, load_models(settings).rows, settings.analysis.as_dict()
    )
    print(format_summary_table(store))
    print(f"summary.csv: {written} model(s) in {store.url}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_file = None
    if args.command == "run":
        log_dir = args.log_dir or _default_log_dir(args.output_dir)
        log_file = log_dir / "esd-sweep.log" if log_dir is not None else None
    try:
        setup_logging(verbose=args.verbose, fmt=args.log_format, log_file=log_file)
    except OSError as e:
        print(f"esd-sweep: error: cannot write the log in {log_file}: {e}", file=sys.stderr)
        return EXIT_USAGE
    handlers = {"run": _run, "status": _status, "report": _report, "gpu-exporter": run_exporter}
    try:
        return handlers[args.command](args)
    except (SweepError, ModelListError) as e:
        code = getattr(e, "exit_code", EXIT_USAGE)
        print(f"esd-sweep: error: {e}", file=sys.stderr)
        return code
    except StoreError as e:
        print(f"esd-sweep: error: result store: {e}", file=sys.stderr)
        return EXIT_INFRA
    except WorkerError as e:  # the store's permanent errors (bad bucket, no access)
        print(f"esd-sweep: error: {e}", file=sys.stderr)
        return EXIT_INFRA if "store" in type(e).__name__.lower() else EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
