"""The `esd-sweep` command: subcommands, flags to settings, errors to one line and exit status."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller import __version__
from controller.backends.kubernetes.common.settings import (
    ClusterSettings,
    add_cluster_flags,
    cluster_from_args,
)
from controller.backends.local.settings import LocalSettings
from controller.doctor.doctor import add_doctor_flags, run_doctor
from controller.errors import EXIT_USAGE, SweepError, describe_error
from controller.gpu.exporter import add_exporter_flags, run_exporter
from controller.gpu.gpurule import add_gpu_rule_flags, gpu_rule_from_args
from controller.gpu.gpus import GPU_INDEX, GPU_MEM_THRESHOLD_MIB, MAX_CHECKS, GpuSettings
from controller.output.lease import add_wait_lock_flag
from controller.results.compact import add_compact_flags, run_compact
from controller.results.compare import add_compare_flags, run_compare
from controller.results.failurelist import SHOWN, FailureList
from controller.results.refit import add_refit_flags, run_refit
from controller.results.report import add_report_flags, run_report
from controller.results.summary import format_summary_table
from controller.run.runlog import HeldLog
from controller.run.sweep import models_status, run_commands, run_sweep
from controller.settings import SweepSettings
from esd_worker.core.command.flags import (
    HOUR_S,
    MAX_GPUS,
    MAX_RETRIES,
    MAX_ROWS,
    MAX_THREADS,
    PREFETCH,
    PREFETCH_COUNT,
    Parser,
    UsageExit,
    add_analysis_flags,
    add_flag,
    add_host_eigensolvers_flag,
    add_model_timeout_flag,
    analysis_from_args,
    float_in,
    int_in,
    size_in,
)
from esd_worker.core.command.settings import DEVICES
from esd_worker.core.errors import WorkerError
from esd_worker.core.files import write_atomic
from esd_worker.core.logs import LOG_FORMATS, setup_logging
from esd_worker.core.models.modellist import RELATIONS, make_single
from esd_worker.core.redact import redact, redact_data
from esd_worker.core.store.layout import SUMMARY_KEY, run_report_key
from esd_worker.core.store.opener import open_store

log = logging.getLogger("controller")


def _add_source_flags(
    p: argparse.ArgumentParser, *, analysis: Any = None, output: Any = None
) -> None:
    """Model list, output and analysis flags (groups of `run --help` when given)."""
    add_flag(p, "--model-list", metavar="CSV|URL",
             help="CSV of models: model_id or full_name (org/name[@rev] or a local dir), "
             "optional base_model_relation and source_model")
    add_flag(p, "--single-model", metavar="ID[@REV]|DIR",
             help="analyse one model instead of a list")
    add_flag(p, "--relation", choices=[r for r in RELATIONS if r], default="",
             help="base_model_relation of --single-model")
    add_flag(p, "--source-model", metavar="ID[@REV]|DIR",
             help="base model of --single-model when it is an adapter")
    add_flag(p, "--limit", type=int_in(1, MAX_ROWS), metavar="N",
             help="only the first N valid rows")
    add_flag(output or p, "--output-dir", "--output", required=True, metavar="URL",
             help="result store: a directory, file:// URL or s3://bucket/prefix")
    add_analysis_flags(analysis or p)


def _add_doctor_flags(p: argparse.ArgumentParser) -> None:
    """doctor's own flags (controller.doctor.doctor) and, for --backend kubernetes, `run`'s."""
    add_doctor_flags(p)
    add_cluster_flags(p.add_argument_group("kubernetes (--backend kubernetes)"))


def _add_common(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--log-format", choices=LOG_FORMATS,
             default=os.environ.get("ESD_LOG_FORMAT", "text"),
             help="log lines for people (text) or log pipelines (json); env ESD_LOG_FORMAT")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="esd-sweep",
        description="Weight-spectrum (ESD) analysis of many models: plan what is missing, "
        "run it on this machine's GPUs (or CPU), record failures, summarise.",
    )
    parser.add_argument("--version", action="version", version=f"esd-sweep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="run the sweep: analyse every model not done yet",
        description="Analyse every listed model that has no result yet, on this machine "
        "(--backend local) or on Kubernetes (--backend kubernetes: Indexed Jobs over shards "
        "of the list, or one Job per model with --shard-size 1). "
        "Exit status: 0 all done, 1 some models failed, 2 usage or configuration error, "
        "or the output in use by another sweep (see --wait-lock), "
        "3 infrastructure error (store or cluster unreachable, RBAC), 130 interrupted.",
    )
    inputs = run.add_argument_group("input")
    analysis = run.add_argument_group("analysis (passed to every worker)")
    running = run.add_argument_group("running")
    local = run.add_argument_group("local GPUs (--backend local; the GPU rule also "
                                   "applies to cluster telemetry)")
    kube = run.add_argument_group("kubernetes (--backend kubernetes)")
    output = run.add_argument_group("output")
    _add_source_flags(inputs, analysis=analysis, output=output)  # type: ignore[arg-type]
    add_flag(inputs, "--mode", choices=("esd", "custom"), default="esd",
             help="esd: analyse the model list; custom: run --commands under GPU management")
    add_flag(inputs, "--commands", type=Path, metavar="FILE",
             help="custom mode: one command line per line")
    add_flag(inputs, "--strict", action="store_true",
             help="any bad row in the model list stops the sweep before it starts")
    add_flag(running, "--backend", choices=("local", "kubernetes"), default="local",
             help="local: subprocesses on this machine's GPUs or CPU; kubernetes: Indexed "
             "Jobs over shards of the list (docs/kubernetes.md)")
    add_flag(running, "--max-retries", type=int_in(0, MAX_RETRIES), default=2, metavar="N",
             help="extra attempts for transient failures (network, storage, GPU OOM, "
             "evictions; default 2)")
    add_flag(running, "--retry-backoff", type=float_in(0, HOUR_S, unit="seconds"),
             default=5.0, metavar="S",
             help="local: first retry delay in seconds, doubled each attempt, with jitter "
             "(default 5)")
    add_flag(running, "--overwrite", action="store_true", help="recompute models that are done")
    add_flag(running, "--reanalyse", action="store_true",
             help="analyse again the results whose only other settings are the fit's "
             "(--fix-fingers, --evals-thresh, --bins); by default they are refitted in place "
             "from their stored eigenvalues, with no download and no worker")
    add_flag(running, "--dry-run", action="store_true",
             help="print what would start and start nothing: Kubernetes Jobs as YAML "
             "(kubectl apply -f -), or the local worker command lines")
    add_wait_lock_flag(running)
    failed = running.add_mutually_exclusive_group()
    add_flag(failed, "--skip-failed", action="store_true",
             help="skip models with a permanent failure record (not found, gated, corrupt)")
    add_flag(failed, "--retry-failed", action="store_true",
             help="try models with a failure record again (the default)")
    add_flag(running, "--trust-remote-code", action="store_true",
             help="let workers run model code from the hub to find layers (off by default)")
    add_flag(local, "--device", choices=DEVICES, default="auto",
             help="auto: free GPUs when NVML sees any, else CPU; cpu; cuda (GPUs required)")
    add_flag(local, "--gpu-mem-threshold", "--gpu-memory-threshold",
             type=GPU_MEM_THRESHOLD_MIB, default=500.0,
             metavar="MIB", help="a GPU is free while its used memory stays under this "
             "(MiB, default 500)")
    add_flag(local, "--max-checks", "--max-check", type=int_in(1, MAX_CHECKS), default=10,
             metavar="N",
             help="consecutive free polls before a GPU is used (default 10)")
    add_flag(local, "--gpu-poll-interval", type=float_in(0, HOUR_S, above=True,
                                                           unit="seconds"),
             default=1.0, metavar="S",
             help="seconds between GPU memory polls (default 1)")
    add_flag(local, "--gpu-list", "--gpus", type=GPU_INDEX, nargs="+", metavar="ID",
             help="NVML GPU indices (as nvidia-smi numbers them) to use, in order of "
             "preference, within an inherited CUDA_VISIBLE_DEVICES (default: all allowed)")
    add_flag(local, "--max-gpus", type=int_in(1, MAX_GPUS), metavar="N",
             help="use at most N GPUs")
    add_gpu_rule_flags(local)  # --gpus-per-job, its rule, --parallel-gpu/--no-parallel-gpu
    add_flag(local, "--cpu-workers", type=int_in(1, MAX_THREADS), default=1, metavar="N",
             help="models analysed at once on the CPU when no GPU is used (default 1)")
    add_flag(local, "--worker-reuse", type=int_in(1, MAX_ROWS), default=None, metavar="N",
             help="replace a long-lived worker after N models (default: never)")
    add_host_eigensolvers_flag(running)
    add_flag(running, "--prefetch", type=PREFETCH_COUNT, default=PREFETCH, metavar="N",
             help="models each worker downloads ahead while it analyses one (default "
             f"{PREFETCH}; 0: none)")
    add_flag(running, "--cache-budget", type=size_in(0), default=None, metavar="BYTES",
             help="disk per worker for the model in progress and those ahead, e.g. 50G "
             "(default: half the free space where downloads go)")
    add_flag(running, "--cache-dir", default=None, metavar="DIR",
             help="workers download here and delete a model's files once no later model "
             "needs them (default: the HF cache, never evicted)")
    add_model_timeout_flag(running)
    add_flag(running, "--metrics-port", type=int_in(0, 65535), default=0, metavar="PORT",
             help="serve the run's Prometheus metrics on this port at /metrics while it "
             "runs (default 0: off; docs/operations.md#metrics)")
    add_flag(running, "--metrics-address", default="127.0.0.1", metavar="ADDR",
             help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 "
             "in a pod, so Prometheus can scrape it)")
    add_cluster_flags(kube)
    add_flag(output, "--report", type=Path, metavar="FILE.json",
             help="also write the run's outcome (counts, failures with reasons, summary "
             "location, run id, exit status) to this file, also when the run fails")
    add_flag(output, "--log-dir", type=Path, metavar="DIR",
             help="controller log and one log per worker (default: <output-dir>/logs for "
             "local outputs)")
    add_flag(output, "--no-eigs", action="store_true",
             help="do not store eigenvalues (eigs.npz)")
    add_flag(output, "--no-summary", action="store_true",
             help="do not rebuild summary.csv at the end (it reads the marker of every done "
             "model; for lists of millions, build it later with `esd-sweep report`)")
    _add_common(run)

    status = sub.add_parser("status", help="how many models of the list are done, to do, failed")
    _add_source_flags(status)
    add_flag(status, "--bad-rows", action="store_true",
             help="print every bad row of the list (file:line: problem), one a line, instead "
             "of the counts (the log shows the first few)")
    add_flag(status, "--failures", type=int_in(0, MAX_ROWS, word="all"), default=SHOWN,
             metavar="N|all", help="after the counts, list the first N listed models with a "
             f"failure record on stderr, permanent first (default {SHOWN}; 0: none)")
    add_flag(status, "--json", action="store_true",
             help="put the listed failures in the printed JSON (`failures`, "
             "`failures_total`) instead of on stderr")
    _add_common(status)

    report = sub.add_parser(
        "report", help="summary.csv, a Parquet table of all layers, plots and index.html"
    )
    add_report_flags(report)
    _add_common(report)

    refit = sub.add_parser(
        "refit", help="recompute the fits from stored eigenvalues (no model, no GPU)"
    )
    add_refit_flags(refit)
    _add_common(refit)

    compact = sub.add_parser(
        "compact", help="the results tables: add the models no part holds, merge small parts"
    )
    add_compact_flags(compact)
    _add_common(compact)

    compare = sub.add_parser(
        "compare", help="per-layer differences between two results (or adapter vs base)"
    )
    add_compare_flags(compare)
    _add_common(compare)

    doctor = sub.add_parser(
        "doctor", help="check that this machine (or cluster) can run a sweep: GPUs, worker, "
        "store, HF token, Kubernetes",
        description="One line per check, ✓ or ✗ with what to do. Exit status: 0 every check "
        "that applies passed, 1 some check failed, 2 usage.",
    )
    _add_doctor_flags(doctor)
    _add_common(doctor)

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
    elif not custom and args.single_model:
        # A bad --single-model is a flag to fix (2), not a model that failed (1).
        single = make_single(args.single_model, relation=args.relation,
                             source_model=args.source_model)
        problems.extend(str(problem) for problem in single.problems)
    gpu = GpuSettings()
    gpu_rule = gpu_rule_from_args(args, problems)
    local = LocalSettings()
    cluster = ClusterSettings()
    log_dir = None
    if args.command == "run":
        gpu = GpuSettings(
            threshold_mib=args.gpu_mem_threshold,
            max_checks=args.max_checks,
            poll_interval_s=args.gpu_poll_interval,
            gpu_list=tuple(args.gpu_list) if args.gpu_list else None,
            max_gpus=args.max_gpus,
            gpus_per_job=1 if args.gpus_per_job is None else args.gpus_per_job,
        )
        try:
            gpu.validate()
        except ValueError as e:
            problems.append(str(e))
        log_dir = args.log_dir or _default_log_dir(args.output_dir)
        local = LocalSettings(
            max_retries=args.max_retries,
            backoff_s=args.retry_backoff,
            cpu_workers=args.cpu_workers,
            log_dir=log_dir,
            worker_reuse=args.worker_reuse,
        )
        cluster = cluster_from_args(args, problems)
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
        reanalyse=getattr(args, "reanalyse", False),
        skip_failed=getattr(args, "skip_failed", False),
        analysis=analysis,
        device=getattr(args, "device", "auto"),
        gpu=gpu,
        local=local,
        log_dir=log_dir,
        save_eigs=not getattr(args, "no_eigs", False),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        worker_log_format=args.log_format,
        backend=getattr(args, "backend", "local"),
        cluster=cluster,
        dry_run=getattr(args, "dry_run", False),
        prefetch=getattr(args, "prefetch", PREFETCH),
        cache_budget=getattr(args, "cache_budget", None),
        cache_dir=getattr(args, "cache_dir", None),
        model_timeout=getattr(args, "model_timeout", None),
        summary=not getattr(args, "no_summary", False),
        wait_lock_s=getattr(args, "wait_lock", None),
        parallel_gpu=getattr(args, "parallel_gpu", True),
        host_eigensolvers=getattr(args, "host_eigensolvers", None),
        gpu_rule=gpu_rule,
        metrics_port=getattr(args, "metrics_port", 0),
        metrics_address=getattr(args, "metrics_address", "127.0.0.1"),
    )


def _default_log_dir(output: str) -> Path | None:
    """<output>/logs for a local store; none for object storage (logs stay on this machine)."""
    if "://" in output and not output.startswith("file://"):
        return None
    return Path(output.removeprefix("file://")).expanduser() / "logs"


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    log: HeldLog | None = getattr(args, "log", None)
    if settings.commands is not None:
        if log is not None:
            log.open()
        result = run_commands(settings)
    else:  # the log file opens once the plan is accepted (--strict may refuse it)
        result = run_sweep(settings, on_plan=lambda plan: log.open() if log else None)
    args.result = result
    if result.report.get("dry_run"):
        return result.exit_code
    if settings.commands is None:
        print(format_summary_table(open_store(settings.output),
                                   parameters=settings.analysis.as_dict()))
    counts = result.report["counts"]
    running = f", {counts['running']} Job(s) still running" if counts.get("running") else ""
    refitted = f", {counts['refitted']} refitted" if counts.get("refitted") else ""
    print(redact(
        f"run {result.run_id}: {counts['done']} done{refitted}, {counts['failed']} failed, "
        f"{counts['already_done']} already done, {counts['bad_rows']} bad row(s){running}; "
        f"report: {result.report['output']}/{run_report_key(result.run_id)}"
    ))
    return result.exit_code


def _status(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.bad_rows:
        # Each line one row, bounded and redacted (RowProblem's str: esd_worker.core.echo).
        models_status(settings, on_problem=print)
        return 0
    failures = FailureList(args.failures)
    status = models_status(settings, failures=failures)
    if args.json:
        status |= failures.as_json()
    # stdout stays one JSON document (scripts read it); people get the failures after it.
    print(json.dumps(redact_data(status), indent=2), flush=True)
    if not args.json:
        for line in failures.lines():  # each text in it shown through echo: redacted
            print(line, file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageExit as e:  # the parser has said why on stderr, naming the flag
        return _refused(sys.argv[1:] if argv is None else argv, e.message)
    setup_logging(verbose=args.verbose, fmt=args.log_format)
    if args.command == "run":
        log_dir = args.log_dir or _default_log_dir(args.output_dir)
        # Held until the run starts (_run): a run refused before that writes nothing, and
        # a dry run, which starts nothing, writes no log (its lines are on stderr).
        args.log = None if log_dir is None or args.dry_run else HeldLog(
            log_dir / "esd-sweep.log", verbose=args.verbose, fmt=args.log_format)
    code, message = _dispatch(args)
    if message:
        print(f"esd-sweep: error: {redact(message)}", file=sys.stderr)
    report_file = getattr(args, "report", None)
    if args.command == "run" and report_file is not None and not _report(
            report_file, getattr(args, "result", None), code, message):
        return code or EXIT_USAGE
    return code


def _refused(argv: Sequence[str], message: str) -> int:
    """A command line argparse refused: exit 2, and for `run --report FILE` that FILE too
    (CI reads it whatever went wrong). Nothing else is written."""
    code = EXIT_USAGE
    if list(argv[:1]) != ["run"]:
        return code
    only_report = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_flag(only_report, "--report", type=Path)
    try:
        report_file = only_report.parse_known_args(argv[1:])[0].report
    except argparse.ArgumentError:  # --report without its file
        return code
    if report_file is not None:
        _report(report_file, None, code, message)
    return code


def _report(path: Path, result: Any, code: int, message: str) -> bool:
    """write_report_file, or one error line saying it could not be written (False)."""
    try:
        write_report_file(path, result, code, message)
    except OSError as e:
        print(redact(f"esd-sweep: error: cannot write --report {path}: {e}"), file=sys.stderr)
        return False
    return True


def _dispatch(args: argparse.Namespace) -> tuple[int, str]:
    """Run the subcommand: (exit status, one-line error message or "")."""
    handlers = {
        "run": _run, "status": _status, "report": run_report, "refit": run_refit,
        "compact": run_compact, "compare": run_compare, "gpu-exporter": run_exporter,
        "doctor": run_doctor,
    }
    try:
        return handlers[args.command](args), ""
    except Exception as e:
        described = describe_error(e)  # the one mapping of errors to exit statuses
        if described is None:
            raise  # a bug: the traceback says more than a line could
        return described


def write_report_file(path: Path, result: Any, code: int, error: str) -> None:
    """--report FILE.json: the outcome for CI (also when the run failed before it began).

    Always: exit_code, ok, error, run_id (None when no run started), counts and failures
    (empty without a run); with a run: summary / run_report (store URLs) and the report.
    Every string is redacted (esd_worker.core.redact); the file follows the umask. Written
    whole, never through a symlink planted at its name or a temporary one
    (esd_worker.core.files.write_atomic): the folder may be a CI workspace others write.
    """
    doc: dict[str, Any] = {"exit_code": code, "ok": code == 0, "error": error or None,
                           "run_id": None, "counts": {}, "failures": {}, "summary": None,
                           "run_report": None}
    if result is not None:
        report = result.report
        output = str(report.get("output") or "").rstrip("/")
        doc.update({
            "run_id": result.run_id,
            "counts": report.get("counts") or {},
            "failures": report.get("failures") or {},
            "summary": f"{output}/{SUMMARY_KEY}" if report.get("summary") else None,
            "run_report": None if report.get("dry_run")
            else f"{output}/{run_report_key(result.run_id)}",
            "report": report,
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(redact_data(doc), indent=2, default=lambda v: redact(str(v)))
    write_atomic(path, (text + "\n").encode("utf-8"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
