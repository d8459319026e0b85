"""Two sweeps started at once on one output (a double-clicked CI job, two people): one runs,
the other exits 2 saying who holds the output; every model is analysed once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.faults.conftest import ENV, all_whole, esd_sweep_argv, run_args
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow


def test_two_sweeps_at_once_one_runs_the_other_is_told_who(
    model_list: Path, keys: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "results"
    procs = [subprocess.Popen(esd_sweep_argv(*run_args(model_list, str(out))), cwd=REPO_ROOT,
                              env=os.environ | ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(proc.pid, *proc.communicate(timeout=600), proc.returncode) for proc in procs]
    codes = sorted(code for *_, code in results)
    assert codes == [0, 2], results
    (winner,) = [pid for pid, _, _, code in results if code == 0]
    (refused,) = [err for _, _, err, code in results if code == 2]
    lines = [line for line in refused.splitlines() if "in use by another sweep" in line]
    assert len(lines) == 1 and f"pid={winner} " in lines[0], refused
    assert "Traceback" not in refused
    assert all_whole(out, keys)
    # One analysis each: the refused sweep started no worker.
    logs = list((out / "logs" / "workers").glob("*.log"))
    done = sum(log.read_text().count(" done: ") for log in logs)
    assert done == len(keys)
