"""A shard pod's progress document (esd_worker.serve.shardprogress): its counts follow the
children's protocol lines, it is written at start, after outcomes (throttled) and at exit,
its counts survive a child's crash (the supervisor holds them), and a store that refuses it
costs the shard nothing."""

from __future__ import annotations

import io
import json
import logging
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.protocol import Result, event_line, progress_line
from esd_worker.core.store.layout import shard_progress_name, write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.progressdoc import EXITED, RUNNING, ShardProgressDoc
from esd_worker.core.store.stores import LocalStore
from esd_worker.serve.shardprogress import ShardProgress, shard_progress
from esd_worker.serve.supervisor import Supervisor, SupervisorSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingStore(LocalStore):
    """A folder store that keeps every document written to it, in order."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.written: list[dict[str, Any]] = []

    def put_bytes(self, key: str, data: bytes) -> None:
        super().put_bytes(key, data)
        self.written.append(json.loads(data))


def event(line: str) -> dict[str, Any]:
    return dict(json.loads(line))


def result(key: str, status: str) -> dict[str, Any]:
    return event(Result(key, status, 0 if status != "failed" else 3).to_line())


def progress_for(tmp_path: Path, clock: Clock, *, results: LocalStore | None = None,
                 models: int = 3) -> tuple[ShardProgress, RecordingStore]:
    target = RecordingStore(tmp_path / "shards")
    doc = ShardProgressDoc(run_id="run-1", class_name="gpu-small", index=4, node="node-a",
                           pod="pod-4", models=models)
    return ShardProgress(target, shard_progress_name(4), doc, results=results,
                         clock=clock), target


def test_the_document_after_each_outcome(tmp_path: Path) -> None:
    """Written at start; an outcome 15 s after the last write goes at once; a done model's
    device time is its marker's discover_s + analyse_s, a failed one's from its first
    layer to its result; bytes are each model's size once."""
    clock = Clock()
    results = LocalStore(tmp_path / "out")
    marker = Marker(model="org/a", model_key="a", parameters={}, summary={})
    write_model_result(results, marker, layers=b"layer\n", finish=lambda m: replace(
        m, timings={"resolve_s": 50.0, "discover_s": 1.5, "analyse_s": 8.0}))
    progress, target = progress_for(tmp_path, clock, results=results)
    progress.start()
    assert target.written[-1] | {"updated_at": "", "started_at": ""} == {
        "schema": 1, "run_id": "run-1", "class": "gpu-small", "index": 4, "node": "node-a",
        "pod": "pod-4", "models": 3, "done": 0, "failed": 0, "skipped": 0,
        "in_progress": None, "bytes_downloaded": 0, "device_busy_s": 0.0, "worker_s": 0.0,
        "started_at": "", "updated_at": "", "state": RUNNING, "exit_code": None}
    steps: list[tuple[float, str | dict[str, Any], dict[str, Any]]] = [
        (20.0, event_line("start", key="a"), {}),  # no outcome: not written yet
        (21.0, progress_line("a", layers=0, size_bytes=1000), {}),
        (22.0, progress_line("a", layers=1, size_bytes=1000), {}),
        (30.0, result("a", "done"), {"done": 1, "in_progress": None, "bytes_downloaded": 1000,
                                     "device_busy_s": 9.5, "worker_s": 30.0}),
        (31.0, event_line("start", key="b"), {}),
        (32.0, progress_line("b", layers=2, size_bytes=500), {}),
        (34.0, result("b", "failed"), {}),  # 4 s after the last write: held back
        (46.0, result("c", "skipped"), {"done": 1, "failed": 1, "skipped": 1,
                                        "bytes_downloaded": 1500, "device_busy_s": 11.5}),
    ]
    for at, line, expected in steps:
        writes = len(target.written)
        clock.now = 100.0 + at
        progress.follow(event(line) if isinstance(line, str) else line)
        if expected:
            assert len(target.written) == writes + 1, at
            assert expected.items() <= target.written[-1].items(), at
        else:
            assert len(target.written) == writes, at
    progress.finish(0)
    assert {"state": EXITED, "exit_code": 0, "done": 1, "failed": 1,
            "skipped": 1}.items() <= target.written[-1].items()
    assert ShardProgressDoc.from_json((tmp_path / "shards" / "4.progress.json").read_bytes()
                                      ) == ShardProgressDoc.from_json(
        json.dumps(target.written[-1]).encode())


