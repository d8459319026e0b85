"""The no-progress limit of a model and the watch over a worker's heartbeats."""

from __future__ import annotations

import pytest

from esd_worker.core.watchdog import (
    DEFAULT_MODEL_TIMEOUT_S,
    MODEL_TIMEOUT,
    ModelWatch,
    no_progress_limit_s,
)

GB = 10**9


@pytest.mark.parametrize(("size", "floor", "low", "high"), [
    (None, 600.0, 600.0, 600.0),        # size not known yet: the floor
    (500 * 10**6, 600.0, 600.0, 600.0),  # a small model: the floor
    (14 * GB, 600.0, 1700.0, 2000.0),   # 7B in bf16: 3 × (560 s read + ~35 s eigensolver)
    (141 * GB, 600.0, 17000.0, 19500.0),  # 70B: 3 × (5640 s read + ~7 min)
    (500 * 10**6, 5.0, 60.0, 61.0),     # a low floor: the size's own estimate
])
def test_the_limit_grows_with_the_size_above_the_floor(size: int | None, floor: float,
                                                        low: float, high: float) -> None:
    assert low <= no_progress_limit_s(size, floor) <= high


def test_a_model_is_overdue_only_after_its_limit_without_a_heartbeat() -> None:
    watch = ModelWatch(floor_s=10.0)
    assert watch.overdue(1000.0) is None  # nothing in progress
    watch.start("org-m", now=0.0)
    assert watch.overdue(9.9) is None
    watch.beat("org-m", now=9.0)  # progress: the timer starts again
    assert watch.overdue(18.9) is None
    watch.beat("org-other", now=18.0)  # a late line of another model does not count
    error = watch.overdue(19.5)
    assert error is not None and error.startswith(f"{MODEL_TIMEOUT}: no progress for 10 s")
    assert "1 heartbeat(s)" in error and "--model-timeout" in error
    watch.end()
    assert watch.overdue(1e9) is None


def test_a_size_learnt_from_a_heartbeat_raises_the_limit() -> None:
    watch = ModelWatch()
    watch.start("org-big", now=0.0)
    assert watch.limit_s == DEFAULT_MODEL_TIMEOUT_S
    watch.beat("org-big", now=1.0, size_bytes=141 * GB)
    assert watch.limit_s > 5 * 3600
    assert watch.overdue(3600.0) is None
