"""`esd-worker --shards URL`: one pod of a sharded Kubernetes run (an Indexed Job) takes shard N
of a shard folder, N from --shard-index or JOB_COMPLETION_INDEX, and leaves every model's
outcome in the store. The real worker in subprocesses, as a pod runs it; tiny local models
(conftest), the hub double (tests/support/hubserver.py) for a failure a retry may fix, moto's
server for S3.

The exit codes are a contract with the controller's podFailurePolicy (esd_worker.serve.runner): 0
the index is complete (a permanent failure's record is its outcome), 4 retry the index, 2 the
shard cannot run (FailIndex).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import failure_key, marker_key, shard_key, shard_prefix
from esd_worker.core.store.progressdoc import EXITED, ShardProgressDoc
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import LocalStore
from tests.support import REPO_ROOT
from tests.support.builders import worker_command
from tests.support.hubserver import HubServer
from tests.support.s3server import S3Server, serve_s3

INDEX_ENV = "JOB_COMPLETION_INDEX"
FLAKY = "esd-test/flaky"  # a hub model whose model-info call fails with 503 while faulted


def write_shards(folder: Path, *shards: Sequence[str]) -> Path:
    """Shard i of `folder` lists shards[i]'s model references (a model-list CSV)."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, refs in enumerate(shards):
        (folder / f"{index}.csv").write_text("model_id\n" + "".join(f"{r}\n" for r in refs))
    return folder


