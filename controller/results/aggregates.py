"""Streaming aggregates for the report: fixed-bin histograms by group, their quantiles,
and the top / bottom N of a column, fed a record batch at a time.

Owns: the arithmetic over numbers (numpy / pyarrow.compute), with memory fixed by the
number of bins, groups and N, whatever the number of rows. Not owned here: which columns
or tables are read (report.py), how the numbers are shown (html.py, plots.py).

Why fixed bins: a report of 2M models cannot keep every value to sort it; a histogram
of a few hundred bins over a sensible range (under/overflow counted apart) gives the
quantiles to a bin's width, which is what a person reads off a distribution anyway.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from esd_worker.core.command.presets import WW_ALPHA_BAND

#: Quantiles shown in the report's tables.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)

#: (low, high, log scale) of each headline metric's bins; values outside count as
#: under/overflow (their quantile reads as the edge).
METRIC_RANGES: dict[str, tuple[float, float, bool]] = {
    "alpha_mean": (0.0, 20.0, False),
    "alpha_median": (0.0, 20.0, False),
    "alpha_weighted_mean": (0.0, 20.0, False),
    "alpha": (0.0, 20.0, False),
    "stable_rank_mean": (1e-2, 1e5, True),
    "log_spectral_norm_mean": (-5.0, 10.0, False),
    "entropy_mean": (0.0, 1.0, False),
}

#: num_params buckets: (upper bound exclusive, label); the last is open-ended.
SIZE_BUCKETS: tuple[tuple[float, str], ...] = (
    (1e8, "<100M"),
    (1e9, "100M-1B"),
    (1e10, "1B-10B"),
    (1e11, "10B-100B"),
    (math.inf, ">=100B"),
)


def size_bucket(num_params: int | None) -> str:
    """The size bucket label of a parameter count; "unknown" when not known or not positive."""
    if num_params is None or num_params <= 0:
        return "unknown"
    for bound, label in SIZE_BUCKETS:
        if num_params < bound:
            return label
    return SIZE_BUCKETS[-1][1]  # pragma: no cover - inf bound catches all


def size_buckets(values: pa.Array) -> np.ndarray:
    """size_bucket of each value of an integer array (nulls → "unknown"), vectorised."""
    nums = np.asarray(pc.fill_null(values, 0).to_numpy(zero_copy_only=False), dtype=float)
    bounds = np.array([b for b, _ in SIZE_BUCKETS[:-1]])
    labels = np.array([label for _, label in SIZE_BUCKETS] + ["unknown"], dtype=object)
    index = np.searchsorted(bounds, nums, side="right")
    index[nums <= 0] = len(SIZE_BUCKETS)
    return labels[index]


@dataclass
class Histogram:
    """Counts of values in `bins` equal bins over [low, high) (log-spaced when `log`),
    plus under/overflow and the number of missing (null or NaN) values."""

    low: float
    high: float
    log: bool = False
    bins: int = 400
    counts: np.ndarray = field(init=False)
    under: int = 0
    over: int = 0
    missing: int = 0
    in_band: int = 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.bins, dtype=np.int64)

    @property
    def edges(self) -> np.ndarray:
        if self.log:
            return np.logspace(math.log10(self.low), math.log10(self.high), self.bins + 1)
        return np.linspace(self.low, self.high, self.bins + 1)

    def _scaled(self, values: np.ndarray) -> np.ndarray:
        """Position of each value in bin units (floor → its bin)."""
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                lo, hi = math.log10(self.low), math.log10(self.high)
                scaled = (np.log10(values) - lo) / (hi - lo) * self.bins
            return np.where(values <= 0, -1.0, scaled)
        return (values - self.low) / (self.high - self.low) * self.bins

    def add(self, values: np.ndarray) -> None:
        """Count a batch of float values (NaN counts as missing)."""
        values = np.asarray(values, dtype=float)
        finite = ~np.isnan(values)
        self.missing += int(values.size - finite.sum())
        values = values[finite]
        band = (values >= WW_ALPHA_BAND[0]) & (values <= WW_ALPHA_BAND[1])
        self.in_band += int(band.sum())
        pos = np.floor(self._scaled(values))
        self.under += int((pos < 0).sum())
        self.over += int((pos >= self.bins).sum())
        inside = pos[(pos >= 0) & (pos < self.bins)].astype(np.int64)
        self.counts += np.bincount(inside, minlength=self.bins)

    @property
    def count(self) -> int:
        """Number of values counted (missing ones excluded)."""
        return int(self.counts.sum()) + self.under + self.over

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated inside its bin; an edge when it falls in under/overflow;
        None when nothing was counted."""
        total = self.count
        if total == 0:
            return None
        target = q * total
        if target <= self.under:
            return self.low
        cum = np.cumsum(self.counts) + self.under
        index = int(np.searchsorted(cum, target, side="left"))
        if index >= self.bins:
            return self.high
        edges = self.edges
        before = cum[index] - self.counts[index]
        frac = (target - before) / self.counts[index] if self.counts[index] else 0.0
        return float(edges[index] + frac * (edges[index + 1] - edges[index]))

    def quantiles(self, qs: Sequence[float] = QUANTILES) -> list[float | None]:
        return [self.quantile(q) for q in qs]

    def band_share(self) -> float | None:
        """Share of counted values in WeightWatcher's band (WW_ALPHA_BAND): meaningful for
        α fitted as the band was (reportfit.Fit.band), and shown only then."""
        return self.in_band / self.count if self.count else None

    def mad(self) -> float | None:
        """Median absolute deviation, from the bins (each bin's centre stands for its values)."""
        median = self.quantile(0.5)
        if median is None:
            return None
        edges = self.edges
        centres = (edges[:-1] + edges[1:]) / 2
        deviations = np.concatenate([np.abs(centres - median), [abs(self.low - median)],
                                     [abs(self.high - median)]])
        weights = np.concatenate([self.counts, [self.under], [self.over]])
        order = np.argsort(deviations)
        cum = np.cumsum(weights[order])
        index = int(np.searchsorted(cum, cum[-1] / 2, side="left"))
        return float(deviations[order][index])


