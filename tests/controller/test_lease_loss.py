"""A sweep whose S3 lease is lost while it runs (paused past the TTL, cut off from the store,
then taken over): it stops dispatching, records nothing more and exits 3
(controller.output.tenure, controller.output.lease); no task starts once the loss is known,
nor while the lease has gone a TTL unrenewed (the local loop's check and start are one
step). S3 is moto's server over HTTP through real boto3; the workers are the protocol's
stand-in (tests/support/served_worker.py) or one-line commands (tests/support/local.py).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.backends.base import Task
from controller.backends.local.backend import LocalBackend
from controller.backends.local.settings import LocalSettings
from controller.errors import EXIT_INFRA
from controller.output.lease import ObjectLease, make_owner, observe
from controller.output.tenure import LeaseLostError, Tenure
from controller.run.recorder import Recorder
from controller.run.sweep import execute, run_sweep
from controller.settings import SweepSettings
from esd_worker.core.store.layout import LEASE_KEY
from esd_worker.core.store.stores import LocalStore
from tests.support.local import exit_task
from tests.support.s3server import S3Server, make_store, serve_s3

# How long the thread that finds the loss is given to deliver it while a task starts: far
# more than it needs when nothing holds it up, and how long a gated start holds it.
LOSS_WAIT_S = 1.0


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_a_sweep_that_loses_its_s3_lease_stops_dispatching_and_exits_3(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty one-second models on one worker (the protocol's stand-in worker); once two have
    started, another sweep's record replaces the lease object, as a takeover after a pause
    past the TTL does. The sweep's next renewal (every 0.5 s with a 1.5 s TTL) finds it lost:
    no more than the model in flight and one more start, nothing recorded from then on, no
    summary.csv, the other sweep's lease left alone, exit 3 and the run report says why."""
    store = make_store(s3_server)
    monkeypatch.setenv("FAKE_WORKER_STATE", str(tmp_path))
    starts = tmp_path / "starts"
    models = tmp_path / "models.csv"
    models.write_text("model_id\n" + "".join(f"wait-{i}\n" for i in range(20)))
    settings = SweepSettings(
        output=store.url, model_list=models, device="cpu", lease_ttl_s=1.5,
        worker_cmd=(sys.executable, "-m", "tests.support.served_worker"),
        local=LocalSettings(max_retries=0), log_dir=tmp_path / "logs")
    taken: list[int] = []

    def take_over() -> None:
        deadline = time.monotonic() + 60
        while not starts.exists() or len(starts.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        seen = observe(store)
        assert seen is not None and seen.owner is not None
        other = json.loads(seen.owner.to_json()) | {"token": "sweep-b", "pid": 1}
        store.put_bytes(LEASE_KEY, json.dumps(other).encode())
        taken.append(len(starts.read_text().splitlines()))
        taken.append(len(list(store.list_keys("_failures/"))))

    thread = threading.Thread(target=take_over)
    thread.start()
    result = run_sweep(settings)
    thread.join(10)
    [started_then, recorded_then] = taken
    assert result.exit_code == EXIT_INFRA
    assert started_then <= len(starts.read_text().splitlines()) <= started_then + 1
    assert len(list(store.list_keys("_failures/"))) <= started_then
    assert len(list(store.list_keys("_failures/"))) >= recorded_then
    assert not store.exists("summary.csv")
    (run,) = store.list_keys("runs/")
    assert json.loads(store.get_bytes(run) or b"")["lease_lost"] is True
    seen = observe(store)
    assert seen is not None and seen.owner is not None and seen.owner.token == "sweep-b"


class Recording(LocalBackend):
    """The local backend on one CPU slot; `events` records its starts and the lease's loss in
    the order they happened."""

    def __init__(self) -> None:
        super().__init__(LocalSettings(max_retries=0, cpu_workers=1), None)
        self.events: list[str] = []
        self.tenure: Tenure | None = None

    def guard(self, tenure: Tenure) -> None:
        super().guard(tenure)
        self.tenure = tenure
        tenure.when_lost(lambda: self.events.append("lost"))

    def started(self, task: Task, gpus: tuple[int, ...]) -> None:
        self.events.append(f"start {task.key}")
        super().started(task, gpus)


class LostWhileStarting(Recording):
    """Its lease is lost by another thread (as the renewal thread loses it when it finds the
    lease taken over) at the worst moment: once the loop has checked that tasks may start
    and is starting the second one (in acquire, which the loop calls between that check and
    the start)."""

    def __init__(self) -> None:
        super().__init__()
        self.loser: threading.Thread | None = None

    def acquire(self, in_use: int, gpus: int) -> tuple[int, ...] | None:
        got = super().acquire(in_use, gpus)
        if got is not None and self.loser is None and self.events == ["start t0"]:
            assert self.tenure is not None
            self.loser = threading.Thread(target=self.tenure.lose)
            self.loser.start()
            self.loser.join(LOSS_WAIT_S)  # delivered by now, unless the start holds it off
        return got


def test_a_lease_lost_between_the_check_and_a_start_starts_nothing_after_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The check and the start are one step: the loss, found while the second task starts,
    lands after that start (which began before it), and nothing starts once it is known and
    logged ("no task starts"): the third task never runs. A check and a start apart let the
    loss land in between, and the second task start after "lost"."""
    backend = LostWhileStarting()
    tenure = Tenure("s3://bucket/out")
    tasks = [exit_task(f"t{i}", 0) for i in range(3)]
    execute(backend, tasks, Recorder(LocalStore(tmp_path), "run-1"), tenure)
    assert backend.loser is not None
    backend.loser.join(10)
    assert backend.events == ["start t0", "start t1", "lost"]
    assert tenure.lost
    assert "no task starts" in caplog.text


def test_a_sweep_resumed_past_its_leases_ttl_starts_nothing_until_a_renewal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sweep paused past its lease's TTL (its last renewal longer ago than the TTL) cannot
    know whether another sweep took the output over until its next renewal comes back: no
    task starts before it (one warning says why), and the tasks start once it renews."""
    backend = Recording()
    tenure = Tenure("s3://bucket/out")
    tenure.renewed(time.monotonic() - 1.0)  # its TTL ran out a second ago: the pause

    def renew_later() -> None:
        time.sleep(0.5)
        backend.events.append("renewed")
        tenure.renewed(math.inf)

    thread = threading.Thread(target=renew_later)
    thread.start()
    execute(backend, [exit_task(f"t{i}", 0) for i in range(2)],
            Recorder(LocalStore(tmp_path), "run-1"), tenure)
    thread.join(10)
    assert backend.events == ["renewed", "start t0", "start t1"]
    assert caplog.text.count("was not renewed within its TTL: no task starts") == 1


def test_an_s3_lease_is_surely_ours_for_its_ttl_from_its_last_write(s3_server: S3Server) -> None:
    """The lease's tenure counts its TTL from the write the store accepted: held at once,
    expired once a TTL passes with no renewal (tests/support/leasechecks.py: renewals keep
    it held)."""
    store = make_store(s3_server)
    lease = ObjectLease.claim(store, make_owner(command="esd-sweep run", run_id="a",
                                                ttl_s=2.0), None, renew=False)
    assert isinstance(lease, ObjectLease)
    with lease.tenure.holding() as held:
        assert held
    time.sleep(2.1)
    with lease.tenure.holding() as held:
        assert not held and lease.tenure.expired and not lease.tenure.lost
    lease.release()


def test_a_tenure_calls_each_reaction_once_whenever_it_was_registered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Registered before the loss: called when it comes, once however often it is found;
    registered after: called at once. A reaction that fails is logged and the others run."""
    tenure = Tenure("s3://bucket/out")
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    tenure.when_lost(lambda: calls.append("first"))
    tenure.when_lost(broken)
    tenure.when_lost(lambda: calls.append("second"))
    tenure.check()  # not lost: no error
    assert calls == []
    tenure.lose()
    tenure.lose()
    assert calls == ["first", "second"] and "boom" in caplog.text
    tenure.when_lost(lambda: calls.append("late"))
    assert calls == ["first", "second", "late"]
    with pytest.raises(LeaseLostError, match="s3://bucket/out was lost"):
        tenure.check()
