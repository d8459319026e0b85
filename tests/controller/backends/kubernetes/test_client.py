"""controller.backends.kubernetes.client through the real `kubernetes` client against kmock
(tests/support/kubesim.py).

Everything goes over HTTP: KubeClient → kubernetes.client → kmock's KubernetesEmulator.
Every object written (the controller's Jobs, the simulator's pods, status patches and
events) is validated by the emulator against the strict Kubernetes 1.31 schemas; the
tests also run kubernetes_validate.validate on what ends up stored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s

from controller.backends.kubernetes.client import (
    KubeClient,
    RetryPolicy,
    WatchEvent,
    load_client,
)
from controller.backends.kubernetes.errors import (
    KubeConfigError,
    KubeInvalidError,
    KubePermissionError,
    KubeQuotaError,
    KubeUnavailableError,
    ResourceVersionExpired,
)
from controller.backends.kubernetes.jobs import JobSettings, build_job
from controller.backends.kubernetes.names import job_name, run_selector
from esd_worker.naming import model_key
from tests.support.kubesim import (
    K8S_VERSION,
    JobSimulator,
    KubeSim,
    Selector,
    StrictValidator,
    job_finished,
)

NS = "esd"
RUN = "20261123T070501Z-3fa9c2"
FAST = RetryPolicy(attempts=5, base_s=0.001, max_s=0.01, deadline_s=5.0)


@pytest.fixture
def sim() -> Any:
    with KubeSim() as server:
        yield server


@pytest.fixture
def kube(sim: KubeSim) -> Any:
    with KubeClient(sim.configuration(), retry=FAST) as client:
        yield client


@pytest.fixture
def cluster(sim: KubeSim) -> JobSimulator:
    return JobSimulator(sim, namespace=NS)


def make_job(ref: str = "openai-community/gpt2", *, run_id: str = RUN, attempt: int = 0,
             **settings: Any) -> dict[str, Any]:
    return build_job(
        model_ref=ref, model_key=model_key(ref), relation="", source_model=None,
        output_url="s3://esd-results/atlas", attempt=attempt,
        settings=JobSettings(image="ghcr.io/example/esd-sweep:0.1.0", namespace=NS,
                             run_id=run_id, hf_token_secret="hf-token:token", **settings),
    )


def assert_stored_objects_valid(sim: KubeSim) -> None:
    """What the cluster holds (with server-set metadata and status) passes strict 1.31."""
    for resource in ("jobs", "pods", "events"):
        for obj in sim.objects(resource):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def watch_until(kube: KubeClient, rv: str, done: Any, timeout_s: int = 5) -> list[WatchEvent]:
    """Watch Jobs of the run from rv until done(events) is true (or the watch times out)."""
    events: list[WatchEvent] = []
    for event in kube.watch_jobs(NS, run_selector(RUN), rv, timeout_s=timeout_s):
        events.append(event)
        if done(events):
            break
    return events


# -- create, adopt, list ---------------------------------------------------------------------


def test_create_then_409_means_adopt(sim: KubeSim, kube: KubeClient) -> None:
    """A second create of the same name is "exists" (adopt), not an error, and one Job."""
    job = make_job()
    assert kube.create_job(NS, job) == "created"
    assert kube.create_job(NS, job) == "exists"
    stored = sim.objects("jobs", NS)
    assert [j["metadata"]["name"] for j in stored] == [job["metadata"]["name"]]
    assert stored[0]["metadata"]["uid"] and stored[0]["metadata"]["resourceVersion"]
    assert sim.emulator.validated["Job"] == 1
    assert_stored_objects_valid(sim)


def test_lost_create_response_is_retried_into_adopt(sim: KubeSim, kube: KubeClient) -> None:
    """The create lands but its response is a 500 (kmock stores the write before the
    reaction answers): the retry meets 409, so the Job is adopted, never duplicated."""
    sim.fail("create", "jobs", status=500, committed=True)
    assert kube.create_job(NS, make_job()) == "exists"
    assert sim.count("create", "jobs") == 2
    assert len(sim.objects("jobs")) == 1


def test_rejected_object_is_invalid_error(sim: KubeSim, kube: KubeClient) -> None:
    """The emulator rejects what a 1.31 apiserver would (strict schema) with 422."""
    job = make_job()
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["request"] = {"cpu": "1"}
    with pytest.raises(KubeInvalidError, match="request"):
        kube.create_job(NS, job)
    assert sim.objects("jobs") == []
    assert sim.count("create", "jobs") == 1  # 422 is not retried


def test_list_by_label_selector_and_pages(sim: KubeSim, kube: KubeClient) -> None:
    """Only the run's Jobs come back, across pages, with the version to watch from."""
    mine = [make_job(f"org/model-{i}") for i in range(5)]
    for job in [*mine, make_job("org/other", run_id="another-run")]:
        kube.create_job(NS, job)
    items, version = kube.list_jobs(NS, run_selector(RUN), page_size=2)
    assert sorted(j["metadata"]["name"] for j in items) == sorted(
        j["metadata"]["name"] for j in mine)
    assert int(version) >= 6
    assert sim.count("list", "jobs") == 3  # pages of 2, 2, 1
    assert kube.list_jobs(NS, "esd-sweep/run in (another-run)")[0][0]["metadata"]["name"] == \
        job_name(model_key("org/other"))
    assert kube.list_jobs("elsewhere", run_selector(RUN))[0] == []