def histogram_for(metric: str, bins: int = 400) -> Histogram:
    low, high, log = METRIC_RANGES.get(metric, (0.0, 1.0, False))
    return Histogram(low, high, log, bins)


@dataclass
class GroupedHistograms:
    """One Histogram per group value of one metric, plus "all"."""

    metric: str
    bins: int = 400
    groups: dict[str, Histogram] = field(default_factory=dict)

    def add(self, values: np.ndarray, groups: np.ndarray) -> None:
        """Count a batch: values[i] in group groups[i]; every value also in "all"."""
        values = np.asarray(values, dtype=float)
        self._hist("all").add(values)
        for name in np.unique(groups):
            self._hist(str(name)).add(values[groups == name])

    def _hist(self, name: str) -> Histogram:
        if name not in self.groups:
            self.groups[name] = histogram_for(self.metric, self.bins)
        return self.groups[name]

    def ordered(self) -> list[tuple[str, Histogram]]:
        """"all" first, then the groups by count, largest first."""
        rest = sorted(((k, h) for k, h in self.groups.items() if k != "all"),
                      key=lambda kv: (-kv[1].count, kv[0]))
        return ([("all", self.groups["all"])] if "all" in self.groups else []) + rest


def top_groups(counts: dict[str, int], keep: int = 12, other: str = "other") -> dict[str, str]:
    """Map each group name to itself when among the `keep` largest, else to `other`."""
    ranked = sorted(counts, key=lambda name: (-counts[name], name))
    return {name: (name if i < keep else other) for i, name in enumerate(ranked)}


def relabel(values: np.ndarray, mapping: dict[str, str], default: str = "other") -> np.ndarray:
    """Each value through `mapping` (unknown values → default)."""
    return np.array([mapping.get(str(v), default) for v in values], dtype=object)


@dataclass
class TopN:
    """The N largest (or smallest) rows of a metric seen so far, with their keys; a batch at a
    time (pyarrow select_k per batch, then a bounded heap merge). Ties: the smaller key wins."""

    n: int = 20
    largest: bool = True
    _heap: list[tuple[float, str]] = field(default_factory=list)

    def add(self, keys: pa.Array, values: pa.Array) -> None:
        """Offer a batch's keys and values (nulls and NaN are skipped)."""
        table = pa.table({"k": keys, "v": pc.cast(values, pa.float64())})
        table = table.filter(pc.and_(pc.is_valid(table["v"]), pc.invert(pc.is_nan(table["v"]))))
        if table.num_rows == 0:
            return
        order = "descending" if self.largest else "ascending"
        picked = pc.select_k_unstable(table, k=min(self.n, table.num_rows),
                                      sort_keys=[("v", order), ("k", "ascending")])
        chosen = table.take(picked)
        for key, value in zip(chosen["k"].to_pylist(), chosen["v"].to_pylist(), strict=True):
            self._offer(float(value), str(key))

    def _offer(self, value: float, key: str) -> None:
        # The heap's root is the worst kept row: smallest value when keeping the largest.
        item = (value, _neg(key)) if self.largest else (-value, _neg(key))
        if len(self._heap) < self.n:
            heapq.heappush(self._heap, item)
        elif item > self._heap[0]:
            heapq.heapreplace(self._heap, item)

    def rows(self) -> list[tuple[str, float]]:
        """(key, value) best first."""
        out = sorted(self._heap, reverse=True)
        return [(_unneg(k), v if self.largest else -v) for v, k in out]  # type: ignore[arg-type]


class _NegKey(str):
    """A key that sorts in reverse, so the heap prefers the smaller key on ties."""

    def __lt__(self, other: str) -> bool:
        return str.__gt__(self, other)

    def __gt__(self, other: str) -> bool:
        return str.__lt__(self, other)


def _neg(key: str) -> _NegKey:
    return _NegKey(key)


def _unneg(key: _NegKey) -> str:
    return str(key)


def robust_z(values: np.ndarray, median: float, mad: float) -> np.ndarray:
    """(value - median) / (1.4826 MAD): about a z-score for normal data, robust to outliers;
    NaN where the MAD is zero."""
    scale = 1.4826 * mad
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.asarray(values, dtype=float) - median) / scale if scale > 0 else \
            np.full(np.shape(values), np.nan)


def stream(batches: Iterable[pa.RecordBatch], metric: str, group_of: str,
           hist: GroupedHistograms) -> None:
    """Feed `hist` the `metric` column of each batch grouped by column `group_of`
    ("" as "unknown")."""
    for batch in batches:
        values = batch.column(metric).to_numpy(zero_copy_only=False).astype(float)
        groups = np.asarray(batch.column(group_of).to_pylist(), dtype=object)
        groups[(groups == "") | (groups == None)] = "unknown"  # noqa: E711 - elementwise
        hist.add(values, groups)
