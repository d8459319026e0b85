"""SIGTERM (eviction, the controller stopping or dying) stops a worker: exit 4, no marker.

Why it matters: the controller's resume trusts the marker. A worker that swallowed the
signal (an `except Exception` fallback on the way) and carried on would write a degraded
result — e.g. fallback layer discovery — that resume then never redoes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.builders import make_gpt2

pytestmark = pytest.mark.slow


def test_sigterm_during_startup_exits_4_without_a_result(tmp_path: Path) -> None:
    """The signal lands while the worker resolves the model and builds its layer map (it
    is sent as soon as the worker has said which device it uses): exit 4, one line saying
    it was terminated, no result.json and no fallback discovery."""
    model = make_gpt2(tmp_path / "gpt2")
    out = tmp_path / "out"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "esd_worker.cli", "--model", str(model), "--output", str(out),
         "--device", "cpu"],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        lines.append(line)
        if "device used" in line:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=60) == 4, "".join(lines)
    text = "".join(lines)
    assert "terminated by signal 15" in text
    assert "using fallback" not in text and "Traceback" not in text
    assert not list(out.rglob("result.json"))


def test_a_failed_rerun_leaves_no_stale_marker(tmp_path: Path) -> None:
    """A rerun with other parameters that fails after rewriting layers.csv (here eigs.npz
    cannot be written) must not leave the old marker vouching for the new table: the
    model is not done, so the next run redoes it."""
    from esd_worker.core.errors import StorePathError
    from tests.support.builders import run_analysis

    model = make_gpt2(tmp_path / "gpt2")
    out = tmp_path / "out"
    first = run_analysis(model, out)
    key = first.marker["model_key"]
    (out / key / "eigs.npz").unlink()
    (out / key / "eigs.npz").mkdir()  # the next eigs.npz write fails (a folder in the way)
    with pytest.raises(StorePathError):
        run_analysis(model, out, fix_fingers="DKS")
    assert not (out / key / "result.json").exists()
