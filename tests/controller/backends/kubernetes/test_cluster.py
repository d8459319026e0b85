"""controller.backends.kubernetes.backend: the Kubernetes backend through the real `kubernetes` client against KubeSim.

Every Job the backend creates goes over HTTP to kmock's emulator, which validates it against
the strict Kubernetes 1.31 schemas (a bad object is a 422 and the test fails). JobSimulator
plays the Job controller and the kubelet; when a Job succeeds it first writes the model's
result.json marker into the test's store, as the real worker does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controller.backends.kubernetes.backend import (
    ClusterBackend,
    ClusterSettings,
    describe_pending,
    diagnose_failure,
    sweep_instance,
)
from controller.backends.kubernetes.client import KubeClient, RetryPolicy
from controller.backends.kubernetes.jobs import JobSettings, build_job, job_name
from controller.backends.local import Outcome
from controller.exporter import GpuReading, make_server
from controller.modellist import ModelRow
from esd_worker.store import MARKER_NAME, Store, open_store
from tests.support.cluster import NS, MarkerSimulator, wait_for
from tests.support.kubesim import KubeSim

RETRY = RetryPolicy(attempts=40, base_s=0.01, max_s=0.1, deadline_s=20.0)


def make_rows(n: int, prefix: str = "org/model") -> list[ModelRow]:
    return [ModelRow(model_id=f"{prefix}-{i}", revision=None, relation="", source_model=None)
            for i in range(n)]




@pytest.fixture
def sim() -> Iterator[KubeSim]:
    with KubeSim() as server:
        yield server


@pytest.fixture
def kube(sim: KubeSim) -> Iterator[KubeClient]:
    with KubeClient(sim.configuration(), retry=RETRY) as client:
        yield client


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "out"))


@pytest.fixture
def cluster(sim: KubeSim, store: Store) -> MarkerSimulator:
    simulator = MarkerSimulator(sim, namespace=NS)
    simulator.store = store
    return simulator


def make_backend(
    kube: KubeClient, store: Store, outcomes: list[Outcome] | None = None, *,
    max_retries: int = 2, gpus_per_job: int = 1, poll_interval_s: float = 0.02,
    max_checks: int = 1, **overrides: Any,
) -> ClusterBackend:
    options: dict[str, Any] = {"namespace": NS, "watch_timeout_s": 2, "telemetry": False,
                               "image": "ghcr.io/example/esd-sweep:0.1.0"}
    options.update(overrides)
    settings = ClusterSettings(**options)
    job_settings = settings.job_settings(
        run_id="20261123T070501Z-3fa9c2", instance=sweep_instance(store.url),
        gpus_per_job=gpus_per_job, worker_args=("--fix-fingers", "xmin_mid"))
    sink = outcomes if outcomes is not None else []
    return ClusterBackend(
        settings, kube, job_settings=job_settings, output_url=store.url,
        gpus_per_job=gpus_per_job, max_retries=max_retries, max_checks=max_checks,
        poll_interval_s=poll_interval_s, on_outcome=sink.append)


def by_attempt(scripts: Mapping[int, Sequence[Any]]) -> Callable[[Mapping[str, Any]], list[Any]]:
    """An autopilot script by the Job's attempt number (missing: succeed)."""
    def script(job: Mapping[str, Any]) -> list[Any]:
        attempt = int(job["metadata"]["labels"]["esd-sweep/attempt"])
        return list(scripts.get(attempt, ["succeed"]))
    return script


def job_names(sim: KubeSim) -> list[str]:
    return [j["metadata"]["name"] for j in sim.objects("jobs", NS)]


def run_in_thread(backend: ClusterBackend, rows: Sequence[ModelRow]) -> threading.Thread:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            backend.run(rows)
        except BaseException as e:  # surfaced by the test through .errors
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread




# -- the happy path ------------------------------------------------------------------------


