"""What the atlas-scale report shows of all models, computed from the results tables in
streaming passes with memory bounded by bins, groups and N (not by models or layers).

Owns the passes: (1) the models table's few columns → histograms of the headline metrics
by family / relation / size, the fit settings in use, top and bottom N per metric, each
model's family for step 3; (2) the models table again → the outliers by robust z from
pass 1's median and MAD; (3) the layers table's alpha (status "ok") → histogram by family.
Not owned: the arithmetic (aggregates.py), reading the tables (tables.py), the page (html.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from controller.results.aggregates import (
    GroupedHistograms,
    Histogram,
    TopN,
    histogram_for,
    robust_z,
    size_buckets,
    top_groups,
)
from controller.results.tables import Tables

HEADLINE = ("alpha_mean", "alpha_median", "alpha_weighted_mean", "stable_rank_mean",
            "log_spectral_norm_mean", "entropy_mean")
GROUPINGS = ("family", "relation", "size")
TOP_FAMILIES = 12
OUTLIER_Z = 5.0
BINS = 200
_MODEL_COLUMNS = ("model_key", "family", "relation", "num_params", "parameters", *HEADLINE)


@dataclass
class Overview:
    """The report's numbers of all models: counts, histograms, top lists, outliers."""

    models: int = 0
    layers: int = 0
    families: Counter[str] = field(default_factory=Counter)
    relations: Counter[str] = field(default_factory=Counter)
    parameters: Counter[str] = field(default_factory=Counter)
    # metric → grouping → GroupedHistograms (families already folded into the top ones)
    hists: dict[str, dict[str, GroupedHistograms]] = field(default_factory=dict)
    top: dict[str, TopN] = field(default_factory=dict)
    bottom: dict[str, TopN] = field(default_factory=dict)
    outliers: dict[str, TopN] = field(default_factory=dict)
    layer_alpha: GroupedHistograms = field(
        default_factory=lambda: GroupedHistograms("alpha", BINS))

    @property
    def common_parameters(self) -> tuple[str, int]:
        """The most common fit settings (JSON text) and how many models use another."""
        if not self.parameters:
            return "", 0
        text, n = self.parameters.most_common(1)[0]
        return text, self.models - n


def _text(column: pa.Array) -> np.ndarray:
    """A string column as an object array, null and "" as "unknown"."""
    values = np.asarray(pc.fill_null(column, "").to_pylist(), dtype=object)
    values[values == ""] = "unknown"
    return values


def _family_code(names: np.ndarray, codes: dict[str, int]) -> np.ndarray:
    return np.fromiter((codes.setdefault(str(n), len(codes)) for n in names),
                       dtype=np.int32, count=len(names))


def build_overview(tables: Tables, *, n: int = 20) -> Overview:
    """Three streaming passes over the tables (see the module's docstring)."""
    view = Overview()
    raw: dict[str, dict[str, GroupedHistograms]] = {
        m: {g: GroupedHistograms(m, BINS) for g in GROUPINGS} for m in HEADLINE}
    view.top = {m: TopN(n, largest=True) for m in HEADLINE}
    view.bottom = {m: TopN(n, largest=False) for m in HEADLINE}
    codes: dict[str, int] = {}
    hashes: list[np.ndarray] = []
    fams: list[np.ndarray] = []
    for batch in tables.models(_MODEL_COLUMNS):
        view.models += batch.num_rows
        family, relation = _text(batch.column("family")), _text(batch.column("relation"))
        size = size_buckets(batch.column("num_params"))
        view.families.update(family.tolist())
        view.relations.update(relation.tolist())
        view.parameters.update(pc.fill_null(batch.column("parameters"), "").to_pylist())
        keys = batch.column("model_key")
        hashes.append(np.fromiter((hash(k) for k in keys.to_pylist()), dtype=np.int64,
                                  count=batch.num_rows))
        fams.append(_family_code(family, codes))
        for metric in HEADLINE:
            values = batch.column(metric)
            floats = np.asarray(values.to_numpy(zero_copy_only=False), dtype=float)
            for grouping, groups in zip(GROUPINGS, (family, relation, size), strict=True):
                raw[metric][grouping].add(floats, groups)
            view.top[metric].add(keys, values)
            view.bottom[metric].add(keys, values)
    fold = top_groups(dict(view.families), keep=TOP_FAMILIES)
    view.hists = {m: {g: (_fold(h, fold) if g == "family" else h) for g, h in by.items()}
                  for m, by in raw.items()}
    _outliers(tables, view, n)
    _layer_alpha(tables, view, np.concatenate(hashes) if hashes else np.empty(0, np.int64),
                 np.concatenate(fams) if fams else np.empty(0, np.int32),
                 {code: fold.get(name, "other") for name, code in codes.items()})
    return view


