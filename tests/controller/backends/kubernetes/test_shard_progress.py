"""Per-model progress of a sharded run (controller.backends.kubernetes.sharded.progress): the
running shards' progress documents, written by the worker's own writer
(esd_worker.serve.shardprogress), read back from a folder store and from S3 (moto's server
over HTTP) with bounded GETs and no listing, added up with the Job's status; and end to end
through the simulated cluster, the pods' supervisors keeping their documents."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from controller.backends.base import Task
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.sharded.progress import ShardProgressReader
from controller.backends.kubernetes.sharded.status import IndexedRun
from controller.progress import ClassProgress, Progress
from esd_worker.core.protocol import Result, event_line
from esd_worker.core.store.layout import shard_progress_key, shard_progress_name
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.progressdoc import ShardProgressDoc
from esd_worker.core.store.stores import Store
from esd_worker.serve.shardprogress import ShardProgress
from tests.controller.backends.kubernetes.test_sharded import backend_for, rows
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim
from tests.support.s3server import S3Server, serve_s3
from tests.support.shardworker import ShardWorker

RUN = "20261201T000000Z-cccccc"
CLASS = "gpu-small"
JOB = "esd-gpu-small-cccccc"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=["folder", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "folder":
        yield open_store(str(tmp_path / "out"))
        return
    server: S3Server = request.getfixturevalue("s3_server")
    yield open_store(server.url(server.new_bucket(), "results"))


def job(completions: int, *, completed: str = "", failed: str = "", active: int = 0,
        ready: int = 0, name: str = JOB, run_id: str = RUN) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"esd-sweep/run": run_id,
                                                  "esd-sweep/shard-class": CLASS}},
            "spec": {"completions": completions},
            "status": {"completedIndexes": completed, "failedIndexes": failed,
                       "active": active, "ready": ready}}


def indexed_run(per_shard: Sequence[int], **status: Any) -> IndexedRun:
    run = IndexedRun.from_job(job(len(per_shard), **status), per_shard=per_shard)
    assert (run.run_id, run.class_name) == (RUN, CLASS)
    return run


def write_doc(store: Store, index: int, outcomes: Sequence[str], *, models: int,
              in_progress: str | None = None, exited: bool = False,
              size: int = 1000) -> None:
    """Shard `index`'s document as its pod's supervisor writes it, from protocol lines."""
    doc = ShardProgressDoc(run_id=RUN, class_name=CLASS, index=index, models=models)
    writer = ShardProgress(store, shard_progress_key(RUN, CLASS, index), doc, every_s=0.0)
    writer.start()
    for n, status in enumerate(outcomes):
        key = f"m{index}-{n}"
        writer.follow({"event": "progress", "key": key, "layers": 0, "bytes": size})
        writer.follow(json_of(Result(key, status, 0 if status != "failed" else 3).to_line()))
    if in_progress is not None:
        writer.follow(json_of(event_line("start", key=in_progress)))
        writer.tick()
    if exited:
        writer.finish(0)


def json_of(line: str) -> dict[str, Any]:
    import json

    return dict(json.loads(line))


def test_running_shards_are_counted_per_model(any_store: Store) -> None:
    """Shard 0 completed (its final document: 2 done, 1 failed for good), 1 and 2 run (the
    Job's 2 active pods: the lowest unfinished indexes), 5 failed (1 done before its pods
    gave up), 3 and 4 wait: their documents are never asked for."""
    store = any_store
    write_doc(store, 0, ["done", "done", "failed"], models=3, exited=True)
    write_doc(store, 1, ["done"], models=3, in_progress="m1-1")
    write_doc(store, 2, ["failed", "skipped"], models=3)
    write_doc(store, 5, ["done"], models=2)
    write_doc(store, 4, ["done", "done"], models=2)  # not running: not read
    run = indexed_run([3, 3, 3, 3, 2, 2], completed="0", failed="5", active=2, ready=2)
    assert run.models_running == 5  # before: the estimate (ready × models / shards)
    reader = ShardProgressReader(store)
    [cls] = reader.poll([run], now=0.0)
    assert cls.done == 2 + 1 + 1 + 1 and cls.failed == 1 + 1 + 1 and cls.running == 1
    assert (run.models_done, run.models_failed, run.models_running) == (5, 3, 1)
    assert cls == ClassProgress(
        name=CLASS, models=16, done=5, failed=3, running=1, shards=6, shards_done=1,
        shards_failed=1, shards_running=2, bytes_downloaded=3000 + 1000 + 2000 + 1000,
        device_busy_s=0.0, worker_s=cls.worker_s)
    assert reader.gets == 4  # 1 and 2 running; 0 and 5 finished, read once


def test_no_listing_and_a_bounded_number_of_gets_on_s3(s3_server: S3Server) -> None:
    """200 running shards, 64 GETs a read at most: all refreshed within 4 reads, round
    robin; not one LIST request."""
    store = open_store(s3_server.url(s3_server.new_bucket(), "results"))
    for index in range(200):
        write_doc(store, index, ["done"] * (index % 3), models=3, in_progress=f"k{index}")
    run = indexed_run([3] * 250, active=200, ready=200)
    reader = ShardProgressReader(store, max_gets=64)
    before = len(s3_server.requests)
    counted = []
    for now in (0.0, 30.0, 60.0, 90.0):
        reader.poll([run], now)
        counted.append(run.models_done)
    sent = s3_server.requests[before:]
    assert not [r for r in sent if r[0] == "GET" and "list-type" in r[2]]
    assert len(sent) == reader.gets == 64 * 4  # the 4th: 192-199, then 0-55 again
    assert counted[-1] == sum(index % 3 for index in range(200))
    assert counted == sorted(counted) and counted[0] < counted[-1]
    assert run.models_running == 200


def test_reads_only_every_30_s(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    write_doc(store, 0, ["done"], models=2, in_progress="m0-1")
    run = indexed_run([2], active=1, ready=1)
    reader = ShardProgressReader(store)
    reader.poll([run], 0.0)
    write_doc(store, 0, ["done", "done"], models=2)
    reader.poll([run], 29.0)
    assert (reader.gets, run.models_done) == (1, 1)
    reader.poll([run], 30.0)
    assert (reader.gets, run.models_done, run.models_running) == (2, 2, 0)


@pytest.mark.parametrize(("data", "why"), [
    (b"{not json", "not JSON"),
    (b'{"schema": 2}', "schema 2"),
    (ShardProgressDoc(run_id="other-run", class_name=CLASS, index=0, done=1).to_json(),
     "of run 'other-run'"),
    (ShardProgressDoc(run_id=RUN, class_name=CLASS, index=3, done=1).to_json(),
     "is shard 3"),
], ids=["not-json", "another-schema", "another-runs", "another-index"])
def test_a_document_that_is_not_this_shards_is_ignored_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data: bytes, why: str) -> None:
    store = open_store(str(tmp_path))
    store.put_bytes(shard_progress_key(RUN, CLASS, 0), data)
    run = indexed_run([2, 2], active=1, ready=1)
    reader = ShardProgressReader(store)
    with caplog.at_level(logging.DEBUG, logger="controller"):
        reader.poll([run], 0.0)
        reader.poll([run], 60.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and why in warnings[0], warnings
    assert run.counted is None and run.models_done == 0


def test_without_documents_the_counts_are_by_whole_shard(tmp_path: Path) -> None:
    """An older worker image writes none: the Job's status alone, as before."""
    run = indexed_run([3, 3, 3, 3], completed="0-1", active=2, ready=2)
    [cls] = ShardProgressReader(open_store(str(tmp_path))).poll([run], 0.0)
    assert run.counted is None
    assert (cls.done, cls.running, cls.shards_done) == (6, 6, 2)