# -- watch -----------------------------------------------------------------------------------


def test_watch_follows_the_simulator(sim: KubeSim, kube: KubeClient,
                                     cluster: JobSimulator) -> None:
    """Watching from the list's version shows each later change once, in version order."""
    job = make_job()
    kube.create_job(NS, job)
    name = job["metadata"]["name"]
    _, version = kube.list_jobs(NS, run_selector(RUN))
    cluster.run(name)
    cluster.succeed(name)
    events = watch_until(kube, version, lambda ev: any(job_finished(e.object) for e in ev))
    assert all(e.type == "MODIFIED" for e in events)
    versions = [int(str(e.resource_version)) for e in events]
    assert versions == sorted(set(versions)) and versions[0] > int(version)
    assert job_finished(events[-1].object) == "Complete"
    assert_stored_objects_valid(sim)


def test_watch_410_then_relist(sim: KubeSim, kube: KubeClient, cluster: JobSimulator) -> None:
    """After compaction an old version is 410 Gone → ResourceVersionExpired; a relist gives
    a fresh version from which the watch works again."""
    kube.create_job(NS, make_job())
    _, old = kube.list_jobs(NS, run_selector(RUN))
    cluster.run(make_job()["metadata"]["name"])
    sim.compact()
    with pytest.raises(ResourceVersionExpired):
        list(kube.watch_jobs(NS, run_selector(RUN), old, timeout_s=5))
    items, fresh = kube.list_jobs(NS, run_selector(RUN))
    assert int(fresh) > int(old) and items[0]["status"]["active"] == 1
    kube.create_job(NS, make_job("org/second"))
    events = watch_until(kube, fresh, lambda ev: len(ev) >= 1)
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [
        ("ADDED", job_name(model_key("org/second")))]


def test_watch_expired_mid_stream(sim: KubeSim, kube: KubeClient,
                                  cluster: JobSimulator) -> None:
    """An open watch can be told 410 at any time (ERROR event); the client raises then."""
    job = make_job()
    kube.create_job(NS, job)
    _, version = kube.list_jobs(NS, run_selector(RUN))
    stream = kube.watch_jobs(NS, run_selector(RUN), version, timeout_s=5)
    cluster.run(job["metadata"]["name"])
    assert next(stream).type == "MODIFIED"
    sim.expire_watches()
    with pytest.raises(ResourceVersionExpired):
        for _ in stream:
            pass


