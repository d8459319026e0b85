"""A write refused mid-file, as on a full disk: nothing counts as done, the rerun finishes.

No test machine lets a test fill a disk (a small filesystem needs root to mount), so the
sweep runs under RLIMIT_FSIZE: any write past the limit fails with EFBIG ("File too large"),
an OSError from the same write call, through the same store code path, as ENOSPC. The limit
lets the small files (logs, layers.csv, a marker) through and stops each eigs.npz.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from tests.faults.conftest import all_whole, esd_sweep, run_args, status

LIMIT = 4096  # bytes: above layers.csv and result.json of a tiny GPT-2, below its eigs.npz

pytestmark = pytest.mark.slow


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_a_refused_write_leaves_no_marker_and_the_rerun_finishes(
    model_list: Path, keys: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "results"
    full = esd_sweep(*run_args(model_list, str(out), "--max-retries", "1"),
                     preexec_fn=limit_file_size)
    assert full.returncode == 1, full.stderr  # some models failed
    assert "Traceback" not in full.stderr  # the log file that filled up says so once
    assert full.stderr.count("cannot be written") <= 1
    for key in keys:
        assert not (out / key / "result.json").exists()
        record = json.loads((out / "_failures" / f"{key}.json").read_text())
        assert record["retryable"] is True and record["attempts"] == 2
        assert "File too large" in record["error"]
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".*.tmp"))
    assert status(model_list, str(out))["todo"] == 3

    again = esd_sweep(*run_args(model_list, str(out)))
    assert again.returncode == 0, again.stderr
    assert all_whole(out, keys)
    assert not list((out / "_failures").glob("*.json"))
