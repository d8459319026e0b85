"""The example notebook (examples/notebook.py, percent format) runs top to bottom offline,
as a script, and says what a reader of it should see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow


def test_the_notebook_runs_offline(tmp_path: Path) -> None:
    env = os.environ | {"ESD_NOTEBOOK_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1",
                        "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "notebook.py")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "preset ww (DKS, float64, embeddings)" in out
    assert "mean alpha 4.12" in out  # all-MiniLM-L6-v2 under WeightWatcher's analysis
    assert "fit xmin_mid, float32 mean alpha 2.01 warnings given: 0" in out
    assert "GPT-2: 17 layers" in out  # as its saved folder: the tied lm_head included
    assert "71 layers, 0 failures" in out
    assert (tmp_path / "esd.png").stat().st_size > 10_000
    assert "not analysed" not in done.stderr  # a tied lm_head is its embedding's, as on disk
