"""A shard pod with bad models (issue 29): crash-prone, hanging and leaking models cost their
own retries only, the pod finishes every other model in one run and exits 0. The real
`esd-worker --shards` in a subprocess, as a pod runs it, with the faults injected by a
test-only sitecustomize (tests/support/faultinject) by the model folder's name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import failure_key
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import LocalStore
from tests.controller.test_sweep import write_model_list
from tests.faults.conftest import ENV, all_whole
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

INJECTOR = REPO_ROOT / "tests" / "support" / "faultinject"
MAX_RETRIES = 1
# Each bad model, by its folder's name (the injector's rule), and the cause it is recorded with.
BAD = {
    "crash-sigkill-0": "WorkerCrashed: killed by SIGKILL while analysing ",
    "crash-sigsegv-1": "WorkerCrashed: killed by SIGSEGV while analysing ",
    "crash-sigkill-2": "WorkerCrashed: killed by SIGKILL while analysing ",
    "hang-0": "ModelTimeout: no progress for ",
    "leak-0": "HostOutOfMemory: the worker passed 1.50 GiB (--memory-limit",
}


def _left_running(marker: str) -> list[int]:
    """Processes whose command line names `marker` (this test's output folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_a_shard_with_crashing_hanging_and_leaking_models_finishes_the_rest_in_one_run(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """3 crash-prone models (SIGKILL, SIGSEGV), 1 that hangs and 1 that leaks memory among 3
    good ones, --max-retries 1: the pod's supervisor kills the hang after --model-timeout
    5 s without progress and the leak past --memory-limit, charges each crash, hang and leak
    to its model's attempt note, and restarts the worker. Each bad model is recorded after
    its 2 attempts with the cause of its last one (not retryable); every good model is done
    exactly once; the pod exits 0 in one run, no attempt note and no process left behind."""
    bad = {name: shutil.copytree(tiny_models[0], tmp_path / "models" / name) for name in BAD}
    good = list(tiny_models)
    order = [good[0], bad["crash-sigkill-0"], good[1], bad["hang-0"], bad["crash-sigsegv-1"],
             bad["leak-0"], good[2], bad["crash-sigkill-2"]]
    folder = tmp_path / "shards" / "cpu"
    folder.mkdir(parents=True)
    write_model_list(folder / "0.csv", [(str(p), "", "") for p in order])
    out = tmp_path / "results"
    env = os.environ | ENV | {
        "PYTHONPATH": os.pathsep.join([str(INJECTOR), str(REPO_ROOT),
                                       os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "esd_worker.cli", "--shards", str(folder), "--shard-index", "0",
         "--output-dir", str(out), "--device", "cpu", "--max-retries", str(MAX_RETRIES),
         "--model-timeout", "5", "--memory-limit", str(3 << 29), "--run-id", "run-29"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    seconds = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-3000:]

    good_keys = [model_key(str(p)) for p in good]
    assert all_whole(out, good_keys)
    events = [json.loads(line) for line in run.stdout.splitlines()]
    done = [e["key"] for e in events if e["event"] == "result" and e["status"] == "done"]
    assert sorted(done) == sorted(good_keys)  # each exactly once, whatever the restarts

    store = LocalStore(out)
    for name, cause in BAD.items():
        data = store.get_bytes(failure_key(model_key(str(bad[name]))))
        assert data is not None, name
        record = FailureRecord.from_json(data)
        assert record.error.startswith(cause), (name, record.error)
        assert (record.attempts, record.retryable, record.run_id) == (
            MAX_RETRIES + 1, False, "run-29"), name
    assert not list((out / "_attempts").glob("*"))
    assert _left_running(str(out)) == []
    assert seconds < 150, f"{seconds:.0f} s"


def test_models_under_the_supervisor_skip_what_failed_for_good_after_a_restart(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """`esd-worker --models` is supervised too. A corrupt model fails for good, then a
    crash-prone one kills the worker (--max-retries 0): the new worker skips the corrupt one
    (its record of this run is its outcome: not analysed twice), records the crash-prone one
    as poison with its cause, and analyses the rest; the exit stays --models' 3 (some models
    failed for good)."""
    corrupt = tmp_path / "models" / "corrupt"
    corrupt.mkdir(parents=True)
    (corrupt / "config.json").write_text('{"model_type": "gpt2"}')
    (corrupt / "model.safetensors").write_text("not a safetensors file")
    crash = shutil.copytree(tiny_models[0], tmp_path / "models" / "crash-sigkill-9")
    listed = write_model_list(tmp_path / "models.csv", [
        (str(p), "", "") for p in (corrupt, crash, tiny_models[1])])
    out = tmp_path / "results"
    env = os.environ | ENV | {
        "PYTHONPATH": os.pathsep.join([str(INJECTOR), str(REPO_ROOT),
                                       os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "esd_worker.cli", "--models", str(listed), "--output-dir",
         str(out), "--device", "cpu", "--max-retries", "0", "--run-id", "run-29"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    results: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        event = json.loads(line)
        if event["event"] == "result":
            results.setdefault(event["key"], []).append(event["status"])
    keys = [model_key(str(p)) for p in (corrupt, crash, tiny_models[1])]
    assert results[keys[0]] == ["failed", "skipped"]
    assert results[keys[1]] == ["failed"]  # poison: by the second worker, not started
    assert results[keys[2]] == ["done"]
    data = LocalStore(out).get_bytes(failure_key(keys[1]))
    assert data is not None
    assert FailureRecord.from_json(data).error.startswith(
        "WorkerCrashed: killed by SIGKILL while analysing ")
    assert _left_running(str(out)) == []


def test_a_stopped_pod_passes_the_stop_to_its_worker_and_charges_no_model(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """SIGTERM to the pod's process (Kubernetes stops PID 1 only) while a model runs: the
    supervisor passes it to its worker, whose stop clears the model's attempt note (a stop is
    not the model's fault), and exits 4 at once; no failure record, no process left."""
    hang = shutil.copytree(tiny_models[0], tmp_path / "models" / "hang-1")
    folder = tmp_path / "shards" / "cpu"
    folder.mkdir(parents=True)
    write_model_list(folder / "0.csv", [(str(hang), "", "")])
    out = tmp_path / "results"
    note = out / "_attempts" / f"{model_key(str(hang))}.json"
    env = os.environ | ENV | {
        "PYTHONPATH": os.pathsep.join([str(INJECTOR), str(REPO_ROOT),
                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "esd_worker.cli", "--shards", str(folder), "--shard-index", "0",
         "--output-dir", str(out), "--device", "cpu", "--run-id", "run-29"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    deadline = time.monotonic() + 120
    while not note.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # inside the analysis, hanging
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, stderr[-3000:]
    assert not note.exists()
    assert not (out / "_failures").exists() or not list((out / "_failures").iterdir())
    assert _left_running(str(out)) == []
