"""The sweep's own Events on its Jobs (controller.backends.kubernetes.common.jobevents).

Runs are the real controller over HTTP (KubeClient → KubeSim, which validates every Event
against the strict Kubernetes 1.31 schema as it is created) with test_sharded.py's helpers
and tests.support.indexed's cluster: the Events a run leaves (reasons, types, the Job they
point at by uid), what is in their messages, what a cluster that refuses them does to the
run (nothing), and how many a run may send.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes_validate
import pytest

from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.diagnosis import describe_pending
from controller.backends.kubernetes.common.jobevents import (
    COMPONENT,
    MESSAGE_BYTES,
    JobEventRecorder,
    build_event,
    event_message,
    foreign,
)
from controller.backends.kubernetes.common.names import CLASS_LABEL, job_name
from esd_worker.core.errors import EXIT_PERMANENT
from esd_worker.core.store.stores import Store
from tests.controller.backends.kubernetes.test_sharded import GB, backend_for, by_status, rows, run
from tests.controller.backends.kubernetes.test_sharded_devices import BROKEN, NODES
from tests.support.cluster import (
    NS,
    MarkerSimulator,
    assert_stored_objects_valid,
    make_backend,
    make_rows,
    run_models,
    wait_for,
)
from tests.support.indexed import Exit, IndexedJobSimulator
from tests.support.kubesim import K8S_VERSION, KubeSim, job_finished
from tests.support.shardworker import ShardWorker

# Secrets a failing worker's log may hold: an HF token, a bearer header, S3 credentials in a
# URL. Their tell-tale parts must be in no Event.
HF_TOKEN = "hf_" + "Q7x" * 12
SECRET_LOG = (f"fetch failed with token {HF_TOKEN}; Authorization: Bearer sk-live-abcdef123456 "
              "store s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG@bucket/out\n")
SECRET_PARTS = (HF_TOKEN, "Q7xQ7xQ7x", "sk-live-abcdef123456", "AKIAIOSFODNN7EXAMPLE",
                "wJalrXUtnFEMI")


def events_of(sim: KubeSim) -> list[dict[str, Any]]:
    return [e for e in sim.objects("events", NS) if e.get("reportingComponent") == COMPONENT]


def reasons(events: Sequence[Mapping[str, Any]], job: str | None = None) -> list[str]:
    return sorted(e["reason"] for e in events
                  if job is None or e["involvedObject"]["name"] == job)


def legacy_problems(event: Mapping[str, Any]) -> list[str]:
    """What the API server's ValidateEventCreate refuses of a core/v1 Event without an
    eventTime (k8s.io/kubernetes pkg/apis/core/validation/events.go), as far as kmock's
    schema check does not: the namespaces agree, the involved object is a Job by uid, the
    bounds on reason, message (bytes), reportingInstance, a qualified reportingComponent."""
    problems = []
    if event["involvedObject"].get("namespace") != event["metadata"]["namespace"]:
        problems.append("involvedObject.namespace differs from the Event's")
    if len(event["reason"]) > 128 or not re.fullmatch(r"[A-Z][A-Za-z]+", event["reason"]):
        problems.append("reason is not CamelCase within 128")
    if len(event["message"].encode("utf-8")) > MESSAGE_BYTES:
        problems.append("message over 1 KB")
    if not 0 < len(event["reportingInstance"]) <= 128:
        problems.append("reportingInstance")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", event["reportingComponent"]):
        problems.append("reportingComponent is not a qualified name")
    if event["type"] not in ("Normal", "Warning"):
        problems.append("type")
    for stamp in ("firstTimestamp", "lastTimestamp"):
        datetime.datetime.strptime(event[stamp], "%Y-%m-%dT%H:%M:%SZ")
    return problems


def assert_valid_and_clean(sim: KubeSim, events: Sequence[Mapping[str, Any]]) -> None:
    assert_stored_objects_valid(sim)  # strict schema, with the server's metadata
    text = json.dumps(events)
    for part in SECRET_PARTS:
        assert part not in text, part
    for event in events:
        assert legacy_problems(event) == [], event
        assert event["source"] == {"component": COMPONENT} and event["count"] == 1
        assert event["involvedObject"]["apiVersion"] == "batch/v1"
        assert event["involvedObject"]["kind"] == "Job"


@pytest.mark.parametrize(("failing", "individual", "aggregated"), [
    pytest.param(set(), 0, 0, id="none-failed"),
    pytest.param({1, 4}, 2, 0, id="two-shards-each-an-event"),
    pytest.param(set(range(1, 10)), 5, 1, id="nine-shards-five-events-then-one"),
])
def test_a_sharded_run_leaves_its_milestones_and_failures_on_its_job(
    sim: KubeSim, kube: KubeClient, store: Store, failing: set[int], individual: int,
    aggregated: int,
) -> None:
    """10 models in 10 shards of one class: ShardsCreated, then ClassComplete and
    SweepFinished (Normal), a ShardFailed (Warning) per failed index up to five, the rest in
    one that counts them; every Event on the Job by its real uid, valid as the API server
    takes it, its message free of the secrets the failing pods logged."""
    indexed = IndexedJobSimulator(sim, namespace=NS)
    worker = ShardWorker(store)

    def script(job: dict[str, Any], index: int, attempt: int,
               pod: Mapping[str, Any] | None = None) -> Any:
        if index in failing:
            return Exit(EXIT_PERMANENT, log=SECRET_LOG)
        return worker(job, index, attempt, pod=pod)

    backend = backend_for(kube, store, shard_size=2)
    with indexed.autopilot(script):
        outcomes, _ = run(backend, rows([f"ok-{i}" for i in range(10)]), store)
    assert len(by_status(outcomes)["failed"]) == len(failing)
    (job,) = sim.objects("jobs", NS)
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    assert job["spec"]["completions"] == 10
    events = events_of(sim)
    assert {e["involvedObject"]["uid"] for e in events} == {uid}
    assert {e["involvedObject"]["name"] for e in events} == {name}
    expected = ["ClassComplete", "ShardsCreated", "SweepFinished"] + [
        "ShardFailed"] * (individual + aggregated)
    assert reasons(events) == sorted(expected)
    types = {e["reason"]: e["type"] for e in events}
    assert types["ShardsCreated"] == types["ClassComplete"] == types["SweepFinished"] == "Normal"
    by_reason = {e["reason"]: e["message"] for e in events}
    assert by_reason["ShardsCreated"] == (
        f"class gpu-small: 10 shard(s) of 10 model(s), 4 pod(s) at once (run "
        f"{backend.spec.run_id})")
    assert f"{10 - len(failing)} of 10 shard(s) done" in by_reason["ClassComplete"]
    assert f"{len(failing)} failed ({len(failing)} model(s))" in by_reason["ClassComplete"]
    assert by_reason["SweepFinished"].endswith(
        f"finished: {10 - len(failing)} model(s) done, {len(failing)} failed")
    failed = [e for e in events if e["reason"] == "ShardFailed"]
    assert all(e["type"] == "Warning" for e in failed)
    if failing:
        assert any("shard 1 of class gpu-small (1 model(s)) failed: " in e["message"]
                   for e in failed)
        assert any("[REDACTED]" in e["message"] for e in failed)
    if aggregated:
        (summary,) = [e for e in failed if "more shard(s)" in e["message"]]
        assert summary["message"].startswith("4 more shard(s) of class gpu-small (4 model(s)) "
                                             "failed: indexes 6, 7, 8, 9; the first: ")
    assert_valid_and_clean(sim, events)
    assert sim.emulator.validated["Event"] >= len(events)


def test_a_broken_gpu_is_a_warning_on_the_job_whose_pod_found_it(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """GPUBroken names the node on the Job whose pod exited 6 there; the replacement Job
    has its own ShardsCreated; both are told SweepFinished."""
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=NODES)
    worker = ShardWorker(store, broken_nodes=frozenset({BROKEN}))
    backend = backend_for(kube, store, max_parallel=16, shard_size=50)
    with indexed.autopilot(worker):
        run(backend, rows([f"ok-{i}" for i in range(800)]), store)
    jobs = {j["metadata"]["labels"][CLASS_LABEL]: j for j in sim.objects("jobs", NS)}
    first, replacement = jobs["gpu-small"], jobs["gpu-small-r1"]
    events = events_of(sim)
    (broken,) = [e for e in events if e["reason"] == "GPUBroken"]
    assert broken["type"] == "Warning"
    assert broken["involvedObject"]["uid"] == first["metadata"]["uid"]
    assert f"node {BROKEN}: GPU broken" in broken["message"]
    assert f"kubectl cordon {BROKEN}" in broken["message"]
    assert reasons(events, replacement["metadata"]["name"]) == [
        "ClassComplete", "ShardsCreated", "SweepFinished"]
    assert {e["involvedObject"]["uid"] for e in events} == {
        first["metadata"]["uid"], replacement["metadata"]["uid"]}
    assert_valid_and_clean(sim, events)


def test_a_class_complete_goes_out_when_its_job_ends_not_when_the_run_does(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """gpu-small's Job finishes while gpu-large's pods still wait for a node: its
    ClassComplete is on it then, once; the run, stopped, tells both SweepFinished and
    gpu-large no ClassComplete (it never finished)."""
    indexed = IndexedJobSimulator(sim, namespace=NS)
    indexed.unschedulable = {"gpu-large": "0/1 nodes are available: 1 Insufficient memory."}
    backend = backend_for(kube, store)
    models = [*rows(["ok-0", "ok-1"]), *rows(["big-0"], size=40 * GB)]
    with indexed.autopilot(ShardWorker(store)):
        running = threading.Thread(target=run, args=(backend, models, store))
        running.start()
        try:
            (complete,) = wait_for(lambda: [e for e in events_of(sim)
                                            if e["reason"] == "ClassComplete"], timeout_s=20)
            jobs = {j["metadata"]["labels"][CLASS_LABEL]: j for j in sim.objects("jobs", NS)}
            assert complete["involvedObject"]["uid"] == jobs["gpu-small"]["metadata"]["uid"]
            assert not job_finished(jobs["gpu-large"])  # the run is still following it
            assert re.fullmatch(r"class gpu-small: Job Complete: (\d+) of \1 shard\(s\) done "
                                r"\(2 model\(s\)\), 0 failed \(0 model\(s\)\)",
                                complete["message"]), complete["message"]
        finally:
            backend.request_stop()
            running.join(30)
    assert not running.is_alive()
    events = [e for e in events_of(sim) if e["type"] == "Normal"]
    assert reasons(events, jobs["gpu-small"]["metadata"]["name"]) == [
        "ClassComplete", "ShardsCreated", "SweepFinished"]
    assert reasons(events, jobs["gpu-large"]["metadata"]["name"]) == [
        "ShardsCreated", "SweepFinished"]


def test_a_class_no_node_can_run_is_an_unschedulable_warning(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """The run's exit 3: Unschedulable on the class's Job (by the uid it had) with the
    scheduler's reason, sent before the Job is deleted; the Event does not become the reason
    the next look gives for a pending Job (the controller reads only others' Events)."""
    indexed = IndexedJobSimulator(sim, namespace=NS)
    indexed.unschedulable["gpu-large"] = "0/4 nodes are available: 4 Insufficient memory."
    backend = backend_for(kube, store, pending_timeout_s=0.5)
    with indexed.autopilot(ShardWorker(store)), pytest.raises(Exception) as raised:
        run(backend, rows(["big-0"], size=80 * 10**9), store)
    assert "cannot be scheduled" in str(raised.value)
    assert sim.objects("jobs", NS) == []
    events = events_of(sim)
    (stuck,) = [e for e in events if e["reason"] == "Unschedulable"]
    (created,) = [e for e in events if e["reason"] == "ShardsCreated"]
    assert stuck["type"] == "Warning"
    assert stuck["involvedObject"]["uid"] == created["involvedObject"]["uid"]
    assert "Insufficient memory" in stuck["message"] and "exit 3" in stuck["message"]
    assert_valid_and_clean(sim, events)
    assert foreign(events) == []
    job = {"metadata": {"name": "x"}, "spec": {}}
    assert describe_pending(job, [], foreign(sim.objects("events", NS))).startswith(
        "FailedScheduling")


@pytest.mark.parametrize(("status", "tries"), [
    pytest.param(403, 1, id="rbac-denied-no-more-tries"),
    pytest.param(500, 3, id="server-errors-three-tries-then-none"),
])
def test_a_cluster_refusing_events_neither_fails_nor_slows_the_run(
    sim: KubeSim, kube: KubeClient, store: Store, caplog: pytest.LogCaptureFixture,
    status: int, tries: int,
) -> None:
    """Every create of an Event refused: the run's outcomes are what they would be, one
    warning says so (naming the RBAC rule when denied), no create is retried, and after a
    denial (or three failures in a row) none is tried again."""
    if status == 403:
        sim.forbid("create", "events", namespace=NS)
    else:
        sim.fail("create", "events", status=500, times=None)
    indexed = IndexedJobSimulator(sim, namespace=NS)
    with caplog.at_level(logging.DEBUG), indexed.autopilot(ShardWorker(store)):
        outcomes, _ = run(backend_for(kube, store, shard_size=2),
                          rows([f"ok-{i}" for i in range(8)]), store)
    assert by_status(outcomes)["failed"] == set()
    assert sim.count("create", "events") == tries
    assert events_of(sim) == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                and "job events" in r.getMessage()]
    assert len(warnings) == 1
    assert ("grant create on events" in warnings[0].getMessage()) is (status == 403)