def run_shard(folder: str | Path, out: str | Path, *extra: str, index_env: str | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The worker on `folder` with JOB_COMPLETION_INDEX=index_env (unset when None); this
    checkout's esd_worker, whichever checkout the console script was installed from."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != INDEX_ENV}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if index_env is not None:
        env[INDEX_ENV] = index_env
    return subprocess.run([*worker_command(), "--shards", str(folder), "--output", str(out),
                           "--device", "cpu", "--run-id", "run-k", *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def statuses(stdout: str) -> dict[str, str]:
    events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return {e["key"]: e["status"] for e in events if e["event"] == "result"}


def snapshot(store: LocalStore, keys: Sequence[str]) -> dict[str, tuple[bytes | None, int]]:
    """Bytes and modification time of each key: a file rewritten with the same bytes shows."""
    return {key: (store.get_bytes(key), os.stat(store.root / key).st_mtime_ns) for key in keys}


@pytest.mark.parametrize(("index_env", "flag", "taken"), [
    pytest.param("1", None, 1, id="from-JOB_COMPLETION_INDEX"),
    pytest.param("1", "0", 0, id="flag-overrides-env"),
])
def test_the_index_picks_the_shard(llama_dir: Path, gpt2_dir: Path, tmp_path: Path,
                                   index_env: str, flag: str | None, taken: int) -> None:
    """Two shards of one model each: only the models of the shard taken get a marker."""
    shards = [[str(llama_dir)], [str(gpt2_dir)]]
    folder = write_shards(tmp_path / "shards", *shards)
    run = run_shard(folder, tmp_path / "out", *(("--shard-index", flag) if flag else ()),
                    index_env=index_env)
    assert run.returncode == 0, run.stderr
    assert f"shard {taken} of {folder}: 1 model(s)" in run.stderr
    store = LocalStore(tmp_path / "out")
    for index, refs in enumerate(shards):
        for ref in refs:
            assert store.exists(marker_key(model_key(ref))) is (index == taken), ref
    assert statuses(run.stdout) == {model_key(shards[taken][0]): "done"}
    # The pod's supervisor left the shard's progress document next to its list, final.
    doc = ShardProgressDoc.from_json((folder / f"{taken}.progress.json").read_bytes())
    assert (doc.index, doc.class_name, doc.models, doc.done, doc.state, doc.exit_code) == (
        taken, "shards", 1, 1, EXITED, 0)
    assert doc.device_busy_s > 0 and doc.in_progress is None
    assert not (folder / f"{1 - taken}.progress.json").exists()


@pytest.mark.parametrize(("argv", "index_env", "fragments"), [
    pytest.param([], None, ["no shard index for {folder}", INDEX_ENV], id="no-index"),
    pytest.param([], "", ["no shard index for {folder}"], id="empty-env"),
    pytest.param([], "x", ["shard index 'x' (JOB_COMPLETION_INDEX) of {folder}",
                           "whole number >= 0"], id="env-not-a-number"),
    # The flag's value is argparse's to check (esd_worker.core.command.flags.Number), naming the
    # flag.
    pytest.param(["--shard-index", "-1"], "0", ["--shard-index", "whole number", "'-1'"],
                 id="negative-flag"),
    pytest.param(["--shard-index", "1.0"], None, ["--shard-index", "whole number", "'1.0'"],
                 id="not-whole"),
    pytest.param(["--shard-index", "2"], None, ["shard 2 of {folder} cannot run",
                                                "model list not found: {folder}/2.csv"],
                 id="no-such-shard"),
    pytest.param([], "1", ["shard 1 of {folder} cannot run", "no model_id or full_name"],
                 id="not-a-model-list"),
])
def test_a_shard_that_cannot_run_is_a_usage_error(
    llama_dir: Path, tmp_path: Path, argv: list[str], index_env: str | None,
    fragments: list[str]
) -> None:
    """Exit 2 (the controller's FailIndex), one line naming the folder and the index (a bad
    --shard-index value: the flag and the value), no
    traceback, nothing analysed or written."""
    folder = write_shards(tmp_path / "shards", [str(llama_dir)])
    (folder / "1.csv").write_text("name,size\nx,1\n")
    run = run_shard(folder, tmp_path / "out", *argv, index_env=index_env)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("esd-worker: error:")]
    assert len(errors) == 1, run.stderr
    for fragment in fragments:
        assert fragment.format(folder=folder) in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def test_shard_index_without_shards_is_a_usage_error(llama_dir: Path, tmp_path: Path) -> None:
    listed = tmp_path / "models.csv"
    listed.write_text(f"model_id\n{llama_dir}\n")
    run = subprocess.run([*worker_command(), "--models", str(listed), "--output",
                          str(tmp_path / "out"), "--shard-index", "0"],
                         capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 2 and "--shard-index goes with --shards" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_permanent_failure_completes_the_shard_and_is_not_retried(
    llama_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    """A model that cannot be analysed (no such directory) gets its failure record and the
    shard exits 0 (where --models exits 3): Kubernetes must not retry the index. A second pod
    on the same shard skips the done models and the failed one: nothing is rewritten."""
    refs = [str(llama_dir), str(tmp_path / "no-such-model"), str(gpt2_dir)]
    keys = [model_key(ref) for ref in refs]
    folder = write_shards(tmp_path / "shards", refs)
    first = run_shard(folder, tmp_path / "out", index_env="0")
    assert first.returncode == 0, first.stderr
    assert statuses(first.stdout) == dict(zip(keys, ["done", "failed", "done"], strict=True))
    store = LocalStore(tmp_path / "out")
    data = store.get_bytes(failure_key(keys[1]))
    assert data is not None
    record = FailureRecord.from_json(data)
    assert (record.exit_code, record.retryable, record.run_id) == (3, False, "run-k")
    assert record.error.startswith("PermanentModelError: model not found")
    assert not any(store.list_keys("_attempts/"))

    written = [marker_key(keys[0]), failure_key(keys[1]), marker_key(keys[2])]
    before = snapshot(store, written)
    again = run_shard(folder, tmp_path / "out", index_env="0")  # the same run: a pod retry
    assert again.returncode == 0, again.stderr
    assert statuses(again.stdout) == dict.fromkeys(keys, "skipped")
    assert "permanent failure record" in again.stderr
    assert snapshot(store, written) == before
    # A later run tries the model again (as `esd-sweep run` does by default); --skip-failed
    # skips records of any run.
    later = run_shard(folder, tmp_path / "out", "--run-id", "run-l", index_env="0")
    assert later.returncode == 0, later.stderr
    assert statuses(later.stdout)[keys[1]] == "failed"
    record = FailureRecord.from_json(store.get_bytes(failure_key(keys[1])) or b"")
    assert record.run_id == "run-l"
    skipped = run_shard(folder, tmp_path / "out", "--run-id", "run-m", "--skip-failed",
                        index_env="0")
    assert statuses(skipped.stdout)[keys[1]] == "skipped"


@pytest.fixture
def hub(llama_dir: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo(FLAKY, llama_dir)
        yield server


def test_a_failure_a_retry_may_fix_is_retried_in_the_pod_and_kept_as_its_outcome(
    hub: HubServer, gpt2_dir: Path, tmp_path: Path
) -> None:
    """The hub answers 503 to FLAKY's model info (no retries in the worker: ESD_HUB_RETRIES=0):
    its record says retryable. The pod's supervisor runs the batch again --max-retries (1)
    more time, skipping what is done; the hub still down, the pod exits 0 with the retryable
    record as FLAKY's outcome (the index is complete: one flaky model must not spend the
    shard's backoffLimitPerIndex). The next run, the hub back, analyses only FLAKY and clears
    its record."""
    hub.fail(FLAKY, 503, times=None, on="api")
    refs = [str(gpt2_dir), FLAKY]
    local, flaky = (model_key(ref) for ref in refs)
    folder = write_shards(tmp_path / "shards", refs)
    env = hub.env(tmp_path / "hf") | {"ESD_HUB_RETRIES": "0"}
    first = run_shard(folder, tmp_path / "out", "--max-retries", "1", index_env="0", env=env)
    assert first.returncode == 0, first.stderr
    rounds = [json.loads(line) for line in first.stdout.splitlines() if line.strip()]
    assert [(e["key"], e["status"]) for e in rounds if e["event"] == "result"] == [
        (local, "done"), (flaky, "failed"), (local, "skipped"), (flaky, "failed")]
    store = LocalStore(tmp_path / "out")
    data = store.get_bytes(failure_key(flaky))
    assert data is not None
    record = FailureRecord.from_json(data)
    assert (record.retryable, record.exit_code) == (True, 4) and "HTTP 503" in record.error

    hub.clear_faults()
    kept = snapshot(store, [marker_key(local)])
    retried = run_shard(folder, tmp_path / "out", index_env="0", env=env)
    assert retried.returncode == 0, retried.stderr
    assert statuses(retried.stdout) == {local: "skipped", flaky: "done"}
    assert store.exists(marker_key(flaky)) and not store.exists(failure_key(flaky))
    assert snapshot(store, [marker_key(local)]) == kept


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_shards_and_results_in_s3(s3_server: S3Server, llama_dir: Path, gpt2_dir: Path) -> None:
    """The layout's shard keys under an s3:// output, as the controller writes them: the
    pod reads its shard from S3 and writes its results there; a missing shard is exit 2."""
    bucket = s3_server.new_bucket()
    output = f"s3://{bucket}/out"
    for index, ref in enumerate([llama_dir, gpt2_dir]):
        key = "out/" + shard_key("run-1", "gpu", index)
        s3_server.client().put_object(Bucket=bucket, Key=key, Body=f"model_id\n{ref}\n".encode())
    folder = f"{output}/{shard_prefix('run-1', 'gpu')}"
    run = run_shard(folder, output, index_env="1", env=s3_server.subprocess_env())
    assert run.returncode == 0, run.stderr
    keys = s3_server.keys(bucket, "out/")
    assert f"out/{marker_key(model_key(str(gpt2_dir)))}" in keys
    assert f"out/{marker_key(model_key(str(llama_dir)))}" not in keys
    missing = run_shard(folder, output, index_env="2", env=s3_server.subprocess_env())
    assert missing.returncode == 2, missing.stderr
    assert f"model list not found: {folder.rstrip('/')}/2.csv" in missing.stderr
