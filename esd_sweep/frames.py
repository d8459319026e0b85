"""Layer tables as pandas DataFrames, with WeightWatcher's column names where the quantity
is the same (pure, no torch).

Owns the DataFrame form of the per-layer table (docs/metrics.md): numbers typed, and the
columns WeightWatcher users look for added where they are well defined:
- layer_id: the layer's place in its model's table (0, 1, …; WeightWatcher counts every
  module, analysed or not, so its ids can differ; the layers and their order are the same);
- longname: the module's name (`layer` less ".weight");
- lambda_max (= spectral_norm, the largest eigenvalue of WᵀW) and sv_max = √lambda_max;
- warning: "over-trained" (α < 2), "under-trained" (α > 6), "" between, as WeightWatcher
  warns, only for layers fitted with its fit (DKS: the band was read off that fit;
  esd_worker.core.command.presets); missing (NA) otherwise.
The other metrics already carry WeightWatcher's names (alpha, alpha_weighted, D, xmin,
xmax, num_pl_spikes, spectral_norm, log_spectral_norm, norm, log_norm, stable_rank,
entropy, matrix_rank, num_evals, M, N, layer_type, status).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from esd_worker.core.command.presets import WW_ALPHA_BAND, band_applies
from esd_worker.core.powerlaw import METRIC_COLUMNS, STATUS_OK

_TEXT = ("model_id", "revision", "layer", "layer_type", "fix_fingers", "status", "model_key",
         "quantization")
_INTS = ("M", "N", "num_params", "num_evals", "num_pl_spikes", "matrix_rank", "layer_index")
OVER_TRAINED, UNDER_TRAINED = "over-trained", "under-trained"


def typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Numbers as numbers: integer columns as nullable Int64, metrics as float64 (a layer
    without a fit has NaN, as in layers.csv), text as it is."""
    for column in frame.columns:
        if column in _TEXT:
            continue
        if column in _INTS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("Int64")
        elif column in METRIC_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    return frame


def layers_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """layers.csv's rows (text cells) as a typed DataFrame with the WeightWatcher columns."""
    return with_ww_columns(typed(pd.DataFrame.from_records(list(rows))))


def with_ww_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """The WeightWatcher columns (module docstring) added to a typed layer table."""
    if frame.empty:
        return frame
    by_model = frame.groupby("model_key", sort=False) if "model_key" in frame else None
    frame.insert(0, "layer_id", (by_model.cumcount() if by_model is not None
                                 else pd.Series(np.arange(len(frame)), index=frame.index)))
    frame["longname"] = frame["layer"].str.removesuffix(".weight")
    frame["lambda_max"] = frame["spectral_norm"]
    frame["sv_max"] = np.sqrt(frame["spectral_norm"])
    frame["warning"] = warnings(frame)
    return frame


def warnings(frame: pd.DataFrame) -> pd.Series:
    """WeightWatcher's warning of each layer, where its band applies (else NA)."""
    low, high = WW_ALPHA_BAND
    alpha = frame["alpha"]
    text = np.where(alpha < low, OVER_TRAINED, np.where(alpha > high, UNDER_TRAINED, ""))
    fitted = frame["fix_fingers"].map(band_applies).astype(bool) & (frame["status"] == STATUS_OK)
    return pd.Series(text, index=frame.index, dtype="string").where(fitted, pd.NA)