def _fold(grouped: GroupedHistograms, mapping: dict[str, str]) -> GroupedHistograms:
    """The same histograms with groups outside the top ones summed into "other"."""
    out = GroupedHistograms(grouped.metric, grouped.bins)
    for name, hist in grouped.groups.items():
        target = name if name == "all" else mapping.get(name, "other")
        merged = out.groups.setdefault(target, histogram_for(grouped.metric, grouped.bins))
        _merge(merged, hist)
    return out


def _merge(into: Histogram, other: Histogram) -> None:
    into.counts += other.counts
    into.under += other.under
    into.over += other.over
    into.missing += other.missing
    into.in_band += other.in_band


def _outliers(tables: Tables, view: Overview, n: int) -> None:
    """Pass 2: the models whose |robust z| exceeds OUTLIER_Z, the most extreme n per metric."""
    centre = {}
    for metric in HEADLINE:
        hist = view.hists[metric]["relation"].groups.get("all")
        median = hist.quantile(0.5) if hist else None
        mad = hist.mad() if hist else None
        if median is not None and mad:
            centre[metric] = (median, mad)
    view.outliers = {m: TopN(n, largest=True) for m in centre}
    if not centre:
        return
    for batch in tables.models(("model_key", *centre)):
        keys = batch.column("model_key")
        for metric, (median, mad) in centre.items():
            values = np.asarray(batch.column(metric).to_numpy(zero_copy_only=False), dtype=float)
            z = np.abs(robust_z(values, median, mad))
            far = np.nonzero(z > OUTLIER_Z)[0]
            if far.size:
                view.outliers[metric].add(keys.take(pa.array(far)), pa.array(z[far]))


def _layer_alpha(tables: Tables, view: Overview, hashes: np.ndarray, fams: np.ndarray,
                 names: dict[int, str]) -> None:
    """Pass 3: layer alpha (status "ok") by the model's family, found by key hash."""
    order = np.argsort(hashes, kind="stable")
    sorted_hashes, sorted_fams = hashes[order], fams[order]
    labels = np.array([names.get(i, "other") for i in range(max(names, default=-1) + 1)]
                      + ["unknown"], dtype=object)
    for batch in tables.layers(("model_key", "status", "alpha")):
        view.layers += batch.num_rows
        ok = batch.filter(pc.equal(batch.column("status"), "ok"))
        if not ok.num_rows:
            continue
        h = np.fromiter((hash(k) for k in ok.column("model_key").to_pylist()),
                        dtype=np.int64, count=ok.num_rows)
        at = np.clip(np.searchsorted(sorted_hashes, h), 0, max(len(sorted_hashes) - 1, 0))
        found = (sorted_hashes[at] == h) if len(sorted_hashes) else np.zeros(len(h), bool)
        code = np.where(found, sorted_fams[at] if len(sorted_fams) else -1, len(labels) - 1)
        alpha = np.asarray(ok.column("alpha").to_numpy(zero_copy_only=False), dtype=float)
        view.layer_alpha.add(alpha, labels[code])
