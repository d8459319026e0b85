"""Named analysis presets and how a result's fit is named where it is read (pure).

Owns PRESETS (a preset is a set of AnalysisSettings fields that reproduces another tool's
analysis: `ww`, WeightWatcher 0.7's default `analyze()`), `settings_with` (a preset under
the flags given explicitly), `preset_of` (which preset a stored result's parameters are),
`fit_label` (the one line that says how a table, plot or page was fitted) and where
WeightWatcher's 2-6 band of α applies. Does not own what the fields mean
(esd_worker.core.command.settings, docs/metrics.md) nor the flags (flags.py).

Why WeightWatcher's band needs its fit: the band was read off α fitted with xmin chosen by
the KS distance (DKS). The default xmin_mid takes the median eigenvalue as xmin, a longer
"tail", and gives a systematically smaller α (all-MiniLM-L6-v2: mean 2.01 vs 4.18), so the
band says nothing about it (docs/reading-alpha.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from esd_worker.core.command.settings import AnalysisSettings

WW = "ww"

# WeightWatcher 0.7.7 `analyze()` defaults: xmin by the KS distance over every candidate
# (fix_fingers=False there = our DKS), a float64 SVD ("accurate"; "fast" is float64 on a
# CPU too), Embedding layers analysed, layers with fewer than 8 eigenvalues skipped
# (min_evals=8; ours keeps them as rows with status too_small). evals_thresh 1e-5 and the
# Conv2d scaling are the same as ours by default.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    WW: MappingProxyType({
        "fix_fingers": "DKS", "precision": "float64", "include_embeddings": True,
        "min_evals": 8,
    }),
})
PRESET_HELP = {
    WW: "WeightWatcher's default analysis: --fix-fingers DKS --precision float64 "
        "--include-embeddings --min-evals 8",
}
# WeightWatcher's warning band: α below is "over-trained", above "under-trained".
WW_ALPHA_BAND = (2.0, 6.0)
BAND_FIX_FINGERS = "DKS"  # the fit the band was calibrated with


def settings_with(preset: str | None, explicit: Mapping[str, Any]) -> AnalysisSettings:
    """AnalysisSettings from a preset (None: the defaults) under the fields given explicitly
    (a flag on the command line wins over its preset). Raises KeyError for a preset not in
    PRESETS (the parsers offer only those)."""
    fields = dict(PRESETS[preset]) if preset else {}
    fields.update({k: v for k, v in explicit.items() if v is not None})
    return AnalysisSettings(**fields)


def preset_of(parameters: Mapping[str, Any] | None) -> str | None:
    """The preset whose settings these stored analysis parameters are (every other field at
    its default), or None."""
    if not parameters:
        return None
    known = {f.name for f in dataclasses.fields(AnalysisSettings)}
    given = {k: v for k, v in parameters.items() if k in known}
    for name in PRESETS:
        if AnalysisSettings(**given) == settings_with(name, {}):
            return name
    return None


def band_applies(fix_fingers: str | None) -> bool:
    """Whether WeightWatcher's 2-6 band of α may be read on α fitted so."""
    return fix_fingers == BAND_FIX_FINGERS


def fit_label(parameters: Mapping[str, Any] | None, *, fix_fingers: str | None = None) -> str:
    """How results were fitted, in one short line for a plot, a table header or a page:
    "preset ww (DKS, float64, embeddings)", "fit xmin_mid, float32". fix_fingers: a refit's
    fit (it replaces the stored one; the precision is the analysis')."""
    params = dict(parameters or {})
    if fix_fingers is not None and fix_fingers != params.get("fix_fingers"):
        params["fix_fingers"] = fix_fingers
    preset = preset_of(params)
    fit = params.get("fix_fingers") or "?"
    precision = params.get("precision") or "?"
    extra = ", embeddings" if params.get("include_embeddings") else ""
    if preset:
        return f"preset {preset} ({fit}, {precision}{extra})"
    return f"fit {fit}, {precision}{extra}"
