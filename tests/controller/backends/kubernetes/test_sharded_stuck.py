"""A sharded run that cannot go on as it is: a class no node can schedule, and a restart that
finds an earlier run's Job still running.

A class whose pods stay Unschedulable for --pending-timeout (no node has the disk, the GPU,
the toleration its pods ask for) ends the run with exit 3 and the scheduler's reason; its
Job is deleted (it would hold pending pods, and an autoscaler's attention, forever), the
other classes' Jobs are left to a later run. A Job that Kueue holds suspended for quota is
waiting, not stuck. A restarted controller re-attaches to the Jobs an earlier run left
running and creates the Jobs of what they do not cover at once, without waiting for them.
The cluster is tests.support.indexed.IndexedJobSimulator, its pods the worker's real batch
loop (tests.support.shardworker), the controller the real one over HTTP (KubeSim).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from controller.backends.base import Outcome
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.diagnosis import is_unschedulable
from controller.backends.kubernetes.common.names import CLASS_LABEL, RUN_LABEL
from controller.backends.kubernetes.sharded.backend import ShardedBackend
from controller.errors import EXIT_INFRA, SweepError, describe_error
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import iter_markers, shard_prefix
from esd_worker.core.store.stores import Store
from tests.controller.backends.kubernetes.test_sharded import (
    GB,
    RUN_A,
    RUN_B,
    backend_for,
    by_status,
    rows,
    run,
)
from tests.support.cluster import NS, wait_for
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim, job_finished
from tests.support.shardworker import ShardWorker

NO_DISK = ("0/4 nodes are available: 4 Insufficient ephemeral-storage. preemption: 0/4 nodes "
           "are available: 4 No preemption victims found for incoming pod.")


def jobs_of(indexed: IndexedJobSimulator, run_id: str) -> list[dict[str, Any]]:
    return [j for j in indexed.jobs() if j["metadata"]["labels"][RUN_LABEL] == run_id]


class Background:
    """A controller's run on a thread: its outcomes, or the error it ended with."""

    def __init__(self, backend: ShardedBackend, models: list[ModelRow], store: Store) -> None:
        self.backend = backend
        self.outcomes: list[Outcome] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None

        def target() -> None:
            try:
                self.outcomes, _ = run(backend, models, store)
            except BaseException as e:  # handed to the test
                self.error = e
            self.ended_at = time.monotonic()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 20) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.backend.request_stop()
            self.thread.join(10)
            raise AssertionError("the run did not end in time")