def test_watch_ends_quietly_on_timeout_and_on_a_dropped_connection(
        sim: KubeSim, kube: KubeClient) -> None:
    """A server-side timeout ends the watch with a BOOKMARK (the version to go on from);
    a dropped connection ends it without an error: the caller watches again."""
    kube.create_job(NS, make_job())
    _, version = kube.list_jobs(NS, run_selector(RUN))
    events = list(kube.watch_jobs(NS, run_selector(RUN), version, timeout_s=1))
    assert [e.type for e in events] == ["BOOKMARK"]
    assert int(str(events[0].resource_version)) >= int(version)

    seen: list[list[WatchEvent]] = []
    consumer = threading.Thread(target=lambda: seen.append(
        list(kube.watch_jobs(NS, run_selector(RUN), version, timeout_s=5))))
    started = time.monotonic()
    consumer.start()
    while sim.count("watch", "jobs") < 2:  # the second watch is open
        time.sleep(0.01)
    sim.api_down(0.5)
    consumer.join(5)
    assert seen == [[]]
    assert time.monotonic() - started < 3


# -- retries and errors ----------------------------------------------------------------------


def test_500_burst_is_retried(sim: KubeSim, kube: KubeClient) -> None:
    kube.create_job(NS, make_job())
    sim.fail("list", "jobs", status=500, times=3)
    items, _ = kube.list_jobs(NS, run_selector(RUN))
    assert len(items) == 1
    assert sim.count("list", "jobs") == 4


def test_retries_are_bounded(sim: KubeSim, kube: KubeClient) -> None:
    sim.fail("list", "pods", status=503, times=None)
    with pytest.raises(KubeUnavailableError, match="gave up after 5 tries"):
        kube.list_pods(NS, "a=b")
    assert sim.count("list", "pods") == FAST.attempts


def test_429_waits_at_least_retry_after(sim: KubeSim) -> None:
    """A 429's Retry-After is a floor for the wait (capped at max_s); jitter stays below
    the doubling bound otherwise."""
    waits: list[float] = []
    policy = RetryPolicy(attempts=4, base_s=0.001, max_s=5.0, deadline_s=None)
    with KubeClient(sim.configuration(), retry=policy, sleep=waits.append) as client:
        sim.fail("list", "jobs", status=429, retry_after_s=2, times=1)
        sim.fail("list", "jobs", status=502, times=1)
        client.list_jobs(NS, run_selector(RUN))
    assert len(waits) == 2
    assert 2.0 <= waits[0] <= 5.0
    assert 0.0 <= waits[1] <= 0.002


def test_retry_delays_grow_with_full_jitter() -> None:
    import random

    policy = RetryPolicy(base_s=0.5, max_s=8.0)
    rng = random.Random(7)
    for retry, bound in ((1, 0.5), (2, 1.0), (3, 2.0), (6, 8.0), (20, 8.0)):
        samples = [policy.delay(retry, rng=rng) for _ in range(200)]
        assert all(0 <= s <= bound for s in samples) and max(samples) > bound / 2
    assert policy.delay(1, retry_after_s=100, rng=rng) == 8.0


@pytest.mark.parametrize("mode", ["reset", "503"])
def test_api_down_for_a_while(sim: KubeSim, mode: str) -> None:
    """Dropped connections (or 503s) for 0.3 s: retried with backoff until it is back."""
    policy = RetryPolicy(attempts=30, base_s=0.02, max_s=0.1, deadline_s=10)
    with KubeClient(sim.configuration(), retry=policy) as client:
        client.create_job(NS, make_job())
        sim.api_down(0.3, mode=mode)
        started = time.monotonic()
        items, _ = client.list_jobs(NS, run_selector(RUN))
        assert len(items) == 1
        assert time.monotonic() - started >= 0.25
        assert client.requests > 3


def test_api_down_longer_than_the_deadline(sim: KubeSim) -> None:
    policy = RetryPolicy(attempts=100, base_s=0.01, max_s=0.05, deadline_s=0.3)
    with KubeClient(sim.configuration(), retry=policy) as client:
        sim.api_down(30)
        started = time.monotonic()
        with pytest.raises(KubeUnavailableError, match="cannot reach the API server"):
            client.list_jobs(NS, run_selector(RUN))
        assert time.monotonic() - started < 2


