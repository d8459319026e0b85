"""Per-layer differences between two sets of results: two locations, or two tables of one.

Owns how models are paired (same model_key, explicit A_KEY:B_KEY pairs, or each adapter with
its base), how layers are matched (by name) and the differences CSV. Reads stores through
controller.results.tables (the results tables: layers read only for the paired models) or,
for refit tables and stores without results tables, controller.results.reader; computes no
metric of its own, only b − a.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import ResultsError
from controller.results.reader import (
    ModelResult,
    base_keys,
    find_base_key,
    load_results,
    models_by_ref,
    no_table_error,
    number,
    open_results,
)
from controller.results.tables import Tables, layer_rows, model_shells
from esd_worker.core.command.flags import add_flag
from esd_worker.core.files import write_atomic
from esd_worker.core.powerlaw import METRIC_COLUMNS
from esd_worker.core.store.results import table_to_csv
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import MODELS_TABLE

DEFAULT_METRICS: tuple[str, ...] = (
    "alpha",
    "D",
    "xmin",
    "num_pl_spikes",
    "alpha_weighted",
    "log_alpha_norm",
    "spectral_norm",
    "log_spectral_norm",
    "stable_rank",
    "entropy",
    "log_norm",
)
ID_COLUMNS: tuple[str, ...] = (
    "model_key_a", "model_key_b", "layer", "layer_type", "status_a", "status_b",
)
# Shown in the printed table (the CSV has every metric asked for).
_SHOWN = ("alpha", "stable_rank", "log_norm", "entropy")


def diff_columns(metrics: Sequence[str]) -> tuple[str, ...]:
    """The differences CSV's columns: ID_COLUMNS, then <metric>_a, _b, _delta per metric."""
    return ID_COLUMNS + tuple(f"{m}_{s}" for m in metrics for s in ("a", "b", "delta"))


@dataclass(frozen=True)
class CompareSettings:
    """Two sets of results and how to pair their models.

    a, b: results locations (b defaults to a); tag_a, tag_b: compare layers.<tag>.csv
    (a refit) instead of layers.csv.
    pairs: explicit (A model_key, B model_key) pairs, e.g. a base and its fine-tune.
    adapters: pair each adapter of B with its base in A (marker base_model), so delta is
    adapter − base. Also the default when A and B are the same table.
    metrics: columns compared (default DEFAULT_METRICS).
    out: where to write the differences CSV (None: print only).
    """

    a: str
    b: str | None = None
    tag_a: str | None = None
    tag_b: str | None = None
    pairs: tuple[tuple[str, str], ...] = ()
    adapters: bool = False
    metrics: tuple[str, ...] = DEFAULT_METRICS
    out: Path | None = None

    @property
    def same_table(self) -> bool:
        return (self.b is None or self.b == self.a) and (self.tag_a or "") == (self.tag_b or "")

    def validate(self) -> None:
        bad = [m for m in self.metrics if m not in METRIC_COLUMNS]
        if bad:
            raise ResultsError(f"--metrics: unknown {', '.join(bad)} (choose from "
                               f"{', '.join(METRIC_COLUMNS)})")
        if not self.metrics:
            raise ResultsError("--metrics: give at least one metric")


def parse_pair(text: str) -> tuple[str, str]:
    """`A_KEY:B_KEY` → (A_KEY, B_KEY); model keys have no ':'."""
    a, sep, b = text.partition(":")
    if not sep or not a or not b or ":" in b:
        raise ResultsError(f"--pair {text!r}: expected A_KEY:B_KEY (two model keys)")
    return a, b


