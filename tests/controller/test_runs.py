"""Tests of controller.run.runs: the run report (runs/<run_id>.json) and run ids."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from controller.run.runs import new_run_id, write_run_report
from esd_worker.core.store.layout import LayoutError, run_report_key
from esd_worker.core.store.stores import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "results")


def test_write_run_report(store: LocalStore) -> None:
    report = {
        "run_id": "20261123T070501Z-abcdef", "counts": {"done": 3, "failed": 1},
        "success_rate": 0.75, "avg_gpu_wait_s": math.nan, "durations": (1.5, 2.0),
        "log_dir": Path("/tmp/logs"), "started": datetime(2026, 11, 23, tzinfo=UTC),
    }
    key = write_run_report(store, "20261123T070501Z-abcdef", report)
    assert key == "runs/20261123T070501Z-abcdef.json"
    data = store.get_bytes(key)
    assert data is not None
    doc = json.loads(data)
    assert doc["counts"] == {"done": 3, "failed": 1}
    assert doc["avg_gpu_wait_s"] is None  # JSON has no NaN
    assert doc["durations"] == [1.5, 2.0]
    assert doc["log_dir"] == "/tmp/logs"
    assert doc["started"].startswith("2026-11-23")


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x y"])
def test_run_report_key_rejects_unsafe_ids(bad: str) -> None:
    """LayoutError is a ValueError: callers that caught ValueError still do."""
    with pytest.raises(ValueError, match="invalid run id") as err:
        run_report_key(bad)
    assert isinstance(err.value, LayoutError)


# --- run ids --------------------------------------------------------------------------------


def test_run_id_format() -> None:
    run_id = new_run_id(datetime(2026, 11, 23, 7, 5, 1, tzinfo=UTC))
    assert re.fullmatch(r"20261123T070501Z-[0-9a-f]{6}", run_id)
    assert run_report_key(run_id) == f"runs/{run_id}.json"


def test_run_ids_sort_by_start_time() -> None:
    """Lexical order is time order, across time zones and day/year boundaries."""
    start = datetime(2026, 12, 31, 23, 59, 58, tzinfo=UTC)
    times = [start + timedelta(seconds=s) for s in (0, 1, 2, 3, 86400, 86400 * 40)]
    ids = [new_run_id(t.astimezone(timezone(timedelta(hours=-7)))) for t in times]
    assert sorted(ids) == ids
    assert ids[2].startswith("20270101T000000Z-")


def test_run_ids_unique_within_a_second() -> None:
    now = datetime(2026, 11, 23, tzinfo=UTC)
    assert len({new_run_id(now) for _ in range(200)}) == 200


def test_run_id_defaults_to_now() -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    run_id = new_run_id()
    stamp = datetime.strptime(run_id.split("-")[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    assert before <= stamp <= datetime.now(UTC)
