"""controller.results.aggregates and failures: histograms, quantiles, top-N, grouping;
memory bounded by bins and N, not by rows."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from controller.results.aggregates import (
    GroupedHistograms,
    Histogram,
    TopN,
    histogram_for,
    relabel,
    robust_z,
    size_bucket,
    size_buckets,
    top_groups,
)
from controller.results.failures import group_failures
from esd_worker.core.store.records import FailureRecord, write_failure
from esd_worker.core.store.stores import LocalStore


@pytest.mark.parametrize(("num_params", "label"), [
    (None, "unknown"), (0, "unknown"), (5_000_000, "<100M"), (100_000_000, "100M-1B"),
    (7_000_000_000, "1B-10B"), (70_000_000_000, "10B-100B"), (10**12, ">=100B"),
])
def test_size_bucket(num_params: int | None, label: str) -> None:
    assert size_bucket(num_params) == label
    assert list(size_buckets(pa.array([num_params], pa.int64()))) == [label]


def test_histogram_quantiles_match_numpy_to_a_bin() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(4.0, 1.0, 50_000)
    hist = Histogram(0.0, 20.0, bins=400)
    for chunk in np.array_split(values, 7):
        hist.add(chunk)
    width = 20.0 / 400
    for q in (0.05, 0.25, 0.5, 0.75, 0.95):
        assert hist.quantile(q) == pytest.approx(np.quantile(values, q), abs=width)
    share = float(((values >= 2) & (values <= 6)).mean())
    assert hist.band_share() == pytest.approx(share)
    # MAD of a normal is 0.6745 sigma.
    assert hist.mad() == pytest.approx(0.6745, abs=2 * width)


def test_histogram_under_over_missing_and_log() -> None:
    hist = histogram_for("stable_rank_mean", bins=50)
    hist.add(np.array([np.nan, -1.0, 0.0, 1e-3, 1.0, 10.0, 1e6]))
    assert (hist.missing, hist.under, hist.over, hist.count) == (1, 3, 1, 6)
    assert hist.quantile(0.01) == hist.low
    assert hist.quantile(1.0) == hist.high
    assert Histogram(0, 1).quantile(0.5) is None


def test_grouped_histograms_order_and_relabel() -> None:
    grouped = GroupedHistograms("alpha_mean", bins=20)
    mapping = top_groups({"llama": 5, "bert": 3, "gpt2": 1}, keep=2)
    assert mapping == {"llama": "llama", "bert": "bert", "gpt2": "other"}
    groups = relabel(np.array(["llama"] * 5 + ["bert"] * 3 + ["gpt2"]), mapping)
    grouped.add(np.arange(9, dtype=float), groups)
    assert [(name, h.count) for name, h in grouped.ordered()] == [
        ("all", 9), ("llama", 5), ("bert", 3), ("other", 1)]


@pytest.mark.parametrize("largest", [True, False])
def test_top_n_across_batches(largest: bool) -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(size=5_000)
    values[10] = np.nan
    keys = [f"m{i:05d}" for i in range(values.size)]
    top = TopN(n=7, largest=largest)
    for start in range(0, values.size, 999):
        top.add(pa.array(keys[start:start + 999]),
                pa.array(values[start:start + 999], from_pandas=True))
    finite = [(k, v) for k, v in zip(keys, values, strict=True) if not np.isnan(v)]
    want = sorted(finite, key=lambda kv: -kv[1] if largest else kv[1])[:7]
    assert top.rows() == want


def test_top_n_ties_prefer_the_smaller_key() -> None:
    top = TopN(n=2)
    top.add(pa.array(["c", "a", "b"]), pa.array([1.0, 1.0, 1.0]))
    assert top.rows() == [("a", 1.0), ("b", 1.0)]


def test_robust_z() -> None:
    z = robust_z(np.array([1.0, 3.0]), median=2.0, mad=1.0)
    assert z == pytest.approx([-1 / 1.4826, 1 / 1.4826])
    assert np.isnan(robust_z(np.array([1.0]), 1.0, 0.0)).all()


def _stream(rows: int) -> int:
    """Peak traced bytes while streaming `rows` synthetic model rows through the aggregates."""
    rng = np.random.default_rng(2)
    grouped = GroupedHistograms("alpha_mean", bins=400)
    top = TopN(n=20)
    families = np.array([f"fam{i}" for i in range(15)], dtype=object)
    tracemalloc.start()
    for start in range(0, rows, 10_000):
        n = min(10_000, rows - start)
        values = rng.normal(4, 1, n)
        grouped.add(values, families[rng.integers(0, 15, n)])
        top.add(pa.array([f"k{start + i}" for i in range(n)]), pa.array(values))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert grouped.groups["all"].count == rows
    return peak


def test_memory_bounded_whatever_the_rows() -> None:
    small, large = _stream(20_000), _stream(200_000)
    assert large < 8 * 2**20
    assert large < small * 1.5


def test_failures_grouped_and_capped(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    causes = [("TransientError", True)] * 4 + [("PermanentModelError", False)] * 2
    for i, (error, retryable) in enumerate(causes):
        write_failure(store, FailureRecord(
            model=f"org/m{i}", model_key=f"k{i}", error=error, exit_code=3, signal=None,
            retryable=retryable, attempts=1, stderr_tail=(), run_id="r", time="t"))
    store.put_bytes("_failures/bad.json", b"not json")
    groups = group_failures(store)
    assert (groups.listed, groups.read, groups.unreadable, groups.not_read) == (7, 6, 1, 0)
    assert groups.rows() == [
        ("TransientError", True, 4, ["org/m0", "org/m1", "org/m2", "org/m3"]),
        ("PermanentModelError", False, 2, ["org/m4", "org/m5"]),
    ]
    capped = group_failures(store, max_records=3)
    assert (capped.listed, capped.read + capped.unreadable, capped.not_read) == (7, 3, 4)