def test_one_job_per_model_all_done(sim: KubeSim, kube: KubeClient, store: Store,
                                    cluster: MarkerSimulator) -> None:
    """Five models: five Jobs (one create each, every one schema-valid), five done outcomes
    whose markers are in the store; the worker args carry the analysis flags."""
    rows = make_rows(5)
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        make_backend(kube, store, outcomes).run(rows)
    assert sorted(o.task.key for o in outcomes) == sorted(r.key for r in rows)
    assert {o.status for o in outcomes} == {"done"}
    assert sim.count("create", "jobs") == 5
    assert sim.emulator.validated["Job"] >= 5  # creates, and the simulator's patches
    assert sorted(job_names(sim)) == sorted(job_name(r.key) for r in rows)
    for row in rows:
        assert store.exists(f"{row.key}/{MARKER_NAME}")
    args = sim.objects("jobs", NS)[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "esd-worker" and "--fix-fingers" in args and "--output" in args


# -- failures, retries, disruptions --------------------------------------------------------


@pytest.mark.parametrize(
    ("scripts", "status", "error", "attempts", "jobs"),
    [
        pytest.param({0: [3]}, "failed", "PermanentModelError", 1, 1, id="exit3-failjob"),
        pytest.param({0: ["oom"]}, "done", "", 2, 2, id="oomkilled-retried"),
        pytest.param({0: ["oom"], 1: ["oom"], 2: ["oom"]}, "failed",
                     "KilledBySignal: OOMKilled", 3, 3, id="oomkilled-every-time"),
        pytest.param({0: [4]}, "done", "", 2, 2, id="exit4-retried"),
        pytest.param({0: [5], 1: [5], 2: [5]}, "failed", "GpuOutOfMemoryError", 3, 3,
                     id="exit5-out-of-retries"),
        pytest.param({0: ["evict", "succeed"]}, "done", "", 1, 1, id="evicted-not-counted"),
        pytest.param({0: ["preempt", "node_lost", "succeed"]}, "done", "", 1, 1,
                     id="preempted-then-node-lost"),
        pytest.param({0: ["deadline"]}, "failed", "DeadlineExceeded", 1, 1,
                     id="deadline-not-retried"),
        pytest.param({0: [1]}, "failed", "WorkerCrashed", 1, 1, id="exit1-crash"),
    ],
)
def test_failures_are_classified_and_retried(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    scripts: dict[int, list[Any]], status: str, error: str, attempts: int, jobs: int,
) -> None:
    """The exit code contract decides: 3 fails the Job at once (podFailurePolicy FailJob) and
    is not resubmitted; 4/5 and OOMKilled (137) are resubmitted as `-a<N>` up to
    max_retries=2; evictions, preemptions and lost nodes (DisruptionTarget) are absorbed by
    the Job itself (Ignore) and cost no attempt; a deadline is not retried."""
    outcomes: list[Outcome] = []
    row = make_rows(1)[0]
    with cluster.autopilot(by_attempt(scripts)):
        make_backend(kube, store, outcomes).run([row])
    (outcome,) = outcomes
    assert outcome.status == status
    assert outcome.error.startswith(error)
    assert outcome.attempts == attempts
    assert sorted(job_names(sim)) == sorted(
        job_name(row.key, a) for a in range(jobs))
    assert sim.count("create", "jobs") == jobs
    if status == "failed" and isinstance(scripts[0][0], int):
        assert outcome.exit_code == scripts[0][0]
        assert outcome.stderr_tail[-1] == f"worker exited with {scripts[0][0]}"
        assert outcome.log_path and outcome.log_path.startswith("pod/")


def test_oom_record_names_host_memory(sim: KubeSim, kube: KubeClient, store: Store,
                                      cluster: MarkerSimulator) -> None:
    """OOMKilled is read from the worker container's terminated state, with its log tail."""
    outcomes: list[Outcome] = []
    row = make_rows(1)[0]
    name = job_name(row.key)

    def drive() -> None:
        wait_for(lambda: name in job_names(sim))
        cluster.run(name)
        cluster.oom_kill(name, log="loading shard 3/4\nKilled\n")

    driver = threading.Thread(target=drive)
    driver.start()
    make_backend(kube, store, outcomes, max_retries=0).run([row])
    driver.join()
    (outcome,) = outcomes
    assert "OOMKilled" in outcome.error and "host memory" in outcome.error
    assert outcome.exit_code == 137 and outcome.signal == 9 and outcome.retryable
    assert outcome.stderr_tail == ("loading shard 3/4", "Killed")
    assert sim.count("get", "pods/log") == 1


# -- API faults ----------------------------------------------------------------------------


def test_lost_create_response_is_adopted_not_duplicated(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """The create lands but the answer is a 500: the client retries, meets 409, reads the
    Job, sees it is this sweep's, and adopts it: one Job, done."""
    sim.fail("create", "jobs", status=500, committed=True)
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        make_backend(kube, store, outcomes).run(make_rows(1))
    assert [o.status for o in outcomes] == ["done"]
    assert sim.count("create", "jobs") == 2 and len(job_names(sim)) == 1
    assert sim.count("get", "jobs") == 1


def test_409_from_another_sweep_is_a_clear_error(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """A Job of that name exists but writes elsewhere: not adopted, never overwritten; the
    model fails with a message saying what to do."""
    row = make_rows(1)[0]
    other = build_job(
        model_ref=row.ref, model_key=row.key, relation="", source_model=None,
        output_url="s3://other-bucket/atlas",
        settings=JobSettings(image="img:1", namespace=NS, run_id="other",
                             sweep_name=sweep_instance("s3://other-bucket/atlas")))
    assert kube.create_job(NS, other) == "created"
    outcomes: list[Outcome] = []
    make_backend(kube, store, outcomes).run([row])
    (outcome,) = outcomes
    assert outcome.status == "failed" and not outcome.retryable
    assert outcome.error.startswith("JobNameTaken:")
    assert "s3://other-bucket/atlas" in outcome.error and "--namespace" in outcome.error
    assert len(job_names(sim)) == 1


def test_500_bursts_and_api_down_lose_nothing(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """500s on create, list, watch and pod reads, then the API down for a second mid-run:
    everything finishes once, no Job twice."""
    rows = make_rows(6)
    sim.fail("create", "jobs", status=500, times=3)
    sim.fail("list", "jobs", status=503, times=2)
    sim.fail("watch", "jobs", status=500, times=2)
    outcomes: list[Outcome] = []
    backend = make_backend(kube, store, outcomes, max_active_jobs=3)
    with cluster.autopilot(by_attempt({0: [4]})):
        thread = run_in_thread(backend, rows)
        wait_for(lambda: len(outcomes) >= 1)
        sim.api_down(1.0)
        thread.join(30)
    assert not thread.errors  # type: ignore[attr-defined]
    assert sorted(o.task.key for o in outcomes) == sorted(r.key for r in rows)
    assert {o.status for o in outcomes} == {"done"}
    names = job_names(sim)
    assert len(names) == len(set(names)) == 12  # each model: its Job and one retry


def test_410_gone_on_watch_relists(sim: KubeSim, kube: KubeClient, store: Store,
                                   cluster: MarkerSimulator) -> None:
    """Watches expire (410 Gone) repeatedly during the run: the backend lists again and
    misses no ending."""
    rows = make_rows(8)
    outcomes: list[Outcome] = []
    backend = make_backend(kube, store, outcomes, max_active_jobs=2)
    with cluster.autopilot():
        thread = run_in_thread(backend, rows)
        for _ in range(4):
            wait_for(lambda: sim.count("watch", "jobs") >= 1)
            sim.expire_watches()
            time.sleep(0.1)
        sim.compact()
        thread.join(30)
    assert not thread.errors  # type: ignore[attr-defined]
    assert len(outcomes) == 8 and {o.status for o in outcomes} == {"done"}
    assert sim.count("list", "jobs") >= 2  # the first list plus at least one relist
    assert sim.count("create", "jobs") == 8


def test_rbac_denied_stops_with_the_missing_verb(sim: KubeSim, kube: KubeClient,
                                                 store: Store) -> None:
    """403 on create is not retried; the error names the verb and resource to grant."""
    from controller.backends.kubernetes.client import KubePermissionError

    sim.forbid("create", "jobs", namespace=NS)
    with pytest.raises(KubePermissionError, match=r"cannot create jobs\.batch"):
        make_backend(kube, store).run(make_rows(1))
    assert sim.count("create", "jobs") == 1


# -- restarts ------------------------------------------------------------------------------


def test_restart_adopts_running_jobs_and_never_submits_twice(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """A controller stops (request_stop: it leaves at once, like a crash, since nothing it
    holds matters to the cluster) with Jobs running; a second controller lists them, adopts
    the unfinished ones, counts the one that completed in between, and creates only the
    Jobs still missing."""
    rows = make_rows(5)
    first = make_backend(kube, store, max_active_jobs=3)
    thread = run_in_thread(first, rows)
    wait_for(lambda: len(job_names(sim)) == 3)
    first.request_stop()
    thread.join(10)
    assert sorted(first.left_running) == sorted(job_names(sim))
    cluster.succeed(job_names(sim)[0])  # ends while no controller watches

    outcomes: list[Outcome] = []
    second = make_backend(kube, store, outcomes)
    with cluster.autopilot():
        second.run(rows)
    assert second.adopted == 3 and second.created == 2
    assert sim.count("create", "jobs") == 5
    assert sorted(job_names(sim)) == sorted(job_name(r.key) for r in rows)
    assert sorted(o.task.key for o in outcomes) == sorted(r.key for r in rows)
    assert {o.status for o in outcomes} == {"done"}


def test_failed_job_of_an_earlier_run_gets_a_new_attempt(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """A Job that failed while no controller ran is history: the next run submits `-a1`."""
    row = make_rows(1)[0]
    first = make_backend(kube, store, wait=False)
    first.run([row])
    cluster.fail(job_name(row.key), 4, log="connection reset\n")
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        make_backend(kube, store, outcomes).run([row])
    assert [o.status for o in outcomes] == ["done"]
    assert sorted(job_names(sim)) == [job_name(row.key), job_name(row.key, 1)]


def test_other_parameters_are_not_adopted(sim: KubeSim, kube: KubeClient, store: Store,
                                          cluster: MarkerSimulator) -> None:
    """A running Job of the same model and output but other analysis flags is not this
    sweep's work: the next attempt number is used instead of adopting it."""
    row = make_rows(1)[0]
    make_backend(kube, store, wait=False).run([row])
    settings = ClusterSettings(namespace=NS, watch_timeout_s=2, telemetry=False)
    job_settings = settings.job_settings(
        run_id="r2", instance=sweep_instance(store.url), gpus_per_job=1,
        worker_args=("--fix-fingers", "DKS"))
    outcomes: list[Outcome] = []
    backend = ClusterBackend(settings, kube, job_settings=job_settings,
                             output_url=store.url, on_outcome=outcomes.append)
    with cluster.autopilot():
        backend.run([row])
    assert backend.adopted == 0
    assert job_name(row.key, 1) in job_names(sim)


def test_restart_with_another_log_format_still_adopts(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """The in-cluster controller logs JSON; a person re-running the sweep from a laptop
    logs text. The worker's --log-format (and --device) do not change what it computes or
    where it writes: the running Job is adopted, not submitted a second time."""
    row = make_rows(1)[0]
    make_backend(kube, store, wait=False).run([row])
    settings = ClusterSettings(namespace=NS, watch_timeout_s=2, telemetry=False,
                               image="ghcr.io/example/esd-sweep:0.1.0")
    job_settings = settings.job_settings(
        run_id="r2", instance=sweep_instance(store.url), gpus_per_job=1,
        worker_args=("--fix-fingers", "xmin_mid"), log_format="text")
    outcomes: list[Outcome] = []
    backend = ClusterBackend(settings, kube, job_settings=job_settings,
                             output_url=store.url, on_outcome=outcomes.append)
    with cluster.autopilot():
        backend.run([row])
    assert backend.adopted == 1 and backend.created == 0
    assert job_names(sim) == [job_name(row.key)]
    assert [o.status for o in outcomes] == ["done"]


def test_full_resource_quota_waits_instead_of_failing_the_sweep(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """403 "exceeded quota" on create is a full ResourceQuota, not missing RBAC: the model
    goes back to the queue and is submitted once the quota has room; nothing fails."""
    rows = make_rows(2)
    sim.fail("create", "jobs", status=403, times=3, reason="Forbidden",
             message='jobs.batch "x" is forbidden: exceeded quota: gpu-jobs, requested: '
                     "count/jobs.batch=1, used: count/jobs.batch=8, limited: "
                     "count/jobs.batch=8")
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        make_backend(kube, store, outcomes).run(rows)
    assert sorted(o.status for o in outcomes) == ["done", "done"]
    assert sorted(job_names(sim)) == sorted(job_name(r.key) for r in rows)


# -- placement -----------------------------------------------------------------------------


def _exporter(node: str, used: Sequence[float]) -> tuple[ThreadingHTTPServer, str]:
    readings = [GpuReading(i, f"GPU-{node}-{i}", "NVIDIA H100 80GB HBM3", u, 81559.0 - u,
                           81559.0) for i, u in enumerate(used)]
    server = make_server("127.0.0.1", 0, lambda: list(readings), node, cache_s=0.0)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_jobs_go_to_nodes_whose_gpus_have_room(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """Telemetry from the real exporter HTTP server: node-a's GPUs are busy, node-b has one
    idle GPU. Every Job is pinned to node-b, one at a time (the reservation holds until the
    pod runs there)."""
    busy, busy_url = _exporter("node-a", [30000.0, 41000.0])
    idle, idle_url = _exporter("node-b", [0.0, 52000.0])
    try:
        outcomes: list[Outcome] = []
        backend = make_backend(kube, store, outcomes, telemetry=True,
                               telemetry_urls=(busy_url, idle_url), max_checks=2)
        with cluster.autopilot():
            backend.run(make_rows(3))
    finally:
        for server in (busy, idle):
            server.shutdown()
            server.server_close()
    assert backend.placement == "telemetry"
    assert {o.status for o in outcomes} == {"done"}
    for job in sim.objects("jobs", NS):
        terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        # The exact node name (matchFields), which the exporter reports from spec.nodeName:
        # the kubernetes.io/hostname label differs from it under --hostname-override.
        assert terms == [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}]


def test_exporter_pods_are_found_by_selector(sim: KubeSim, kube: KubeClient,
                                             store: Store) -> None:
    """Without URLs, exporter pods are listed by label in their namespace and scraped at
    http://<pod IP>:<port>/metrics, with the pod's node as the default node."""
    api = sim.api_client(bypass=True)
    from kubernetes import client as k8s

    core = k8s.CoreV1Api(api)
    for i, phase in enumerate(("Running", "Pending")):
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"exporter-{i}", "namespace": "gpu",
            "labels": {"app.kubernetes.io/name": "esd-gpu-exporter"}},
            "spec": {"nodeName": f"node-{i}", "containers": [{"name": "x", "image": "x"}]}}
        core.create_namespaced_pod("gpu", body)
        core.patch_namespaced_pod_status(f"exporter-{i}", "gpu", {"status": {
            "phase": phase, "podIP": f"10.0.0.{i + 1}"}},
            _content_type="application/merge-patch+json")
    scraped: list[tuple[str, str | None]] = []

    def fake_scrape(url: str, *, default_node: str | None = None) -> list[Any]:
        scraped.append((url, default_node))
        return []

    backend = make_backend(kube, store, telemetry=True, telemetry_namespace="gpu",
                           telemetry_port=9400)
    backend._scrape = fake_scrape
    backend._poll_telemetry(0.0)
    assert scraped == [("http://10.0.0.1:9400/metrics", "node-0")]
    assert backend.placement == "plain"


def test_without_telemetry_jobs_are_plain_and_it_is_said_once(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No exporter pods: Jobs request nvidia.com/gpu without affinity; one log line says so."""
    caplog.set_level(logging.INFO, logger="controller.backends.kubernetes.backend")
    with cluster.autopilot():
        backend = make_backend(kube, store, telemetry=True)
        backend.run(make_rows(3))
    for job in sim.objects("jobs", NS):
        spec = job["spec"]["template"]["spec"]
        assert "affinity" not in spec
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    said = [r for r in caplog.records if "no GPU telemetry" in r.getMessage()]
    assert len(said) == 1 and "no GPU exporter pods" in said[0].getMessage()


def test_allow_pending_submits_unpinned_up_to_max_pending(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """Every GPU busy, autoscaling allowed: Jobs go out without node affinity (so the
    autoscaler adds nodes), but no more than --max-pending waiting at once; with
    --do-not-disrupt the pods carry Karpenter's annotation."""
    busy, url = _exporter("node-a", [30000.0])
    try:
        backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url,),
                               allow_pending=True, max_pending=2, wait=False,
                               do_not_disrupt=True)
        backend._poll_telemetry(0.0)
        backend.run(make_rows(5))
    finally:
        busy.shutdown()
        busy.server_close()
    jobs = sim.objects("jobs", NS)
    assert len(jobs) == 2
    for job in jobs:
        template = job["spec"]["template"]
        assert "affinity" not in template["spec"]
        assert template["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


def test_max_active_jobs_caps_submissions(sim: KubeSim, kube: KubeClient,
                                          store: Store) -> None:
    """--no-wait with a cap of 2: two Jobs, then the controller returns leaving them."""
    backend = make_backend(kube, store, max_active_jobs=2, wait=False)
    assert backend.run(make_rows(5)) == []
    assert len(job_names(sim)) == 2 and len(backend.left_running) == 2


# -- pending diagnosis and Kueue -----------------------------------------------------------


def test_pending_too_long_is_explained(sim: KubeSim, kube: KubeClient, store: Store,
                                       cluster: MarkerSimulator) -> None:
    """An unschedulable pod: after --pending-timeout the reason (Insufficient nvidia.com/gpu)
    from the pod's PodScheduled condition is in `pending` (the run report's section)."""
    row = make_rows(1)[0]
    backend = make_backend(kube, store, pending_timeout_s=0.2)
    with cluster.autopilot(["pending"]):
        thread = run_in_thread(backend, [row])
        reason = wait_for(lambda: backend.pending.get(row.key))
        backend.request_stop()
        thread.join(10)
    assert reason.startswith("Unschedulable:") and "Insufficient nvidia.com/gpu" in reason
    assert sim.count("list", "events") >= 1


def test_kueue_jobs_are_created_suspended_and_run_once_admitted(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    outcomes: list[Outcome] = []
    with cluster.autopilot(admit=True):
        make_backend(kube, store, outcomes, kueue_queue="gpu-queue").run(make_rows(2))
    assert {o.status for o in outcomes} == {"done"}
    for job in sim.objects("jobs", NS):
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"


# -- pure diagnosis ------------------------------------------------------------------------


def _pod(*, exit_code: int | None = None, reason: str = "Error",
         conditions: Sequence[Mapping[str, Any]] = (), phase: str = "Failed",
         status_reason: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": list(conditions)}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": {
            "exitCode": exit_code, "reason": reason, "message": "last line\n"}}}]
    if status_reason:
        status["reason"] = status_reason
        status["message"] = "The node was low on resource: ephemeral-storage."
    return {"metadata": {"name": "p", "creationTimestamp": "2026-11-23T07:00:00Z",
                         "resourceVersion": "5"}, "spec": {"nodeName": "n1"}, "status": status}


def _failed_job(reason: str, message: str = "m") -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": reason,
                                       "message": message}]}}


@pytest.mark.parametrize(
    ("job_reason", "pod", "error", "retryable"),
    [
        pytest.param("PodFailurePolicy", _pod(exit_code=3), "PermanentModelError", False,
                     id="exit3"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=4), "TransientError", True,
                     id="exit4"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=137, reason="OOMKilled"),
                     "KilledBySignal: OOMKilled", True, id="oomkilled"),
        pytest.param("BackoffLimitExceeded", _pod(exit_code=143, conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
             "message": "preempted"}]), "Disrupted: PreemptionByScheduler", True,
            id="disruption"),
        pytest.param("BackoffLimitExceeded", _pod(status_reason="Evicted"), "Evicted:", True,
                     id="kubelet-eviction"),
        pytest.param("DeadlineExceeded", _pod(exit_code=143), "DeadlineExceeded", False,
                     id="deadline"),
        pytest.param("BackoffLimitExceeded", None, "JobFailed: BackoffLimitExceeded", True,
                     id="no-pod"),
    ],
)
def test_diagnose_failure(job_reason: str, pod: dict[str, Any] | None, error: str,
                          retryable: bool) -> None:
    """records.classify_exit decides for exit codes; the pod's own state adds what only
    Kubernetes knows (OOMKilled, disruption, eviction, deadline)."""
    found = diagnose_failure(_failed_job(job_reason), [pod] if pod else [], "")
    assert found.error.startswith(error)
    assert found.retryable is retryable
    if pod and "containerStatuses" in pod["status"]:
        assert found.tail == ("last line",)  # the termination message without a log