PERMISSIONS = [
    ("create", "jobs", lambda k: k.create_job(NS, make_job()),
     "cannot create jobs.batch in namespace esd: add verb create on jobs"),
    ("list", "jobs", lambda k: k.list_jobs(NS, run_selector(RUN)),
     "cannot list jobs.batch in namespace esd: add verb list on jobs"),
    ("watch", "jobs", lambda k: list(k.watch_jobs(NS, run_selector(RUN), "1", 1)),
     "cannot watch jobs.batch in namespace esd: add verb watch on jobs"),
    ("delete", "jobs", lambda k: k.delete_job(NS, "x"),
     "cannot delete jobs.batch in namespace esd: add verb delete on jobs"),
    ("get", "jobs", lambda k: k.read_job(NS, "x"),
     "cannot get jobs.batch in namespace esd: add verb get on jobs"),
    ("list", "pods", lambda k: k.list_pods(NS, "a=b"),
     'cannot list pods in namespace esd: add verb list on pods (apiGroups: [""]'),
    ("get", "pods/log", lambda k: k.read_pod_log(NS, "p"),
     "cannot get pods/log in namespace esd: add verb get on pods/log"),
    ("list", "events", lambda k: k.list_events(NS, "involvedObject.name=p"),
     "cannot list events in namespace esd: add verb list on events"),
]


@pytest.mark.parametrize(("verb", "resource", "call", "expected"), PERMISSIONS,
                         ids=[f"{v}-{r}" for v, r, _, _ in PERMISSIONS])
def test_403_names_the_missing_rbac_verb(sim: KubeSim, kube: KubeClient, verb: str,
                                         resource: str, call: Any, expected: str) -> None:
    """RBAC denials stop at once (no retry) with the verb and resource to add."""
    sim.forbid(verb, resource, namespace=NS)
    with pytest.raises(KubePermissionError) as info:
        call(kube)
    message = str(info.value)
    assert message.startswith("RBAC: the service account esd/esd-sweep ")
    assert expected in message
    assert sim.count(verb, resource) == 1


def test_401_says_credentials(sim: KubeSim, kube: KubeClient) -> None:
    sim.fail(status=401, times=None, message="Unauthorized")
    with pytest.raises(KubePermissionError, match=r"401 Unauthorized.*create jobs\.batch"):
        kube.create_job(NS, make_job())


def test_quota_403_is_not_an_rbac_error(sim: KubeSim, kube: KubeClient) -> None:
    sim.fail("create", "jobs", status=403, message=(
        'jobs.batch "x" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1, '
        "used: count/jobs.batch=100, limited: count/jobs.batch=100"))
    with pytest.raises(KubeQuotaError, match="exceeded quota"):
        kube.create_job(NS, make_job())


# -- the simulator through the client --------------------------------------------------------

OUTCOMES = [
    # pod outcomes in order, the Job's end, its reason, status.failed, exit codes on the pods
    (["succeed"], "Complete", None, 0, [0]),
    ([3], "Failed", "PodFailurePolicy", 1, [3]),
    ([2], "Failed", "PodFailurePolicy", 1, [2]),
    (["evict", "preempt", "succeed"], "Complete", None, 0, [143, 143, 0]),
    (["node_lost", "succeed"], "Complete", None, 0, [137, 0]),
    ([4, 5, "succeed"], "Complete", None, 2, [4, 5, 0]),
    (["oom", "oom", "oom", "oom"], "Failed", "BackoffLimitExceeded", 4, [137] * 4),
    (["deadline"], "Failed", "DeadlineExceeded", 1, [143]),
]


@pytest.mark.parametrize(("script", "end", "reason", "failed", "codes"), OUTCOMES,
                         ids=["succeed", "exit3", "exit2", "evicted-preempted", "node-lost",
                              "transient-then-ok", "oomkilled", "deadline"])
