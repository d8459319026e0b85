"""Command-line flags shared by `esd-worker` and `esd-sweep` (argparse only; no torch)."""

from __future__ import annotations

import argparse
from typing import Any

from esd_worker.powerlaw import FIX_FINGERS
from esd_worker.settings import PRECISIONS, AnalysisSettings


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


def add_fit_flags(parser: argparse.ArgumentParser | Any) -> None:
    """The power-law fit flags (all a refit can change); defaults are AnalysisSettings'."""
    d = AnalysisSettings()
    add_flag(parser, "--fix-fingers", choices=FIX_FINGERS, default=d.fix_fingers,
             help=f"how xmin is chosen (default {d.fix_fingers})")
    add_flag(parser, "--evals-thresh", type=float, default=d.evals_thresh,
             help=f"eigenvalues <= this are left out of the fit (default {d.evals_thresh:g})")
    add_flag(parser, "--bins", type=int, default=d.bins,
             help=f"histogram bins for xmin_peak (default {d.bins})")


def add_analysis_flags(parser: argparse.ArgumentParser | Any) -> None:
    """The ESD flags; their defaults are AnalysisSettings' (docs/metrics.md)."""
    d = AnalysisSettings()
    add_fit_flags(parser)
    add_flag(parser, "--min-evals", type=int, default=d.min_evals,
             help=f"layers whose smaller side is below this are reported too_small "
             f"(default {d.min_evals})")
    add_flag(parser, "--conv-norm", type=float, default=d.conv_norm,
             help=f"Conv2d slices are scaled by sqrt(conv_norm) (default {d.conv_norm})")
    add_flag(parser, "--precision", choices=PRECISIONS, default=d.precision,
             help="float32: Gram matrix + eigvalsh (fast, default); float64: the same in "
             "float64 (reference accuracy)")
    add_flag(parser, "--include-embeddings", action="store_true",
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


def analysis_from_args(args: argparse.Namespace) -> AnalysisSettings:
    return AnalysisSettings(
        fix_fingers=args.fix_fingers,
        evals_thresh=args.evals_thresh,
        bins=args.bins,
        min_evals=args.min_evals,
        conv_norm=args.conv_norm,
        precision=args.precision,
        include_embeddings=args.include_embeddings,
    )


def analysis_argv(analysis: AnalysisSettings) -> list[str]:
    """The worker flags that reproduce `analysis` (the controller passes them on)."""
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
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (bytes, or with a unit: 500M, 50G, 20GiB)") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(size)