@pytest.mark.parametrize(
    ("job", "pods", "events", "expected"),
    [
        pytest.param({"spec": {"suspend": True}}, [], [], "suspended: waiting for Kueue",
                     id="kueue"),
        pytest.param({"spec": {}}, [_pod(phase="Pending", conditions=[{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 node(s) had untolerated taint "
                       "{dedicated: infra}."}])], [], "Unschedulable: 0/3 nodes are "
                       "available: 3 node(s) had untolerated taint", id="taint"),
        pytest.param({"spec": {}}, [], [{"type": "Warning", "reason": "FailedCreate",
                                         "message": 'pods "x" is forbidden: exceeded quota: '
                                                    'gpu-quota', "lastTimestamp": "t"}],
                     "FailedCreate: pods \"x\" is forbidden: exceeded quota", id="quota"),
    ],
)
def test_describe_pending(job: dict[str, Any], pods: list[dict[str, Any]],
                          events: list[dict[str, Any]], expected: str) -> None:
    assert describe_pending(job, pods, events).startswith(expected)


def test_no_wait_with_telemetry_waits_for_the_checks(sim: KubeSim, kube: KubeClient,
                                                     store: Store) -> None:
    """GPUs count as free only after --max-checks polls: --no-wait does not give up before
    then, and submits pinned Jobs once the idle GPUs qualify."""
    idle, url = _exporter("node-b", [0.0, 0.0])
    try:
        backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url,),
                               max_checks=3, wait=False)
        backend.run(make_rows(3))
    finally:
        idle.shutdown()
        idle.server_close()
    assert len(job_names(sim)) == 2  # two idle GPUs, reserved until the pods run
    assert backend._polls >= 3