def test_simulated_outcomes_seen_through_the_client(
        sim: KubeSim, kube: KubeClient, cluster: JobSimulator, script: list[Any], end: str,
        reason: str | None, failed: int, codes: list[int]) -> None:
    """podFailurePolicy as the Job controller applies it: exit 2/3 fail at once, disruptions
    (eviction, preemption, node lost) retry without counting, the rest count against
    backoffLimit 3 (the 4th counted failure ends the Job). The controller sees it all
    through list_jobs / list_pods."""
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    for outcome in script:
        cluster.run(name)
        cluster.step(name, outcome)
    (stored,), _ = kube.list_jobs(NS, run_selector(RUN))
    assert job_finished(stored) == end
    if reason:
        conditions = {c["type"]: c for c in stored["status"]["conditions"]}
        assert conditions["Failed"]["reason"] == reason
    assert int(stored["status"].get("failed") or 0) == failed
    pods = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    seen = [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods]
    assert sorted(seen) == sorted(codes)
    if "oom" in script:
        assert {p["status"]["containerStatuses"][0]["state"]["terminated"]["reason"]
                for p in pods} == {"OOMKilled"}
    if "evict" in script or "node_lost" in script:
        disrupted = [c for p in pods for c in p["status"]["conditions"]
                     if c["type"] == "DisruptionTarget"]
        assert disrupted and all(c["status"] == "True" for c in disrupted)
    assert_stored_objects_valid(sim)


def test_failure_log_and_events(sim: KubeSim, kube: KubeClient, cluster: JobSimulator) -> None:
    """The last log lines (pods/log, and the FallbackToLogsOnError termination message) and
    why a pod is Pending (FailedScheduling events) are readable through the client."""
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    cluster.step(name, "pending")
    (pod,) = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    pod_name = pod["metadata"]["name"]
    scheduled = {c["type"]: c for c in pod["status"]["conditions"]}["PodScheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    (event,) = kube.list_events(NS, f"involvedObject.name={pod_name}")
    assert event["reason"] == "FailedScheduling" and "nvidia.com/gpu" in event["message"]
    assert kube.list_events(NS, "involvedObject.name=someone-else") == []
    assert kube.read_pod_log(NS, pod_name) == ""  # 400: the container never started

    log = "".join(f"line {i}\n" for i in range(100)) + "PermanentModelError: gated\n"
    cluster.run(name)
    cluster.fail(name, 3, log=log)
    assert kube.read_pod_log(NS, pod_name, tail_lines=2) == "line 99\nPermanentModelError: gated\n"
    (pod,) = kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")
    message = pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert message.endswith("PermanentModelError: gated\n")
    assert kube.read_pod_log(NS, "no-such-pod") == ""
    assert_stored_objects_valid(sim)


def test_delete_job_takes_its_pods(sim: KubeSim, kube: KubeClient,
                                   cluster: JobSimulator) -> None:
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    cluster.run(name)
    assert kube.read_job(NS, name) is not None
    assert kube.delete_job(NS, name) is True
    assert kube.delete_job(NS, name) is False
    assert kube.read_job(NS, name) is None
    assert kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}") == []


def test_kueue_job_waits_for_admission(sim: KubeSim, kube: KubeClient,
                                       cluster: JobSimulator) -> None:
    job = make_job(kueue_queue="gpu-queue")
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    with pytest.raises(RuntimeError, match="suspended"):
        cluster.start(name)
    assert cluster.admit(name)["spec"]["suspend"] is False
    assert job_finished(cluster.succeed(name)) == "Complete"


