"""The controller SIGKILLed mid-run (a node lost, `kill -9`, the OOM killer): the rerun
finishes, no model twice, nothing written before the kill rewritten."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.conftest import ENV, all_whole, esd_sweep, esd_sweep_argv, run_args
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow


def _done_lines(log_dir: Path) -> dict[str, int]:
    """How many times each model's worker logged a completed analysis, over all runs."""
    counts: dict[str, int] = {}
    for log in (log_dir / "workers").glob("*.log"):
        counts[log.stem] = log.read_text().count(" done: ")
    return counts


def test_controller_killed_mid_run_loses_nothing(
    model_list: Path, keys: list[str], tmp_path: Path
) -> None:
    """SIGKILL the controller once the first marker exists, run again: every model ends done
    exactly once. Workers die with their controller (so no orphan finishes a model the rerun
    also starts), markers written before the kill are untouched, and no model is analysed
    again after its marker was written (each worker log shows one completed analysis)."""
    out = tmp_path / "results"
    proc = subprocess.Popen(esd_sweep_argv(*run_args(model_list, str(out))), cwd=REPO_ROOT,
                            env=os.environ | ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not any((out / k / "result.json").exists() for k in keys):
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)  # orphaned workers (if any) would get on with it here
    written = {k: (out / k / "result.json").read_bytes()
               for k in keys if (out / k / "result.json").exists()}
    assert 1 <= len(written) < len(keys)

    again = esd_sweep(*run_args(model_list, str(out)))
    assert again.returncode == 0, again.stderr
    assert all_whole(out, keys)
    assert {k: (out / k / "result.json").read_bytes() for k in written} == written
    # A worker killed between its marker and its last log line logs no "done"; none logs two.
    done = _done_lines(out / "logs")
    assert all(done.get(k, 0) <= 1 for k in written)
    assert all(done.get(k, 0) == 1 for k in keys if k not in written)
    assert not list(out.rglob("*.tmp"))


def test_a_poison_models_note_goes_with_its_record_and_the_rerun_tries_it_again(
    model_list: Path, keys: list[str], tmp_path: Path
) -> None:
    """SIGKILL the worker under the first model with --max-retries 0: the model is recorded
    as a poison model (not retryable), and its attempt note goes with the record. The same
    command again (failed models are retried by default, as the record says) analyses it:
    the note of the earlier run does not count against this one."""
    out = tmp_path / "results"
    note = out / "_attempts" / f"{keys[0]}.json"
    proc = subprocess.Popen(esd_sweep_argv(*run_args(model_list, str(out), "--max-retries", "0")),
                            cwd=REPO_ROOT, env=os.environ | ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not note.exists():
        assert proc.poll() is None, "the sweep ended before the first model started"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # `start` reaches the controller; the model takes seconds to analyse
    os.kill(json.loads(note.read_text())["pid"], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    record = json.loads((out / "_failures" / f"{keys[0]}.json").read_text())
    assert record["retryable"] is False and "poison model" in record["error"]
    assert "--retry-failed tries again" in record["error"]
    assert sorted(p.name for p in out.glob("_attempts/*")) == []

    again = esd_sweep(*run_args(model_list, str(out), "--max-retries", "0"))
    assert again.returncode == 0, again.stderr
    assert all_whole(out, keys)
    assert sorted(p.name for p in out.glob("_failures/*.json")) == []