def test_events_are_sent_once_each_and_a_run_sends_a_bounded_number(
    sim: KubeSim, kube: KubeClient, caplog: pytest.LogCaptureFixture,
) -> None:
    """(Job, reason, message) is sent once; past the bound nothing more is sent, said once
    in the log."""
    job = {"metadata": {"name": "esd-job", "namespace": NS, "uid": "u-1"}}
    recorder = JobEventRecorder(kube, host="controller-0", limit=5)
    assert recorder.normal(job, "ShardsCreated", "class a")
    assert not recorder.normal(job, "ShardsCreated", "class a")
    assert recorder.warning(job, "ShardFailed", "class a")  # another reason: another Event
    with caplog.at_level(logging.INFO):
        sent = [recorder.warning(job, "ShardFailed", f"shard {i}") for i in range(10)]
    assert sent == [True] * 3 + [False] * 7
    assert recorder.sent == 5 and recorder.skipped == 7
    assert len(events_of(sim)) == sim.count("create", "events") == 5
    assert caplog.text.count("the bound of a run") == 1
    assert len({e["metadata"]["name"] for e in events_of(sim)}) == 5


@pytest.mark.parametrize(("message", "expect"), [
    pytest.param("x" * 5000, "x" * 900, id="long-ascii-cut"),
    pytest.param("é" * 2000, "é" * 400, id="two-byte-characters-cut-by-bytes"),
    pytest.param("line one\nline two\x1b[31m", "line one\\nline two\\x1b[31m",
                 id="control-characters-escaped"),
    pytest.param(SECRET_LOG, "[REDACTED]", id="secrets-redacted"),
])
@pytest.mark.parametrize("version", [K8S_VERSION, "1.33.0"])
def test_an_event_is_what_the_api_server_takes(message: str, expect: str,
                                               version: str) -> None:
    """build_event: valid in the strict schema and by the API server's own Event rules,
    its message ≤ 1 KB in UTF-8 whatever it was given, on one line, redacted."""
    job = {"metadata": {"name": job_name("org-m-0123456789"), "namespace": NS, "uid": "u"}}
    event = build_event(job, type_="Warning", reason="ModelFailed", message=message,
                        host="h" * 300, when=datetime.datetime(2026, 1, 2, 3, 4, 5,
                                                               tzinfo=datetime.UTC),
                        serial=7)
    kubernetes_validate.validate(event, version, strict=True)
    assert legacy_problems(event) == []
    assert expect in event["message"] and "\n" not in event["message"]
    assert not any(part in event["message"] for part in SECRET_PARTS)
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-01-02T03:04:05Z"
    assert len(event["reportingInstance"]) == 128


