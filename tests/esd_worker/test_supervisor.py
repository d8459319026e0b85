"""The shard pod's supervisor (esd_worker.serve.supervisor) driving a fake child
(tests/support/fakeworker.py: the batch's protocol and attempt note, no torch), what the
host says of memory (esd_worker.serve.hostmemory), and the poison record that names the
supervisor's cause (esd_worker.serve.batch)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.store.layout import attempt_key, failure_key
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.stores import LocalStore
from esd_worker.serve.hostmemory import container_memory_limit, group_rss, oom_kills
from esd_worker.serve.supervisor import (
    SUPERVISED_ENV,
    Supervisor,
    SupervisorSettings,
    supervised_child,
)
from tests.esd_worker.test_batch import Analyses, req, run_batch
from tests.support import REPO_ROOT

FAKE = REPO_ROOT / "tests" / "support" / "fakeworker.py"
KEY = "org--model-0123456789"
MAX_RETRIES = 1


def supervise(tmp_path: Path, scenario: str, *, sharded: bool = True,
              **settings: Any) -> tuple[int, Supervisor, list[dict[str, Any]]]:
    """Run the supervisor over the fake child playing `scenario`; (exit code, the
    supervisor, the protocol events it forwarded)."""
    out = io.BytesIO()
    options: dict[str, Any] = {
        "argv": [sys.executable, str(FAKE), str(tmp_path), KEY, scenario, str(MAX_RETRIES)],
        "max_retries": MAX_RETRIES, "model_timeout_s": 1.0, "poll_s": 0.1,
        "backoff_s": 0.05, "sharded": sharded, "keys": frozenset({KEY}), "run_id": "run-7",
    } | settings
    supervisor = Supervisor(SupervisorSettings(**options), LocalStore(tmp_path), out=out)
    code = supervisor.run()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    return code, supervisor, events


def results(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "result"]


@pytest.mark.parametrize(("scenario", "cause"), [
    ("hang", "ModelTimeout: no progress for 1 s"),
    ("sigkill", "WorkerCrashed: killed by SIGKILL while analysing org/sigkill"),
    ("sigsegv", "WorkerCrashed: killed by SIGSEGV while analysing org/sigsegv"),
    ("leak", "HostOutOfMemory: the worker passed 0.15 GiB (--memory-limit"),
    ("oom-killed", "HostOutOfMemory: the kernel's OOM killer killed the worker"),
    ("gpu-oom", "GpuOutOfMemoryError: the worker exited 5 (the GPU ran out of memory; its "
                "process could not go on) while analysing org/gpu-oom"),
], ids=["hangs-without-heartbeats", "sigkill", "sigsegv", "leaks-past-memory-limit",
        "oom-killed-by-the-kernel", "gpu-full-past-its-allocator"])
def test_a_model_that_kills_or_hangs_its_child_is_charged_until_it_is_poison(
    tmp_path: Path, scenario: str, cause: str
) -> None:
    """With --max-retries 1 the model gets two starts, each ended by the fault: the
    supervisor writes the cause into the model's attempt note and starts a new child; the
    third child finds the note past its retries and records the model as poison with that
    cause (the fake reports the note's last_error as the real batch does). A SIGKILL that
    the cgroup's memory.events counts as the kernel's OOM kill is the memory's, not a crash;
    an uncounted one (sigkill) is a crash. The pod exits 0:
    the model's crashes cost its own retries, not the pod's."""
    (tmp_path / "memory.events").write_text("oom_kill 0\n")
    code, supervisor, events = supervise(tmp_path, scenario, memory_limit=150 << 20,
                                         oom_events=tmp_path / "memory.events")
    assert code == 0
    assert supervisor.children == MAX_RETRIES + 2
    [poison] = results(events)
    assert poison["error"].startswith(cause), poison["error"]
    assert not (tmp_path / attempt_key(KEY)).exists()


def test_a_hung_childs_own_children_are_killed_with_it(tmp_path: Path) -> None:
    """The kill takes the child's process group: no grandchild is left running."""
    supervise(tmp_path, "hang")
    pid = int((tmp_path / "grandchild.pid").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_slow_model_that_keeps_beating_is_not_killed(tmp_path: Path) -> None:
    """2.4 s in all against a 1 s limit, a heartbeat every 0.2 s: slow, not hung."""
    code, supervisor, events = supervise(tmp_path, "slow")
    assert (code, supervisor.children) == (0, 1)
    assert [r["status"] for r in results(events)] == ["done"]
    assert sum(e["event"] == "progress" for e in events) == 12  # forwarded unchanged


@pytest.mark.parametrize(("scenario", "sharded", "code", "children"), [
    ("device", True, 6, 1),
    ("idle-kill", True, 128 + signal.SIGKILL, 1),
    ("transient", True, 0, MAX_RETRIES + 1),
    ("transient", False, 4, MAX_RETRIES + 1),
], ids=["device-fault-exits-6-at-once", "killed-between-models-is-the-pods-fault",
        "shard-keeps-retryable-records-after-its-rounds", "models-keeps-exit-4"])
def test_exits_that_are_not_a_models(tmp_path: Path, scenario: str, sharded: bool, code: int,
                                     children: int) -> None:
    """A device fault or a death with no model in progress is the pod's or node's: its code
    at once, no restart. A transient exit runs --max-retries more rounds; then a shard whose
    every model had an outcome is complete (0), a --models batch keeps 4."""
    got, supervisor, _ = supervise(tmp_path, scenario, sharded=sharded)
    assert (got, supervisor.children) == (code, children)


def test_a_stop_is_passed_to_the_child_and_charges_nothing(tmp_path: Path) -> None:
    """SIGTERM to the supervisor: the child gets SIGTERM, clears the note (a stop is not the
    model's fault) and the supervisor exits 4."""
    note = tmp_path / attempt_key(KEY)

    def stop_once_started() -> None:
        deadline = time.monotonic() + 10
        while not note.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started, daemon=True).start()
    code, supervisor, _ = supervise(tmp_path, "stop")
    assert (code, supervisor.children) == (4, 1)
    assert not note.exists()


@pytest.mark.parametrize(("content", "limit"), [
    ("max\n", None),
    ("2147483648\n", 2147483648),
    ("9223372036854771712\n", None),  # cgroup v1's "unlimited"
    (None, None),  # no file: not in a container
], ids=["v2-max", "two-gib", "v1-unlimited", "no-cgroup"])
def test_the_containers_memory_limit(tmp_path: Path, content: str | None,
                                     limit: int | None) -> None:
    path = tmp_path / "memory.max"
    if content is not None:
        path.write_text(content)
    assert container_memory_limit([path, tmp_path / "absent"]) == limit


@pytest.mark.parametrize(("content", "kills"), [
    ("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n", 2),
    ("oom_kill many\n", None),
    (None, None),  # cgroup v1, or not in a container
], ids=["v2-events", "not-a-number", "no-file"])
def test_the_kernels_oom_kills(tmp_path: Path, content: str | None, kills: int | None) -> None:
    path = tmp_path / "memory.events"
    if content is not None:
        path.write_text(content)
    assert oom_kills(path) == kills


def test_group_rss_counts_the_group_of_a_process() -> None:
    sleeper = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        assert group_rss(sleeper.pid) > 0
        assert group_rss(2**22 + 7) == 0  # no such group
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(("environ", "number"), [
    ({}, 0), ({SUPERVISED_ENV: "3"}, 3), ({SUPERVISED_ENV: "yes"}, 0),
], ids=["not-supervised", "third-child", "not-a-number"])
def test_supervised_child(environ: dict[str, str], number: int) -> None:
    assert supervised_child(environ) == number


# -- the poison record names the supervisor's cause (esd_worker.serve.batch) -----------------


@pytest.mark.parametrize(("last_error", "error"), [
    ("ModelTimeout: no progress for 5 s (0 heartbeat(s) before): killed as hung",
     "ModelTimeout: no progress for 5 s (0 heartbeat(s) before): killed as hung; 2 "
     "attempt(s) ended without an outcome: a poison model, not tried again"),
    ("HostOutOfMemory: the worker passed 1.00 GiB analysing p: killed",
     "HostOutOfMemory: the worker passed 1.00 GiB analysing p: killed; 2 attempt(s)"),
    ("WorkerCrashed: killed by SIGSEGV while analysing p",
     "WorkerCrashed: killed by SIGSEGV while analysing p; 2 attempt(s)"),
    (None, "WorkerCrashed: 2 worker(s) died analysing p"),
    ("not a cause", "WorkerCrashed: 2 worker(s) died analysing p"),
    (["ModelTimeout: x"], "WorkerCrashed: 2 worker(s) died analysing p"),
], ids=["timeout", "memory", "segfault", "no-cause", "not-a-cause", "not-text"])
def test_the_poison_record_names_the_last_cause_in_the_note(
    tmp_path: Path, last_error: object, error: str
) -> None:
    """The supervisor wrote why the last attempt ended into the note: the record's error (and
    so its class) is that cause; a note without one (a worker that died unsupervised) or
    with a cause that is not one keeps the generic WorkerCrashed."""
    store = LocalStore(tmp_path)
    note: dict[str, Any] = {"model": "p", "starts": 2, "run_id": "run-7"}
    if last_error is not None:
        note["last_error"] = last_error
    store.put_bytes(attempt_key("key-p"), json.dumps(note).encode())
    analyses = Analyses({})
    run_batch(store, analyses, [req("p")], max_retries=1)
    assert analyses.calls == []
    data = store.get_bytes(failure_key("key-p"))
    assert data is not None
    record = FailureRecord.from_json(data)
    assert record.error.startswith(error), record.error
    assert (record.attempts, record.retryable) == (2, False)
    assert not store.exists(attempt_key("key-p"))
