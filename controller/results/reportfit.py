"""How the results a report shows were fitted: one label, or how many models each fit has
("mixed fits: 3 xmin_mid, 2 DKS"); whether WeightWatcher's 2-6 band of α may be drawn, and
the one line a page says when it may not.

Owns the report's reading of the models table's `parameters` (the JSON texts the overview's
first pass already counts: no pass of its own) and of a refit's fix_fingers, and which
report metrics are fitted from the power law. The rule itself (a label, where the band
applies) is esd_worker.core.command.presets'; it is not restated here.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from esd_worker.core.command.presets import (
    BAND_FIX_FINGERS,
    WW_ALPHA_BAND,
    band_applies,
    fit_label,
)

READING_ALPHA = "docs/reading-alpha.md"
# Report metrics on α's own scale, where the band may be drawn (alpha_weighted_mean is α
# times log λ_max: fitted, but not on the band's scale).
BAND_METRICS = frozenset({"alpha", "alpha_mean", "alpha_median"})


def fitted(metric: str) -> bool:
    """Whether a report metric comes from the power-law fit (its plots carry the label)."""
    return metric.startswith(("alpha", "log_alpha"))


@dataclass(frozen=True)
class Fit:
    """How some results were fitted. label: one line for a title or a page; fix_fingers:
    the distinct fits, most models first ("?" where a result does not say)."""

    label: str
    fix_fingers: tuple[str, ...]

    @property
    def band(self) -> bool:
        """WeightWatcher's band applies: every α was fitted with the band's fit."""
        return bool(self.fix_fingers) and all(band_applies(f) for f in self.fix_fingers)

    @property
    def note(self) -> str | None:
        """Why the band is not shown (None when it is), in one line."""
        if self.band:
            return None
        these = (self.fix_fingers[0] if len(self.fix_fingers) == 1
                 else f"mixed ({', '.join(self.fix_fingers)})")
        low, high = WW_ALPHA_BAND
        return (f"the {low:g}–{high:g} band is calibrated for the {BAND_FIX_FINGERS} fit; "
                f"these α are {these}: see {READING_ALPHA}")


def _parameters(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Parameters as a dict, from a marker's mapping or the models table's JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value else None
        except json.JSONDecodeError:
            value = None
    return dict(value) if isinstance(value, Mapping) else {}


def fit_of(parameters: Mapping[str, Any] | str | None, *,
           fix_fingers: str | None = None) -> Fit:
    """One model's fit. fix_fingers: a refit's (it replaces the stored one)."""
    params = _parameters(parameters)
    return Fit(fit_label(params, fix_fingers=fix_fingers),
               (fix_fingers or params.get("fix_fingers") or "?",))


def fit_of_models(counts: Mapping[str, int], *, fix_fingers: str | None = None) -> Fit:
    """The fit of many models from their parameters' texts counted (text → models): the
    one label, or "mixed fits: 3 xmin_mid, 2 DKS" (by fix_fingers; by label where only
    other settings differ)."""
    labels: Counter[str] = Counter()
    fits: Counter[str] = Counter()
    for text, n in counts.items():
        one = fit_of(text, fix_fingers=fix_fingers)
        labels[one.label] += n
        fits[one.fix_fingers[0]] += n
    order = tuple(f for f, _ in fits.most_common())
    if len(labels) == 1:
        return Fit(next(iter(labels)), order)
    if len(fits) > 1:
        return Fit("mixed fits: " + ", ".join(f"{n} {f}" for f, n in fits.most_common()), order)
    return Fit("mixed fits: " + "; ".join(f"{n} × {label}" for label, n in labels.most_common()),
               order)


def both(adapter: Fit, base: Fit) -> Fit:
    """The fit of a plot of an adapter and its base: theirs when alike, else both named."""
    if adapter == base:
        return adapter
    order = tuple(dict.fromkeys(adapter.fix_fingers + base.fix_fingers))
    label = (adapter.label if adapter.label == base.label
             else f"adapter {adapter.label}; base {base.label}")
    return Fit(label, order)