def test_a_model_that_fails_for_good_is_a_warning_on_its_job(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """Per-model mode: ModelFailed on the failed model's Job (by uid) with the cause; a
    model whose Job is retried and then succeeds gets none."""
    bad, good = make_rows(2)
    with cluster.autopilot(lambda job: [EXIT_PERMANENT] if job["metadata"]["name"] ==
                           job_name(bad.key) else ["succeed"]):
        outcomes = run_models(make_backend(kube, store), [bad, good])
    assert {o.task.key: o.status for o in outcomes} == {bad.key: "failed", good.key: "done"}
    (failed,) = events_of(sim)
    jobs = {j["metadata"]["name"]: j for j in sim.objects("jobs", NS)}
    assert failed["reason"] == "ModelFailed" and failed["type"] == "Warning"
    assert failed["involvedObject"]["uid"] == jobs[job_name(bad.key)]["metadata"]["uid"]
    assert failed["message"].startswith(f"model {bad.ref} failed after 1 Job(s) (permanent): ")
    assert_valid_and_clean(sim, [failed])


def test_a_secret_given_through_the_environment_is_in_no_message() -> None:
    """A token of no known shape, known only as HF_TOKEN's value (the controller's
    environment, from a Secret), is redacted from an Event's message. In a process of its
    own: the redactor reads the environment once, when first used."""
    code = ("import os\n"
            "from controller.backends.kubernetes.common.jobevents import event_message\n"
            "print(event_message('hub said 401 for ' + os.environ['HF_TOKEN'] + ' twice'))")
    env = {**os.environ, "HF_TOKEN": "plain-secret-of-no-shape-42"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out.strip() == "hub said 401 for [REDACTED] twice"
    assert event_message("nothing secret here") == "nothing secret here"
