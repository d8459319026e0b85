"""The real `esd-worker` analysing many models in one process: `--models FILE` (local or s3://) and
`--serve` (the controller's protocol), resume, a model that killed its worker found from the
attempt note. Tiny local models (conftest) in subprocesses, as a pod or the controller runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.models.naming import model_key
from esd_worker.core.protocol import MODEL_BEGIN, MODEL_END, Request
from esd_worker.core.store.layout import attempt_key, failure_key, marker_key
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import LocalStore
from tests.esd_worker.test_table_writer import assert_tables_match_the_files
from tests.support.builders import worker_command
from tests.support.s3server import S3Server, serve_s3


def events(stdout: str) -> list[dict[str, Any]]:
    """The worker's events but its heartbeats (`progress`: tests/esd_worker/test_heartbeat)."""
    return [e for e in map(json.loads, filter(str.strip, stdout.splitlines()))
            if e["event"] != "progress"]


def results(stdout: str) -> dict[str, dict[str, Any]]:
    return {e["key"]: e for e in events(stdout) if e["event"] == "result"}


def run_models(models: str | Path, out: str | Path, *extra: str,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*worker_command(), "--models", str(models), "--output", str(out),
                           "--run-id", "run-b", *extra], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture(scope="module")
def model_list(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, gpt2_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("lists") / "models.csv"
    path.write_text("model_id,base_model_relation,source_model\n"
                    f"{llama_dir},base,\n{tmp_path_factory.getbasetemp()}/no-such-model,base,\n"
                    f"{gpt2_dir},base,\n")
    return path


def test_a_model_list_in_one_process_and_the_same_command_again(
    model_list: Path, tmp_path: Path
) -> None:
    rows = read_model_list(model_list).rows
    first = run_models(model_list, tmp_path)
    assert first.returncode == 3, first.stderr  # a permanent failure, recorded
    got = results(first.stdout)
    assert [got[r.key]["status"] for r in rows] == ["done", "failed", "done"]
    assert events(first.stdout)[0]["event"] == "ready"
    assert "batch: 2 done, 1 failed, 0 skipped" in first.stderr
    store = LocalStore(tmp_path)
    data = store.get_bytes(failure_key(rows[1].key))
    assert data is not None
    record = FailureRecord.from_json(data)  # the controller's schema
    assert (record.exit_code, record.retryable, record.run_id) == (3, False, "run-b")
    assert record.error.startswith("PermanentModelError: model not found")
    assert record.stderr_tail[-1].startswith("esd-worker: error: model not found")
    assert all(store.exists(marker_key(r.key)) for r in (rows[0], rows[2]))
    assert not any(store.list_keys("_attempts/"))
    # The done models' results-tables parts, written when the batch ended.
    assert "results tables: 2 model(s) written in 2 part(s)" in first.stderr
    assert_tables_match_the_files(store, [rows[0].key, rows[2].key])

    again = run_models(model_list, tmp_path, "--skip-failed")
    assert again.returncode == 0, again.stderr
    assert {e["status"] for e in results(again.stdout).values()} == {"skipped"}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_a_model_list_in_s3_and_results_to_s3(
    s3_server: S3Server, llama_dir: Path, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(
        Bucket=bucket, Key="lists/one.csv",
        Body=f"model_id\n{llama_dir}\n".encode())
    run = run_models(f"s3://{bucket}/lists/one.csv", f"s3://{bucket}/out",
                     env=s3_server.subprocess_env())
    assert run.returncode == 0, run.stderr
    key = model_key(str(llama_dir))
    assert results(run.stdout)[key]["status"] == "done"
    assert f"out/{key}/result.json" in s3_server.keys(bucket)
    missing = run_models(f"s3://{bucket}/lists/none.csv", tmp_path,
                         env=s3_server.subprocess_env())
    assert missing.returncode == 2
    assert f"model list not found: s3://{bucket}/lists/none.csv" in missing.stderr


class Served:
    """`esd-worker --serve`: requests on stdin, events on stdout, logs on stderr."""

    def __init__(self, out: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*worker_command(), "--serve", "--output", str(out), "--run-id", "run-s", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def send(self, request: Request) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(request.to_line())
        self.proc.stdin.flush()

    def next_event(self) -> dict[str, Any]:
        """The next event but heartbeats (`progress`)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, "the worker closed its output"
            doc: dict[str, Any] = json.loads(line)
            if doc["event"] != "progress":
                return doc


def test_serve_answers_each_request_and_frames_each_models_log(
    llama_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    worker = Served(tmp_path)
    assert worker.next_event()["event"] == "ready"
    for directory in (llama_dir, gpt2_dir):
        worker.send(Request(model_key(str(directory)), str(directory)))
    out, err = worker.proc.communicate(timeout=300)  # end of input: finish, then exit 0
    assert worker.proc.returncode == 0, err
    got = events(out)
    assert [(e["event"], e["key"]) for e in got] == [
        (kind, model_key(str(d))) for d in (llama_dir, gpt2_dir) for kind in ("start", "result")]
    assert all(e["status"] == "done" and e["seconds"] > 0 for e in got if e["event"] == "result")
    frames = [line for line in err.splitlines() if line.startswith((MODEL_BEGIN, MODEL_END))]
    assert len(frames) == 4
    inside = err.split(MODEL_BEGIN)[1]
    assert "layers" in inside and str(llama_dir) in inside


def test_a_model_that_killed_its_worker_is_found_by_the_next_one(
    llama_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL while the model is analysed leaves its attempt note; with --max-retries 0 the
    next worker of the same run (run-s) records it as a poison model without starting it,
    with 1 it tries again; a worker of another run starts from none."""
    key = model_key(str(llama_dir))
    worker = Served(tmp_path)
    assert worker.next_event()["event"] == "ready"
    worker.send(Request(key, str(llama_dir)))
    assert worker.next_event() == {"event": "start", "key": key}
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.communicate(timeout=60)
    store = LocalStore(tmp_path)
    note = store.get_bytes(attempt_key(key))
    assert note is not None and json.loads(note)["starts"] == 1
    assert not store.exists(marker_key(key))

    listed = tmp_path / "list.csv"
    listed.write_text(f"model_id\n{llama_dir}\n")
    poisoned = run_models(listed, tmp_path, "--max-retries", "0", "--run-id", "run-s")
    assert poisoned.returncode == 3
    result = results(poisoned.stdout)[key]
    assert (result["status"], result["retryable"]) == ("failed", False)
    assert result["error"].startswith("WorkerCrashed: 1 worker(s) died")
    assert not store.exists(marker_key(key)) and not store.exists(attempt_key(key))

    store.put_bytes(attempt_key(key), note)
    retried = run_models(listed, tmp_path, "--max-retries", "1", "--run-id", "run-s")
    assert retried.returncode == 0, retried.stderr
    assert store.exists(marker_key(key)) and not store.exists(attempt_key(key))
    assert not store.exists(failure_key(key))

    store.delete(marker_key(key))
    store.put_bytes(attempt_key(key), note)
    another_run = run_models(listed, tmp_path, "--max-retries", "0")  # run-b
    assert another_run.returncode == 0, another_run.stderr
    assert store.exists(marker_key(key)) and not store.exists(attempt_key(key))


@pytest.mark.parametrize("bad_key", ["..", "a/b", "a\u0000b", "k" * 300],
                         ids=["dotdot", "slash", "nul", "300-chars"])
def test_a_bad_request_is_refused_and_the_worker_serves_the_next(
    llama_dir: Path, tmp_path: Path, bad_key: str
) -> None:
    """A request whose key could name no store folder is one logged error line: no
    traceback, nothing written for it, and the next request is analysed by the same worker,
    which exits 0 at the end of its input."""
    out = tmp_path / "out"
    worker = Served(out)
    assert worker.next_event()["event"] == "ready"
    assert worker.proc.stdin is not None
    worker.proc.stdin.write(json.dumps({"op": "analyse", "key": bad_key,
                                        "model": str(llama_dir)}) + "\n")
    key = model_key(str(llama_dir))
    worker.send(Request(key, str(llama_dir)))
    assert worker.next_event() == {"event": "start", "key": key}
    assert worker.next_event()["status"] == "done"
    _, err = worker.proc.communicate(timeout=60)
    assert worker.proc.returncode == 0, err
    assert "Traceback" not in err and err.count("ignored a bad request line") == 1
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("_")) == [key]


def test_sigterm_stops_a_serving_worker_that_waits_for_work(tmp_path: Path) -> None:
    """Blocked on an empty inbox, it still ends at once with the stop's exit code (4)."""
    worker = Served(tmp_path)
    assert worker.next_event()["event"] == "ready"
    worker.proc.send_signal(signal.SIGTERM)
    worker.proc.communicate(timeout=60)
    assert worker.proc.returncode == 4
