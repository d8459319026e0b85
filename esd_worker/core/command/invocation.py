"""One `esd-worker` command line as a value: how the controller starts a worker, torch-free.

Owns WorkerInvocation (the way work is given: one `--model`, `--models FILE`, `--shards URL`,
`--serve` or `--self-check`; the store; the analysis settings; device, log format, hub rate
and the batch flags), the argv it is (`to_argv`, flags in one fixed order) and reading an
argv back (`parse`, with the command's own parser, esd_worker.core.command.workerparser, so the two
never disagree about a flag). Every worker command the controller starts or prints goes
through here. Does not own what a flag means (the worker's modules), which device or flags a
backend picks (the backends), nor which flags change a result (the Kubernetes backend's
adoption). An argv list, never a shell string: model ids are not trusted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from esd_worker.core.command.flags import PREFETCH, Parser, analysis_from_args
from esd_worker.core.command.settings import DEVICES, AnalysisSettings
from esd_worker.core.command.workerparser import PROG, build_parser
from esd_worker.core.errors import UsageError
from esd_worker.core.logs import LOG_FORMATS

MODEL = "model"
MODELS = "models"
SHARDS = "shards"
SERVE = "serve"
SELF_CHECK = "self-check"
MODES = (MODEL, MODELS, SHARDS, SERVE, SELF_CHECK)
BATCH_MODES = (MODELS, SHARDS, SERVE)  # many models in one process: the batch flags apply
_TARGET_FLAGS = {MODEL: "--model", MODELS: "--models", SHARDS: "--shards"}
_LINE_BREAK = re.compile(r"[\x00-\x1f\x7f]")  # C0 controls and DEL: they break a line
_HUB_RATE_DIGITS = 6  # a rate limit needs no more; the argv says it so ("3", not "3.0")


class InvalidInvocation(ValueError):
    """An argv the worker would refuse, or a value no argv says; the message names the flag."""


@dataclass(frozen=True)
class BatchOptions:
    """The flags of a worker that analyses many models (--models, --shards, --serve).

    run_id: stamped on failure records ("": none). max_retries: workers a model may kill
    before it is recorded as failed for good. prefetch: models downloaded ahead.
    overwrite: analyse models that are done; skip_failed: skip those failed for good.
    shard_index: the shard of --shards (None: $JOB_COMPLETION_INDEX). cache_dir: a download
    folder the worker owns and evicts, as given (None: the HF cache); cache_budget: its
    bytes (None: the worker's default). model_timeout: the floor of a model's no-progress
    limit, seconds; memory_limit: the analysing process's resident bytes (None: the worker's
    defaults; esd_worker.core.watchdog and the shard supervisor).
    """

    run_id: str = ""
    max_retries: int = 2
    prefetch: int = PREFETCH
    overwrite: bool = False
    skip_failed: bool = False
    shard_index: int | None = None
    cache_dir: str | None = None
    cache_budget: int | None = None
    model_timeout: float | None = None
    memory_limit: int | None = None


@dataclass(frozen=True)
class WorkerInvocation:
    """One worker command line (without the program: `to_argv` gives the flags).

    mode: one of MODES; target: the model reference (model), the list (models) or the shard
    folder URL (shards), "" for serve and self-check. output: the store URL ("" only with
    self-check). model_key, relation, base_model: a model's key, its relation and an
    adapter's base (base_model "" is read as None: no flag). device, log_format: None leaves
    the flag out (the worker's defaults: auto; $ESD_LOG_FORMAT or text). hub_rate: hub
    requests a second (None: no limit), kept to 6 significant digits, as the argv says it.
    batch: the many-models flags, always in the argv of a batch mode, else only when not
    the defaults. analysis, save_eigs, trust_remote_code, parallel_gpu, host_eigensolvers
    (None: the flag left out), verbose: as the flags of the same names.
    """

    mode: str
    target: str = ""
    output: str = ""
    model_key: str | None = None
    relation: str = ""
    base_model: str | None = None
    log_format: str | None = None
    device: str | None = None
    batch: BatchOptions = field(default_factory=BatchOptions)
    hub_rate: float | None = None
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)
    save_eigs: bool = True
    trust_remote_code: bool = False
    parallel_gpu: bool = True
    host_eigensolvers: int | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        # Normalised here so that the value is what its argv says: parse(to_argv()) == self.
        if self.base_model == "":
            object.__setattr__(self, "base_model", None)
        if self.hub_rate is not None:
            object.__setattr__(self, "hub_rate",
                               float(f"{self.hub_rate:.{_HUB_RATE_DIGITS}g}"))

    def replace(self, **changes: Any) -> WorkerInvocation:
        """This invocation with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def for_model(self, ref: str, *, key: str | None, relation: str = "",
                  base_model: str | None = None) -> WorkerInvocation:
        """This invocation analysing one model: `--model ref`, its key, relation and base."""
        return self.replace(mode=MODEL, target=ref, model_key=key, relation=relation,
                            base_model=base_model)

    def to_argv(self) -> list[str]:
        """The flags, one element per argument, in one order: the way work is given, the
        store, the model's key, log format and device, relation and base, the batch flags,
        the hub rate, the download folder, the analysis flags, then the switches. Raises
        InvalidInvocation for a value no argv can say (structure_problems())."""
        problems = self.structure_problems()
        if problems:
            raise InvalidInvocation("; ".join(problems))
        argv = [_TARGET_FLAGS[self.mode], self.target] if self.mode in _TARGET_FLAGS \
            else [f"--{self.mode}"]
        argv += _pair("--output", self.output or None)
        argv += _pair("--model-key", self.model_key)
        argv += _pair("--log-format", self.log_format)
        argv += _pair("--device", self.device)
        argv += _pair("--relation", self.relation or None)
        argv += _pair("--base-model", self.base_model)
        b = self.batch
        batch = self.mode in BATCH_MODES or b != BatchOptions()
        if batch:
            argv += _pair("--run-id", b.run_id or None)
            argv += ["--max-retries", str(b.max_retries), "--prefetch", str(b.prefetch)]
            argv += ["--overwrite"] * b.overwrite + ["--skip-failed"] * b.skip_failed
            argv += _pair("--shard-index", _text(b.shard_index))
        argv += _pair("--hub-rate", None if self.hub_rate is None
                      else f"{self.hub_rate:.{_HUB_RATE_DIGITS}g}")
        if batch:
            argv += _pair("--cache-dir", b.cache_dir)
            argv += _pair("--cache-budget", _text(b.cache_budget))
            argv += _pair("--model-timeout", _text(b.model_timeout))
            argv += _pair("--memory-limit", _text(b.memory_limit))
        argv += _analysis_argv(self.analysis)
        argv += ["--no-eigs"] * (not self.save_eigs)
        argv += ["--trust-remote-code"] * self.trust_remote_code
        argv += ["--no-parallel-gpu"] * (not self.parallel_gpu)
        argv += _pair("--host-eigensolvers", _text(self.host_eigensolvers))
        argv += ["-v"] * self.verbose
        return argv

    def command(self, program: Sequence[str] = (PROG,)) -> list[str]:
        """`program` (the worker's command, an argv list) followed by to_argv()."""
        return [*program, *self.to_argv()]

    def structure_problems(self) -> list[str]:
        """What no argv can say: a mode without its target or store, a device or log
        format the worker does not know, a shard index without shards. Ranges are the
        parser's and line breaks the caller's to refuse (problems())."""
        out: list[str] = []
        if self.mode not in MODES:
            out.append(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        elif (self.mode in _TARGET_FLAGS) != bool(self.target):
            out.append(f"target: {self.mode} needs one" if self.mode in _TARGET_FLAGS
                       else f"target: {self.mode} takes none")
        if not self.output and self.mode != SELF_CHECK:
            out.append(f"output: {self.mode} needs a store URL")
        if self.batch.shard_index is not None and self.mode != SHARDS:
            out.append("batch.shard_index: goes with the shards mode")
        return out + self._choice_problems()

    def flag_problems(self) -> list[str]:
        """The problems of a template that a backend completes per worker with a mode,
        target and store (a Job's model, a shard folder): an unknown device or log format,
        a line break in a value (a Job's argv is read in logs and `kubectl get -o yaml`)."""
        return self._choice_problems() + self._line_problems()

    def problems(self) -> list[str]:
        """Every reason the worker would refuse this command line, or a line break in it,
        each naming its field or flag (empty: the worker's parser takes it, and it reads
        back as this value)."""
        out = self.structure_problems() + self._line_problems(whole=True)
        try:
            self.analysis.validate()
        except UsageError as e:
            out.append(str(e))
        if out:
            return out
        try:
            back = parse(self.to_argv())
        except InvalidInvocation as e:
            return [str(e)]
        return [] if back == self else [f"does not read back from its argv: {self!r}"]

    def _line_problems(self, *, whole: bool = False) -> list[str]:
        """A line break in a text value: the flags' (a template's), and with `whole` the
        mode's target and the store too."""
        texts: dict[str, str | None] = (
            {"target": self.target, "output": self.output} if whole else {})
        texts |= {"model_key": self.model_key, "relation": self.relation,
                  "base_model": self.base_model, "batch.run_id": self.batch.run_id,
                  "batch.cache_dir": self.batch.cache_dir}
        return [f"{name}: must be a single-line string" for name, text in texts.items()
                if text is not None and _LINE_BREAK.search(text)]

    def _choice_problems(self) -> list[str]:
        out: list[str] = []
        if self.device is not None and self.device not in DEVICES:
            out.append(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.log_format is not None and self.log_format not in LOG_FORMATS:
            out.append(f"log_format: {self.log_format!r} must be one of "
                       f"{', '.join(LOG_FORMATS)}")
        return out


def parse(argv: Sequence[str]) -> WorkerInvocation:
    """The invocation an `esd-worker` argv (without the program) says, read by the command's
    own parser; InvalidInvocation (nothing printed) for one the worker would refuse."""
    args = _parser().parse_args(list(argv))
    if args.output is None and not args.self_check:
        raise InvalidInvocation("the following arguments are required: --output/--output-dir")
    mode = next(m for m, on in ((MODEL, args.model), (MODELS, args.models),
                                (SHARDS, args.shards), (SERVE, args.serve),
                                (SELF_CHECK, args.self_check)) if on not in (None, False))
    target = {MODEL: args.model, MODELS: args.models, SHARDS: args.shards}.get(mode, "")
    batch = BatchOptions(
        run_id=args.run_id, max_retries=args.max_retries, prefetch=args.prefetch,
        overwrite=args.overwrite, skip_failed=args.skip_failed, shard_index=args.shard_index,
        cache_dir=args.cache_dir, cache_budget=args.cache_budget,
        model_timeout=args.model_timeout, memory_limit=args.memory_limit)
    inv = WorkerInvocation(
        mode=mode, target=target, output=args.output or "", model_key=args.model_key,
        relation=args.relation, base_model=args.base_model, log_format=args.log_format,
        device=args.device, batch=batch, hub_rate=args.hub_rate,
        analysis=analysis_from_args(args), save_eigs=not args.no_eigs,
        trust_remote_code=args.trust_remote_code, parallel_gpu=args.parallel_gpu,
        host_eigensolvers=args.host_eigensolvers,
        verbose=args.verbose)
    problems = inv.structure_problems()
    if problems:
        raise InvalidInvocation("; ".join(problems))
    return inv


def parse_command(command: Sequence[str]) -> WorkerInvocation:
    """parse() of a whole command whose program is `esd-worker` (a Job's container args)."""
    if not command or command[0] != PROG:
        raise InvalidInvocation(f"not an {PROG} command")
    return parse(command[1:])


class _QuietParser(Parser):
    """The command's parser, but a refusal (or --help, --version) raises InvalidInvocation
    and prints nothing: reading a Job's argv must not write to the controller's terminal."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInvocation(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise InvalidInvocation(message or f"{PROG} would exit {status} (--help, --version)")

    def _print_message(self, message: str, file: Any = None) -> None:
        pass


@functools.cache
def _parser() -> argparse.ArgumentParser:
    parser = build_parser(_QuietParser)
    # Absent is not the worker's default here: None leaves the flag out again, whatever
    # $ESD_LOG_FORMAT the reader has. --cache-dir stays the text given (the worker makes
    # a Path of it; a Path would drop a trailing '/').
    parser.set_defaults(device=None, log_format=None)
    for action in parser._actions:
        if action.dest == "cache_dir":
            action.type = None
    return parser


def _analysis_argv(analysis: AnalysisSettings) -> list[str]:
    """The analysis flags, every one (a worker of another version with other defaults
    computes the same); repr keeps each float exact."""
    argv = [
        "--fix-fingers", analysis.fix_fingers,
        "--evals-thresh", repr(analysis.evals_thresh),
        "--bins", str(analysis.bins),
        "--min-evals", str(analysis.min_evals),
        "--conv-norm", repr(analysis.conv_norm),
        "--precision", analysis.precision,
    ]
    if analysis.include_embeddings:
        argv.append("--include-embeddings")
    return argv


def _pair(flag: str, value: str | None) -> list[str]:
    return [] if value is None else [flag, value]


def _text(number: float | None) -> str | None:
    return None if number is None else str(number)
