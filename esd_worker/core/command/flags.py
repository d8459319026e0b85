"""Command-line flags shared by `esd-worker` and `esd-sweep` (argparse only; no torch): the
one argparse type of every numeric flag of both (`Number`: finite, whole or not, a size with
a unit, within the range its flag declares) and their parser's one-line usage error
(`Parser`). What a flag's value means is its module's."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from esd_worker.core.command.presets import PRESET_HELP, PRESETS, settings_with
from esd_worker.core.command.settings import MAX_HOST_EIGENSOLVERS, PRECISIONS, AnalysisSettings
from esd_worker.core.echo import quoted
from esd_worker.core.errors import EXIT_USAGE
from esd_worker.core.powerlaw import FIX_FINGERS
from esd_worker.core.redact import redact
from esd_worker.core.watchdog import DEFAULT_MODEL_TIMEOUT_S


class UsageExit(SystemExit):
    """argparse refused the command line (exit 2); `message` is why, naming the flag."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr, redacted, pointing at --help (where
    the usage is), raised as UsageExit (a SystemExit with status 2) so that the command can
    still say it elsewhere (esd-sweep run's --report). Subcommands' parsers are Parsers too."""

    def error(self, message: str) -> NoReturn:
        print(redact(f"{self.prog}: error: {message} (see {self.prog} --help)"),
              file=sys.stderr, flush=True)
        raise UsageExit(redact(message))

_SIZE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str) -> int:
    """Bytes from `123`, `500M`, `50G`, `1.5Ti`, `20GiB` (argparse type; decimal and binary
    units)."""
    value = text.strip().upper().removesuffix("B")
    number = value.rstrip("KMGTI")
    unit = value[len(number):]
    try:
        size = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        size = math.nan
    # float() reads nan, inf and 1e999 (inf): none of them is a size, and int() of them
    # raises ValueError / OverflowError, which argparse would turn into a traceback.
    if not math.isfinite(size):
        raise argparse.ArgumentTypeError(
            f"not a size: {quoted(text, limit=40)} (bytes, or with a unit: 500M, 50G, 20GiB)")
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {quoted(text, limit=40)}")
    return int(size)


# Upper bounds a user could mean. A value past them is a typo or a unit slip (1e999 seconds,
# a 10 PB cache), refused at the flag rather than met hours later.
MINUTE_S = 60
HOUR_S = 3600
DAY_S = 24 * HOUR_S
WEEK_S = 7 * DAY_S
MAX_BYTES = 10**15  # 1000T: more disk than one worker has, more bytes than any model
MAX_ROWS = 10**9  # rows or models: more than any list
MAX_GPUS = 1024  # GPU indices and counts
MAX_GPUS_PER_MODEL = 64  # several nodes' GPUs
MAX_RETRIES = 100
MAX_PREFETCH = 100
PREFETCH = 1  # --prefetch's default, in esd-worker and esd-sweep: one model downloaded ahead
MAX_THREADS = 1024
MAX_EVALS_THRESH = 1e6
MAX_BINS = 10**6
MAX_CONV_NORM = 1e6
MAX_MIN_EVALS = 10**6  # no matrix has a smaller side this long

NumberKind = Literal["int", "float", "size"]


@dataclass(frozen=True)
class Number:
    """The argparse type of a numeric flag: a finite number in [lo, hi] (above lo, not lo
    itself, when `above`). kind: int, a whole number; float; size, bytes with an optional
    unit (parse_size: 500M, 50G, 20GiB). word: a word (any case) also accepted, read as None
    ("auto"). unit: said after the range in the error ("seconds"). Anything else (nan, inf,
    1e999, out of range, not a number) is argparse's usage error naming the flag: exit 2.

    Every numeric flag of esd-sweep and esd-worker has one (tests/controller/test_cli_flags.py
    walks both parsers), so the range is said where the flag is declared."""

    lo: float
    hi: float
    kind: NumberKind = "float"
    above: bool = False
    unit: str = ""
    word: str | None = None

    def __call__(self, text: str) -> Any:
        if self.word is not None and text.strip().lower() == self.word:
            return None
        try:
            value = self._parse(text)
            fits = self.holds(value)
        except (ValueError, OverflowError, argparse.ArgumentTypeError):
            fits = False  # not a number, or a whole number too long for a float
        if not fits:
            raise argparse.ArgumentTypeError(
                f"must be {self.describe()}, got {quoted(text, limit=40)}")
        return value

    def _parse(self, text: str) -> float:
        if self.kind == "int":
            return int(text.strip())
        if self.kind == "size":
            return parse_size(text)
        return float(text)

    def holds(self, value: float) -> bool:
        """Whether `value` is in range (finite, lo..hi)."""
        low = value > self.lo if self.above else value >= self.lo
        return math.isfinite(value) and low and value <= self.hi

    def describe(self) -> str:
        """The range in words, e.g. "a whole number from 1 to 100" (also for help texts)."""
        unit = f" {self.unit}" if self.unit else ""
        lo, hi = _number_text(self.lo), _number_text(self.hi)
        if self.kind == "int":
            text = f"a whole number from {lo} to {hi}{unit}"
        elif self.kind == "size":
            text = (f"a size from {_size_text(self.lo)} to {_size_text(self.hi)} (bytes, or "
                    "with a unit: 500M, 50G, 20GiB)")
        else:
            text = f"a number {'>' if self.above else '>='} {lo} and <= {hi}{unit}"
        return text if self.word is None else f"{text}, or {self.word!r}"


def int_in(lo: int, hi: int, *, unit: str = "", word: str | None = None) -> Number:
    """argparse type: a whole number lo..hi (or `word`, read as None)."""
    return Number(lo, hi, "int", unit=unit, word=word)


def float_in(lo: float, hi: float, *, above: bool = False, unit: str = "") -> Number:
    """argparse type: a finite number lo..hi (above lo, not lo itself, when `above`)."""
    return Number(lo, hi, "float", above=above, unit=unit)


def size_in(lo: int, hi: int = MAX_BYTES) -> Number:
    """argparse type: bytes lo..hi, e.g. 500M, 50G, 20GiB (parse_size)."""
    return Number(lo, hi, "size")


# --prefetch's one check, in both commands' parsers: 0 (no read-ahead) to MAX_PREFETCH models.
PREFETCH_COUNT = int_in(0, MAX_PREFETCH)


def _number_text(value: float) -> str:
    """1000000000 rather than 1e+09, 0.5 as 0.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _size_text(size: float) -> str:
    """`size` bytes in the largest decimal unit that divides it (1000T, 1G, 0)."""
    for unit in ("T", "G", "M", "K"):
        scale = _SIZE_UNITS[unit]
        if size and size % scale == 0:
            return f"{size // scale:g}{unit}"
    return f"{size:g}"


MIN_EVALS = int_in(2, MAX_MIN_EVALS)  # --min-evals of the worker, run and refit
PORT = int_in(1, 65535)
# Hub requests a second (esd-worker --hub-rate, the sweep's): the hub's free tier allows
# about 3; beyond 10,000 a second no limit is meant.
HUB_RATE = float_in(0, 10_000, above=True, unit="requests a second")


def add_flag(
    parser: argparse.ArgumentParser | Any, name: str, *aliases: str, **kwargs: Any
) -> None:
    """A kebab-case flag plus its snake_case spelling (the old scripts' flags) as an alias."""
    snake = "--" + name.removeprefix("--").replace("-", "_")
    names = [name, *aliases]
    for alias in aliases:
        alias_snake = "--" + alias.removeprefix("--").replace("-", "_")
        if alias_snake != alias and alias_snake not in names:
            names.append(alias_snake)
    if snake != name:
        names.append(snake)
    parser.add_argument(*names, **kwargs)


def add_preset_flag(parser: argparse.ArgumentParser | Any) -> None:
    """--preset NAME: a named set of analysis flags (esd_worker.core.command.presets); a flag
    given explicitly wins over its preset."""
    add_flag(parser, "--preset", choices=tuple(PRESETS), default=None,
             help="a named set of analysis flags, explicit flags win; "
             + "; ".join(f"{name}: {text}" for name, text in PRESET_HELP.items()))


# The AnalysisSettings fields add_fit_flags sets: all a refit can change, as the eigenvalues
# do not depend on them (`esd-sweep run` refits a result that differs only in these).
FIT_FIELDS = ("fix_fingers", "evals_thresh", "bins")


def add_fit_flags(parser: argparse.ArgumentParser | Any) -> None:
    """The power-law fit flags (all a refit can change) and --preset; defaults are
    AnalysisSettings' (None here: a flag not given takes its preset's value or the default)."""
    d = AnalysisSettings()
    add_preset_flag(parser)
    add_flag(parser, "--fix-fingers", choices=FIX_FINGERS, default=None,
             help=f"how xmin is chosen (default {d.fix_fingers}; DKS: WeightWatcher's)")
    add_flag(parser, "--evals-thresh", type=float_in(0, MAX_EVALS_THRESH), default=None,
             help=f"eigenvalues <= this are left out of the fit (default {d.evals_thresh:g})")
    add_flag(parser, "--bins", type=int_in(1, MAX_BINS), default=None,
             help=f"histogram bins for xmin_peak (default {d.bins})")


def add_analysis_flags(parser: argparse.ArgumentParser | Any) -> None:
    """The ESD flags; their defaults are AnalysisSettings' (docs/metrics.md), or a preset's."""
    d = AnalysisSettings()
    add_fit_flags(parser)
    add_flag(parser, "--min-evals", type=MIN_EVALS, default=None,
             help=f"layers whose smaller side is below this are reported too_small "
             f"(default {d.min_evals})")
    add_flag(parser, "--conv-norm", type=float_in(0, MAX_CONV_NORM, above=True), default=None,
             help=f"Conv2d slices are scaled by sqrt(conv_norm) (default {d.conv_norm})")
    add_flag(parser, "--precision", choices=PRECISIONS, default=None,
             help="float32: Gram matrix + eigvalsh (fast, default); float64: the same in "
             "float64 (reference accuracy)")
    add_flag(parser, "--include-embeddings", action="store_true", default=None,
             help="analyse Embedding layers too")


def add_parallel_gpu_flags(parser: argparse.ArgumentParser | Any) -> None:
    """--parallel-gpu (the old --parallel-esd; the default) / --no-parallel-gpu: whether one
    model's layers are spread over every GPU the worker is given."""
    group = parser.add_mutually_exclusive_group()
    add_flag(group, "--parallel-gpu", "--parallel-esd", dest="parallel_gpu",
             action="store_true", default=True,
             help="spread a model's layers over every GPU its worker is given, one analysis "
             "stream per GPU (default)")
    add_flag(group, "--no-parallel-gpu", dest="parallel_gpu", action="store_false",
             help="one GPU per model even when several are visible")


def add_host_eigensolvers_flag(parser: argparse.ArgumentParser | Any) -> None:
    """--host-eigensolvers N, in both commands: host threads that diagonalise layers beside
    the GPU (esd_worker.analysis.hostsolve); None: the worker's default."""
    add_flag(parser, "--host-eigensolvers", type=int_in(0, MAX_HOST_EIGENSOLVERS), default=None,
             metavar="N",
             help="host threads (LAPACK, float64) that diagonalise layers beside each GPU, "
             "dealt by each side's speed; the results do not depend on it (default: the cores "
             "the process's CPU quota leaves free; 0: the GPU alone; none on a CPU-only run)")


def add_model_timeout_flag(group: argparse.ArgumentParser | Any) -> None:
    """--model-timeout, in both commands: the floor of a model's no-progress limit
    (esd_worker.core.watchdog), which the shard pod's supervisor and the local backend keep."""
    add_flag(group, "--model-timeout", type=float_in(0, WEEK_S, above=True, unit="seconds"),
             default=None, metavar="SECONDS",
             help="a model that shows no progress (no weight file fetched, no step of its "
             "layer discovery, no layer analysed) for this long, or longer for a big model, "
             "is killed as hung and charged one "
             f"attempt (default {DEFAULT_MODEL_TIMEOUT_S:g})")


def analysis_from_args(args: argparse.Namespace) -> AnalysisSettings:
    """The analysis settings of parsed add_analysis_flags: the preset's, or the defaults,
    under the flags given."""
    return settings_with(args.preset, {
        "fix_fingers": args.fix_fingers, "evals_thresh": args.evals_thresh, "bins": args.bins,
        "min_evals": args.min_evals, "conv_norm": args.conv_norm, "precision": args.precision,
        "include_embeddings": args.include_embeddings,
    })


def fit_from_args(args: argparse.Namespace) -> AnalysisSettings:
    """The fit of parsed add_fit_flags (a refit's): only fix_fingers, evals_thresh and bins
    of the result are read."""
    return settings_with(args.preset, {
        "fix_fingers": args.fix_fingers, "evals_thresh": args.evals_thresh, "bins": args.bins,
    })
