"""The per-layer table and the completion marker: columns, CSV and JSON encoding (no torch)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from esd_worker.powerlaw import METRIC_COLUMNS

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
)
MARKER_SCHEMA = 1


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float | np.floating):
        f = float(value)
        return "nan" if math.isnan(f) else repr(f)
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def layers_to_csv(rows: Iterable[Mapping[str, Any]]) -> bytes:
    """CSV with LAYER_COLUMNS; floats in full precision (repr) so refits reproduce exactly."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(LAYER_COLUMNS)
    for row in rows:
        writer.writerow([_cell(row.get(col)) for col in LAYER_COLUMNS])
    return buf.getvalue().encode("utf-8")


def layers_from_csv(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode("utf-8"))))


def eigs_to_npz(eigs: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{name: np.asarray(v, dtype=np.float64) for name, v in eigs.items()})
    return buf.getvalue()


def eigs_from_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def marker_to_json(marker: Mapping[str, Any]) -> bytes:
    return (json.dumps(marker, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