def test_the_document_key_is_next_to_the_shard_list() -> None:
    assert shard_progress_key(RUN, CLASS, 12) == f"_shards/{RUN}/{CLASS}/12.progress.json"
    assert shard_progress_name(0) == "0.progress.json"


class Classes:
    """A progress observer: every ClassProgress list the backend gave."""

    def __init__(self) -> None:
        self.seen: list[list[ClassProgress]] = []

    def counts(self, *, done: int, failed: int, running: int, waiting: int) -> None:
        pass

    def classes(self, classes: Sequence[ClassProgress]) -> None:
        self.seen.append(list(classes))


def test_a_sharded_run_reports_each_classes_progress_from_the_pods_documents(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """The simulated pods run the real batch loop, their supervisors keep the real progress
    documents; the backend reads them and gives Progress one ClassProgress per class, per
    model: at the end every model done but the permanent failure, its device seconds the
    markers' (1.5 + 2.5 s each)."""
    models = rows([f"ok-{i}" for i in range(23)] + ["bad-0"])
    worker = ShardWorker(store, progress=True)
    backend = backend_for(kube, store)
    backend.shard_progress.every_s = 0.0  # every poll reads (30 s in a real run)
    progress = Progress(len(models), interactive=False)
    observer = Classes()
    progress.observe(observer)
    with indexed.autopilot(worker):
        backend.run([Task.for_model(r) for r in models], lambda o: None, progress)
    assert observer.seen and all(len(c) == 1 for c in observer.seen)
    for [cls] in observer.seen:
        assert cls.done + cls.failed + cls.running <= cls.models == len(models)
    [last] = observer.seen[-1]
    assert (last.done, last.failed, last.running) == (23, 1, 0)
    assert last.shards_done == last.shards and last.device_busy_s == pytest.approx(23 * 4.0)
    assert backend.shard_progress.gets > 0
    assert all(r.counted is not None for r in backend.runs)
    # Whoever reads the folder's shard lists by name still finds only lists there.
    folder = f"_shards/{backend.spec.run_id}/{last.name}/"
    keys = list(store.list_keys(folder))
    assert sorted(k for k in keys if k.endswith(".csv")) == sorted(
        f"{folder}{i}.csv" for i in range(last.shards))
    assert len(keys) == 2 * last.shards


@pytest.fixture
def indexed(sim: KubeSim) -> IndexedJobSimulator:
    from tests.support.cluster import NS

    return IndexedJobSimulator(sim, namespace=NS)
