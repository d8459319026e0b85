"""The per-layer table: columns, CSV and eigs.npz encoding, the per-model summary (no torch).

The marker (result.json) is esd_worker.core.store.layout's.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from esd_worker.core.powerlaw import METRIC_COLUMNS

LAYER_COLUMNS: tuple[str, ...] = (
    "model_id",
    "revision",
    "layer",
    "layer_type",
    "M",
    "N",
    "num_params",
    *METRIC_COLUMNS,
    "fix_fingers",
    "status",
    # The scheme a quantized weight was dequantized from (esd_worker.analysis.quantized);
    # empty for weights read as stored. Layer tables written before it lack the column.
    "quantization",
)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float | np.floating):
        f = float(value)
        return "nan" if math.isnan(f) else repr(f)
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def table_to_csv(
    columns: Sequence[str],
    rows: Iterable[Mapping[str, Any]],
    cell: Callable[[Any, str], str],
) -> bytes:
    """UTF-8 CSV: a header of `columns`, then one line per row; cell(value, column) writes
    each value (None for a missing one). The one writer of the project's CSV tables."""
    return b"".join(csv_parts(columns, rows, cell))


def csv_parts(
    columns: Sequence[str],
    rows: Iterable[Mapping[str, Any]],
    cell: Callable[[Any, str], str],
    *,
    part_chars: int = 2**18,
) -> Iterator[bytes]:
    """table_to_csv's bytes in parts of about `part_chars` characters, each made as the rows
    come: a table of millions of rows is never held (Store.put_parts writes it so)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([cell(row.get(col), col) for col in columns])
        if buf.tell() >= part_chars:
            yield buf.getvalue().encode("utf-8")
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue().encode("utf-8")


def layers_to_csv(rows: Iterable[Mapping[str, Any]]) -> bytes:
    """CSV with LAYER_COLUMNS; floats in full precision (repr) so refits reproduce exactly."""
    return table_to_csv(LAYER_COLUMNS, rows, lambda value, _column: _cell(value))


def layers_from_csv(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode("utf-8"))))


def eigs_to_npz(eigs: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    arrays: dict[str, Any] = {name: np.asarray(v, dtype=np.float64) for name, v in eigs.items()}
    np.savez(buf, **arrays)
    return buf.getvalue()


def eigs_from_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


# Per-model summary: the alpha family needs a fit, so it is over "ok" layers only; the norm
# family is computed from all eigenvalues and stays valid when the fit failed, so it is over
# every layer whose value is finite.
_ALPHA_MEANS = ("alpha_weighted", "log_alpha_norm")
_NORM_MEANS = ("stable_rank", "log_spectral_norm", "log_norm", "entropy")
SUMMARY_FIELDS: tuple[str, ...] = (
    "layers",
    "layers_ok",
    "alpha_mean",
    "alpha_median",
    "alpha_std",
    "alpha_in_2_6_share",
    *(f"{col}_mean" for col in _NORM_MEANS),
    *(f"{col}_mean" for col in _ALPHA_MEANS),
)


def number(value: Any) -> float:
    """A layers.csv cell or a row value as float; empty, None or unparsable → NaN."""
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def summarize_layers(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One model's numbers across its layers (result.json "summary", summary.csv columns).

    rows: dicts as in layers.csv; values may be numbers or the CSV's strings.
    layers: all rows; layers_ok: rows with status "ok".
    alpha_mean/median/std (population, ddof=0), alpha_in_2_6_share (share of ok layers with
    2 ≤ α ≤ 6: WeightWatcher's band, presets.WW_ALPHA_BAND, which this layer cannot import;
    meaningful for DKS α only, presets.band_applies), alpha_weighted_mean,
    log_alpha_norm_mean: over ok layers with a finite value.
    stable_rank_mean, log_spectral_norm_mean, log_norm_mean, entropy_mean: over every layer
    with a finite value (a failed fit leaves the norms valid).
    A statistic with no value to average is None (JSON null), never NaN.
    """
    rows = list(rows)
    ok = [row for row in rows if str(row.get("status", "")).strip() == "ok"]
    alphas = _finite(number(row.get("alpha")) for row in ok)
    summary: dict[str, Any] = {"layers": len(rows), "layers_ok": len(ok)}
    summary["alpha_mean"] = _mean(alphas)
    summary["alpha_median"] = float(np.median(alphas)) if alphas else None
    summary["alpha_std"] = float(np.std(alphas)) if alphas else None
    summary["alpha_in_2_6_share"] = (
        sum(1 for a in alphas if 2.0 <= a <= 6.0) / len(ok) if ok else None
    )
    for col in _NORM_MEANS:
        summary[f"{col}_mean"] = _mean(_finite(number(row.get(col)) for row in rows))
    for col in _ALPHA_MEANS:
        summary[f"{col}_mean"] = _mean(_finite(number(row.get(col)) for row in ok))
    return {field: summary[field] for field in SUMMARY_FIELDS}