def test_a_class_that_cannot_be_scheduled_ends_the_run_with_the_schedulers_reason(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """gpu-large asks for 400Gi of disk that no node has: its pods stay Unschedulable. The
    run ends within --pending-timeout of it with exit 3 (infrastructure: the cluster cannot
    run what was asked) and one line naming the class, its requests and the scheduler's
    message; gpu-large's Job is deleted; the small models, whose class schedules, are done."""
    small = rows([f"ok-{i}" for i in range(8)])
    big = rows(["ok-big-0", "ok-big-1"], size=80 * GB)
    indexed.unschedulable["gpu-large"] = NO_DISK
    timeout = 1.0
    backend = backend_for(kube, store, pending_timeout_s=timeout)
    with indexed.autopilot(ShardWorker(store)):
        started = time.monotonic()
        background = Background(backend, small + big, store)
        background.join()
    assert background.ended_at is not None
    assert background.ended_at - started < timeout + 3
    error = background.error
    assert isinstance(error, SweepError)
    status, line = describe_error(error) or (0, "")
    assert status == EXIT_INFRA and "\n" not in line
    for part in ("gpu-large", "ephemeral-storage", "400Gi", "memory", "64Gi",
                 "Insufficient ephemeral-storage", "--pending-timeout"):
        assert part in line, part
    assert [j["metadata"]["labels"][CLASS_LABEL] for j in sim.objects("jobs", NS)] == [
        "gpu-small"]
    assert {m.key for m in small} <= set(iter_markers(store))


def test_a_job_kueue_holds_for_quota_is_waiting_not_stuck(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """Suspended by Kueue for want of quota, the Job has no pod to schedule: many pending
    timeouts later the run is still waiting for it, and its Job is still there."""
    backend = backend_for(kube, store, kueue_queue="gpu-queue", pending_timeout_s=0.1)
    with indexed.autopilot(ShardWorker(store), admit=False):
        background = Background(backend, rows(["a", "b"]), store)
        (job,) = wait_for(lambda: indexed.jobs())
        time.sleep(1.0)
        assert background.thread.is_alive() and background.error is None
        backend.request_stop()
        background.join()
    assert job["spec"]["suspend"] is True
    assert len(sim.objects("jobs", NS)) == 1


def test_a_restart_creates_the_missing_jobs_before_the_attached_one_finishes(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """An earlier run's Job covers 20 models and has not run yet; the new run, of 30, shards
    the 10 it does not cover and creates their Job at once, then follows both. Every model
    is analysed once; the attached run's failure record is its model's outcome."""
    models = rows([f"ok-{i}" for i in range(19)] + ["bad-gone"] + [
        f"ok-late-{i}" for i in range(10)])
    first = backend_for(kube, store, run_id=RUN_A, max_parallel=2)
    earlier = Background(first, models[:20], store)
    wait_for(lambda: indexed.jobs())
    first.request_stop()
    earlier.join()

    second = backend_for(kube, store, run_id=RUN_B, max_parallel=2)
    worker = ShardWorker(store)
    background = Background(second, models, store)
    try:
        (new,) = wait_for(lambda: jobs_of(indexed, RUN_B), timeout_s=5)
    finally:
        if not jobs_of(indexed, RUN_B):
            second.request_stop()
    (attached,) = jobs_of(indexed, RUN_A)
    assert not job_finished(attached)  # nothing has run yet
    new_shards = [line.split(",")[0] for key in store.list_keys(shard_prefix(
        RUN_B, new["metadata"]["labels"][CLASS_LABEL]))
        for line in (store.get_bytes(key) or b"").decode().splitlines()[1:]]
    assert sorted(new_shards) == sorted(m.ref for m in models[20:])
    with indexed.autopilot(worker):
        background.join()
    assert background.error is None
    status = by_status(background.outcomes)
    assert status == {"failed": {"org/bad-gone"}, "done": {m.ref for m in models} - {
        "org/bad-gone"}}
    (bad,) = [o for o in background.outcomes if o.status == "failed"]
    assert bad.recorded and not bad.retryable and "NoOutcome" not in bad.error
    assert set(worker.analysed.values()) == {1} and len(worker.analysed) == len(models) - 1
    assert [r.run_id for r in second.attached] == [RUN_A]


def pending_pod(reason: str | None) -> dict[str, Any]:
    conditions = [] if reason is None else [
        {"type": "PodScheduled", "status": "False", "reason": reason, "message": NO_DISK}]
    return {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": conditions}}


def event(reason: str, at: str) -> dict[str, Any]:
    return {"type": "Normal" if reason != "FailedScheduling" else "Warning", "reason": reason,
            "message": "...", "lastTimestamp": at}


T0, T1 = "2026-11-26T17:00:00Z", "2026-11-26T17:01:00Z"
STUCK_CASES = {
    "unschedulable": (pending_pod("Unschedulable"), [event("FailedScheduling", T0)], True),
    "event-only": (pending_pod(None), [event("FailedScheduling", T0)], True),
    "image-pull": (pending_pod(None), [event("Failed", T0)], False),
    "scheduling-gated": (pending_pod("SchedulingGated"), [], False),
    "autoscaler-scaling-up": (pending_pod("Unschedulable"), [
        event("FailedScheduling", T0), event("TriggeredScaleUp", T1)], False),
    "karpenter-nominated": (pending_pod("Unschedulable"), [
        event("FailedScheduling", T0), event("Nominated", T1)], False),
    "scale-up-then-failed-again": (pending_pod("Unschedulable"), [
        event("TriggeredScaleUp", T0), event("FailedScheduling", T1)], True),
    "autoscaler-gave-up": (pending_pod("Unschedulable"), [
        event("FailedScheduling", T0), event("NotTriggerScaleUp", T1)], True),
}


@pytest.mark.parametrize(("pod", "events", "stuck"), STUCK_CASES.values(),
                         ids=STUCK_CASES.keys())
def test_what_counts_as_unschedulable(pod: dict[str, Any], events: list[dict[str, Any]],
                                      stuck: bool) -> None:
    """Unschedulable is the scheduler's word that no node fits; an autoscaler that has
    since started a node for the pod (cluster-autoscaler TriggeredScaleUp, Karpenter
    Nominated) means a node is coming, not that none ever will; one that declined
    (NotTriggerScaleUp) does not."""
    assert is_unschedulable([pod], events) is stuck


@pytest.fixture
def indexed(sim: KubeSim) -> IndexedJobSimulator:
    return IndexedJobSimulator(sim, namespace=NS)