def pair_models(
    a: Sequence[ModelResult], b: Sequence[ModelResult], settings: CompareSettings
) -> list[tuple[ModelResult, ModelResult]]:
    """The (A, B) model pairs to compare; ResultsError when there is none."""
    by_a = {r.key: r for r in a}
    by_b = {r.key: r for r in b}
    if settings.pairs:
        missing = [f"{k} (A)" for k, _ in settings.pairs if k not in by_a]
        missing += [f"{k} (B)" for _, k in settings.pairs if k not in by_b]
        if missing:
            raise ResultsError(f"--pair: no results for {', '.join(missing)}")
        return [(by_a[ka], by_b[kb]) for ka, kb in settings.pairs]
    if settings.adapters or settings.same_table:
        # Base in A, adapter in B: delta = adapter − base, what the adapter changed.
        if settings.same_table:
            found = base_keys(b)
        else:
            by_model = models_by_ref(a)
            found = {}
            for r in b:
                key = find_base_key(r, by_model, by_a)
                if key is not None:
                    found[r.key] = key
        pairs = [(by_a[base], by_b[adapter]) for adapter, base in sorted(found.items())
                 if base in by_a]
        if not pairs:
            raise ResultsError(
                "nothing to compare: no adapter with its base among the results"
                + (" (A and B are the same table: give --tag-b, a second location or "
                   "--pair A_KEY:B_KEY)" if settings.same_table else "")
            )
        return pairs
    common = sorted(set(by_a) & set(by_b))
    if not common:
        raise ResultsError(
            "no model_key in both A and B: pair models with --pair A_KEY:B_KEY, or compare "
            "adapters with their bases with --adapters"
        )
    return [(by_a[k], by_b[k]) for k in common]


def compare_layers(
    a: ModelResult, b: ModelResult, metrics: Sequence[str] = DEFAULT_METRICS
) -> list[dict[str, Any]]:
    """One row per layer name of either model (A's order, then B-only layers): both
    statuses, each metric's value in A and B, and delta = b − a (NaN when either is)."""
    rows_b = {r.get("layer"): r for r in b.rows}
    names = [r.get("layer") for r in a.rows]
    names += [n for n in rows_b if n not in {r.get("layer") for r in a.rows}]
    rows_a = {r.get("layer"): r for r in a.rows}
    out = []
    for name in names:
        ra, rb = rows_a.get(name, {}), rows_b.get(name, {})
        row: dict[str, Any] = {
            "model_key_a": a.key, "model_key_b": b.key, "layer": name,
            "layer_type": ra.get("layer_type") or rb.get("layer_type"),
            "status_a": ra.get("status"), "status_b": rb.get("status"),
        }
        for m in metrics:
            va, vb = number(ra.get(m)), number(rb.get(m))
            row[f"{m}_a"], row[f"{m}_b"], row[f"{m}_delta"] = va, vb, vb - va
        out.append(row)
    return out


_COUNTS = frozenset({"num_evals", "num_pl_spikes", "matrix_rank"})