@pytest.mark.parametrize(("ticks", "writes"), [
    ([1.0, 5.0, 14.9], 1),  # throttled: only the start's
    ([1.0, 15.0], 2),  # the held-back outcome, once 15 s have passed
    ([15.0, 16.0, 40.0], 2),  # nothing new after it: no more writes
], ids=["within-15s", "after-15s", "nothing-new"])
def test_outcomes_are_written_at_most_every_15_s(tmp_path: Path, ticks: list[float],
                                                 writes: int) -> None:
    clock = Clock()
    progress, target = progress_for(tmp_path, clock)
    progress.start()
    clock.now += 0.5
    progress.follow(result("a", "done"))
    for at in ticks:
        clock.now = 100.0 + at
        progress.tick()
    assert len(target.written) == writes
    if writes > 1:
        assert target.written[-1]["done"] == 1


def test_a_store_that_refuses_the_document_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a folder")
    doc = ShardProgressDoc(run_id="run-1", class_name="gpu", index=0)
    progress = ShardProgress(LocalStore(tmp_path / "file" / "shards"), "0.progress.json", doc,
                             every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="esd_worker"):
        progress.start()
        progress.follow(result("a", "done"))
        progress.finish(0)
    assert progress.writes == 0
    assert len(caplog.records) == 1 and "logged once" in caplog.records[0].getMessage()


def test_the_shards_document_goes_next_to_its_list(tmp_path: Path) -> None:
    folder = tmp_path / "out" / "_shards" / "run-9" / "gpu-x2"
    progress = shard_progress(str(folder), 7, run_id="run-9", keys=frozenset({"a", "b"}),
                              results=LocalStore(tmp_path / "out"),
                              environ={"NODE_NAME": "gpu-node-3", "HOSTNAME": "esd-7-xyz"})
    assert progress is not None
    progress.start()
    doc = ShardProgressDoc.from_json((folder / "7.progress.json").read_bytes())
    assert (doc.run_id, doc.class_name, doc.index, doc.node, doc.pod, doc.models) == (
        "run-9", "gpu-x2", 7, "gpu-node-3", "esd-7-xyz", 2)


# A supervised child over three models: the first child finishes a, then is killed by
# SIGKILL analysing b; the second skips a (done before), finishes b, fails c.
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    state = Path(sys.argv[1])
    run = int(state.read_text()) + 1 if state.exists() else 1
    state.write_text(str(run))
    def emit(**e):
        print(json.dumps(e), flush=True)
    def result(key, status):
        emit(event="result", key=key, status=status, exit_code=3 if status == "failed"
             else 0, error="", retryable=False, seconds=0.1)
    emit(event="ready", pid=os.getpid())
    if run == 1:
        emit(event="start", key="a")
        emit(event="progress", key="a", layers=1, bytes=1000)
        result("a", "done")
        emit(event="start", key="b")
        emit(event="progress", key="b", layers=0, bytes=500)
        os.kill(os.getpid(), signal.SIGKILL)
    result("a", "skipped")
    emit(event="start", key="b")
    emit(event="progress", key="b", layers=1, bytes=500)
    result("b", "done")
    emit(event="start", key="c")
    result("c", "failed")
""")


def test_counts_go_on_after_a_child_crash(tmp_path: Path) -> None:
    """The parent holds the counts: the second child's skip of `a` (done by the first) does
    not turn it into a skip, and the crash under `b` loses nothing."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    store = LocalStore(tmp_path / "out")
    target = RecordingStore(tmp_path / "out" / "_shards" / "run-1" / "gpu")
    doc = ShardProgressDoc(run_id="run-1", class_name="gpu", index=0, models=3)
    progress = ShardProgress(target, "0.progress.json", doc, results=store, every_s=0.0)
    settings = SupervisorSettings(
        argv=[sys.executable, str(script), str(tmp_path / "state")], max_retries=1,
        poll_s=0.05, backoff_s=0.01, sharded=True, keys=frozenset("abc"), run_id="run-1")
    supervisor = Supervisor(settings, store, out=io.BytesIO(), progress=progress)
    assert supervisor.run() == 0
    assert supervisor.children == 2
    counts = [(d["done"], d["failed"], d["skipped"], d["in_progress"], d["state"])
              for d in target.written]
    assert counts[0] == (0, 0, 0, None, RUNNING)  # at start
    assert (1, 0, 0, None, RUNNING) in counts  # a done, before the crash
    assert counts[-1] == (2, 1, 0, None, EXITED)
    assert target.written[-1]["exit_code"] == 0
    assert target.written[-1]["bytes_downloaded"] == 1500
    assert all(d["skipped"] == 0 for d in target.written)
