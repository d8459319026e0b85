"""controller.backends.kubernetes.common.client through the real `kubernetes` client against kmock
(tests/support/kubesim.py).

Everything goes over HTTP: KubeClient → kubernetes.client → kmock's KubernetesEmulator.
Every object written (the controller's Jobs, the simulator's pods, status patches and
events) is validated by the emulator against the strict Kubernetes 1.31 schemas; the
tests also run kubernetes_validate.validate on what ends up stored.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s

from controller.backends.kubernetes.common.client import (
    KubeClient,
    RetryPolicy,
    WatchEvent,
    load_client,
)
from controller.backends.kubernetes.common.errors import (
    KubeConfigError,
    KubeInvalidError,
    KubePermissionError,
    KubeQuotaError,
    KubeUnavailableError,
    ResourceVersionExpired,
)
from controller.backends.kubernetes.common.names import job_name, run_selector
from esd_worker.core.models.naming import model_key
from tests.support.cluster import FAST, NS, RUN, assert_stored_objects_valid, make_job, watch_until
from tests.support.kubesim import (
    K8S_VERSION,
    JobSimulator,
    KubeSim,
    Selector,
    StrictValidator,
    job_finished,
)


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
    ("get", "podtemplates", lambda k: k.read_pod_template(NS, "esd-sweep-worker"),
     "cannot get podtemplates in namespace esd: add verb get on podtemplates"),
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