def _cell(value: Any, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        if column.rsplit("_", 1)[0] in _COUNTS and value.is_integer():
            return str(int(value))
        return repr(value)
    return str(value)


def diff_to_csv(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> bytes:
    """The differences as CSV: floats in full precision, NaN and missing as empty cells."""
    return table_to_csv(diff_columns(metrics), rows, _cell)


@dataclass(frozen=True)
class Comparison:
    """Compared pairs and their per-layer rows (compare_layers), in pair order."""

    pairs: tuple[tuple[ModelResult, ModelResult], ...]
    rows: tuple[dict[str, Any], ...]
    metrics: tuple[str, ...]


def compare_results(settings: CompareSettings) -> Comparison:
    """Load both sides, pair the models, match their layers; write settings.out if given."""
    settings.validate()
    keys_a = [ka for ka, _ in settings.pairs] or None
    keys_b = [kb for _, kb in settings.pairs] or None
    store_a = open_results(settings.a)
    a = _load(store_a, settings.tag_a, keys_a)
    if settings.same_table and not settings.pairs:
        b = a
    else:
        store_b = store_a if settings.b in (None, settings.a) else open_results(settings.b)
        b = _load(store_b, settings.tag_b, keys_b)
    pairs = _with_rows(pair_models(a.results, b.results, settings), a, b)
    rows = [row for ra, rb in pairs for row in compare_layers(ra, rb, settings.metrics)]
    if settings.out is not None:
        try:
            settings.out.parent.mkdir(parents=True, exist_ok=True)
            # Whole, and never through a symlink planted at its name (write_atomic).
            write_atomic(settings.out, diff_to_csv(rows, settings.metrics))
        except OSError as e:
            raise ResultsError(f"cannot write {settings.out}: {e.strerror or e}") from e
    return Comparison(tuple(pairs), tuple(rows), settings.metrics)


@dataclass(frozen=True)
class _Side:
    """One side's models; `tables` set when they are shells whose layers are in its tables."""

    results: list[ModelResult]
    tables: Tables | None = None


def _load(store: Store, tag: str | None, keys: Sequence[str] | None) -> _Side:
    """A refit's tables (a tag) and stores without results tables: every model's files, as
    read_model_markers and iter_results do. Otherwise the models rows of the results tables
    (controller.results.tables), whose layers are read only for the models paired."""
    tables = Tables(store)
    if tag is not None or not tables.parts(MODELS_TABLE):
        return _Side(load_results(store, tag=tag, keys=keys))
    shells = model_shells(tables, keys)
    missing = sorted(set(keys or ()) - {r.key for r in shells})
    if missing:
        raise ResultsError(f"no result for model key(s) {', '.join(missing)} in {store.url}")
    if not shells:
        raise no_table_error(store, tag)
    return _Side(shells, tables)


def _with_rows(pairs: Sequence[tuple[ModelResult, ModelResult]], a: _Side,
               b: _Side) -> list[tuple[ModelResult, ModelResult]]:
    """The pairs with the layer rows of shells read from their side's tables."""
    rows: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for index, side in enumerate((a, b)):
        if side.tables is not None:
            keys = {pair[index].key for pair in pairs}
            rows[index] = layer_rows(side.tables, keys)

    def filled(index: int, result: ModelResult) -> ModelResult:
        if index not in rows:
            return result
        return dataclasses.replace(result, rows=rows[index].get(result.key, []))

    return [(filled(0, ra), filled(1, rb)) for ra, rb in pairs]


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _f(value: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(value) else f"{value:+.{digits}f}"


def format_comparison(result: Comparison, limit: int = 20) -> str:
    """A short table for people: per pair, the matched layers, mean Δ of a few metrics and
    the layer whose α moved most."""
    shown = [m for m in _SHOWN if m in result.metrics] or list(result.metrics[:3])
    header = ["A", "B", "layers", *(f"Δ{m} mean" for m in shown), "max |Δalpha| (layer)"]
    table = [header]
    for ra, rb in result.pairs[:limit]:
        rows = [r for r in result.rows
                if r["model_key_a"] == ra.key and r["model_key_b"] == rb.key]
        both = [r for r in rows if r["status_a"] is not None and r["status_b"] is not None]
        line = [ra.name, rb.name, str(len(both))]
        line += [_f(_mean([r[f"{m}_delta"] for r in both])) for m in shown]
        moved = [r for r in both if math.isfinite(r.get("alpha_delta", math.nan))]
        if moved:
            top = max(moved, key=lambda r: abs(r["alpha_delta"]))
            line.append(f"{abs(top['alpha_delta']):.3f} ({top['layer']})")
        else:
            line.append("–")
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in table]
    if len(result.pairs) > limit:
        lines.append(f"... {len(result.pairs) - limit} more pairs in the CSV")
    lines.append("Δ = B − A")
    return "\n".join(lines)


def add_compare_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="results location (directory, file:// or s3://)")
    parser.add_argument("b", metavar="B", nargs="?",
                        help="second results location (default: A, to compare two tables)")
    add_flag(parser, "--tag-a", metavar="TAG", help="use A's layers.<TAG>.csv (a refit)")
    add_flag(parser, "--tag-b", metavar="TAG", help="use B's layers.<TAG>.csv (a refit)")
    add_flag(parser, "--pair", action="append", default=[], metavar="A_KEY:B_KEY",
             help="compare these two models (e.g. a base and its fine-tune); repeatable")
    add_flag(parser, "--adapters", action="store_true",
             help="compare each adapter of B with its base in A, delta = adapter - base (the "
             "default when A and B are the same table)")
    add_flag(parser, "--metrics", default=",".join(DEFAULT_METRICS), metavar="M1,M2",
             help=f"metrics to compare (default {','.join(DEFAULT_METRICS)})")
    add_flag(parser, "--out", type=Path, metavar="FILE.csv",
             help="write the per-layer differences here")


def run_compare(args: argparse.Namespace) -> int:
    """`esd-sweep compare`: errors are raised (ResultsError: exit 2; StoreError: exit 3)."""
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    result = compare_results(CompareSettings(
        a=args.a, b=args.b, tag_a=args.tag_a, tag_b=args.tag_b,
        pairs=tuple(parse_pair(p) for p in args.pair), adapters=args.adapters,
        metrics=metrics, out=args.out,
    ))
    print(format_comparison(result))
    if args.out is not None:
        print(f"{len(result.rows)} layer rows of {len(result.pairs)} pair(s) in {args.out}")
    return 0