def test_autopilot_runs_every_job(sim: KubeSim, kube: KubeClient,
                                  cluster: JobSimulator) -> None:
    """The simulator on its own: each Job follows its script while the client watches."""
    refs: dict[str, list[Any]] = {
        "org/ok": ["succeed"], "org/gated": [3], "org/evicted": ["evict", "succeed"]}
    _, version = kube.list_jobs(NS, run_selector(RUN))

    def script(job: Mapping[str, Any]) -> list[Any]:
        return refs[job["metadata"]["annotations"]["esd-sweep/model-ref"]]

    ends: dict[str, str] = {}
    with cluster.autopilot(script):
        for ref in refs:
            kube.create_job(NS, make_job(ref, kueue_queue="q"))
        for event in kube.watch_jobs(NS, run_selector(RUN), version, timeout_s=10):
            end = job_finished(event.object)
            if end:
                ends[event.object["metadata"]["annotations"]["esd-sweep/model-ref"]] = end
            if len(ends) == len(refs):
                break
    assert ends == {"org/ok": "Complete", "org/gated": "Failed", "org/evicted": "Complete"}
    assert_stored_objects_valid(sim)


# -- harness and configuration ---------------------------------------------------------------


def test_emulator_validation_agrees_with_kubernetes_validate() -> None:
    """The emulator's cached validator is kubernetes-validate's strict check, only faster."""
    validator = StrictValidator(K8S_VERSION)
    good = make_job()
    assert validator.errors(good) == []
    kubernetes_validate.validate(good, K8S_VERSION, strict=True)
    bad = make_job()
    bad["spec"]["backoffLimit"] = "three"
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    errors = validator.errors(bad)
    assert len(errors) == 2 and any("backoffLimit" in e for e in errors)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_load_client_from_kubeconfig(sim: KubeSim, tmp_path: Path) -> None:
    """load_client reads a kubeconfig context (and its namespace); a missing context is a
    KubeConfigError that names it."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "sim", "cluster": {"server": sim.url}}],
        "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "u",
                                                 "namespace": "esd"}},
                     {"name": "other", "context": {"cluster": "sim", "user": "u"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    with load_client("sim", kubeconfig=str(path), retry=FAST) as client:
        assert client.default_namespace == "esd"
        assert client.create_job(NS, make_job()) == "created"
    with load_client(kubeconfig=str(path)) as client:
        assert client.default_namespace is None
    with pytest.raises(KubeConfigError, match="'nope'"):
        load_client("nope", kubeconfig=str(path))


SELECTORS = [
    # selector, the labels of the object, whether it matches
    ("a=1", {"a": "1"}, True),
    ("a==1,b!=2", {"a": "1", "b": "3"}, True),
    ("a!=1", {}, True),
    ("a in (1, 2),c", {"a": "2", "c": ""}, True),
    ("a notin (1,2)", {"a": "2"}, False),
    ("!a", {"a": "x"}, False),
    ("app.kubernetes.io/managed-by=esd-sweep,esd-sweep/run=r", {
        "app.kubernetes.io/managed-by": "esd-sweep", "esd-sweep/run": "r"}, True),
]


@pytest.mark.parametrize(("selector", "labels", "expected"), SELECTORS,
                         ids=[s for s, _, _ in SELECTORS])
def test_emulator_label_selectors(selector: str, labels: dict[str, str], expected: bool) -> None:
    """kmock 0.8 ignores selectors; the emulator applies them as the apiserver does."""
    obj = {"metadata": {"labels": labels}, "involvedObject": {"name": "p"}}
    assert Selector.parse(selector, None).matches(obj) is expected
    assert Selector.parse(selector, "involvedObject.name=p").matches(obj) is expected
    assert Selector.parse(None, "involvedObject.name!=p").matches(obj) is False


def test_delete_without_propagation_orphans_pods(sim: KubeSim, kube: KubeClient,
                                                 cluster: JobSimulator) -> None:
    """Why delete_job sends propagationPolicy=Background: the API's default for batch/v1
    Jobs orphans the pods, which would keep holding their GPUs."""
    job = make_job()
    name = job["metadata"]["name"]
    kube.create_job(NS, job)
    cluster.run(name)
    k8s.BatchV1Api(sim.api_client()).delete_namespaced_job(name, NS, _preload_content=False)
    assert len(kube.list_pods(NS, f"batch.kubernetes.io/job-name={name}")) == 1
