"""controller.backends.kubernetes.per_model.backend: KubernetesBackend through the real `kubernetes`
client against KubeSim.

Every Job the backend creates goes over HTTP to kmock's emulator, which validates it against
the strict Kubernetes 1.31 schemas (a bad object is a 422 and the test fails). JobSimulator
plays the Job controller and the kubelet; when a Job succeeds it first writes the model's
result.json marker into the test's store, as the real worker does.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.errors import KubePermissionError
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import job_name
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.per_model.backend import KubernetesBackend
from controller.errors import InfrastructureError, SweepError
from controller.settings import SweepSettings
from esd_worker.core.command.invocation import MODEL, WorkerInvocation
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import MARKER_NAME
from esd_worker.core.store.stores import Store
from tests.support.cluster import (
    IMAGE,
    NS,
    RUN_ID,
    MarkerSimulator,
    by_attempt,
    job_names,
    make_backend,
    make_rows,
    run_in_thread,
    run_models,
    wait_for,
)
from tests.support.kubesim import K8S_VERSION, KubeSim

# -- the happy path ------------------------------------------------------------------------


def test_one_job_per_model_all_done(sim: KubeSim, kube: KubeClient, store: Store,
                                    cluster: MarkerSimulator) -> None:
    """Five models: five Jobs (one create each, every one schema-valid), five done outcomes
    whose markers are in the store; the worker args carry the analysis flags."""
    rows = make_rows(5)
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        run_models(make_backend(kube, store), rows, outcomes)
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
        pytest.param({0: [6]}, "done", "", 2, 2, id="exit6-broken-gpu-retried"),
        pytest.param({0: [6], 1: [6], 2: [6]}, "failed", "DeviceError", 3, 3,
                     id="exit6-out-of-retries-still-retryable"),
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
    is not resubmitted; 4/5/6 and OOMKilled (137) are resubmitted as `-a<N>` up to
    max_retries=2; evictions, preemptions and lost nodes (DisruptionTarget) are absorbed by
    the Job itself (Ignore) and cost no attempt; a deadline is not retried."""
    outcomes: list[Outcome] = []
    row = make_rows(1)[0]
    with cluster.autopilot(by_attempt(scripts)):
        run_models(make_backend(kube, store), [row], outcomes)
    (outcome,) = outcomes
    assert outcome.status == status
    assert outcome.error.startswith(error)
    assert outcome.attempts == attempts
    if status == "failed":  # a broken GPU stays retryable: the next run tries the model
        assert outcome.retryable is (error in ("KilledBySignal: OOMKilled",
                                               "GpuOutOfMemoryError", "DeviceError"))
    assert sorted(job_names(sim)) == sorted(
        job_name(row.key, a) for a in range(jobs))
    assert sim.count("create", "jobs") == jobs
    if status == "failed" and isinstance(scripts[0][0], int):
        assert outcome.exit_code == scripts[0][0]
        assert outcome.stderr_tail[-1] == f"worker exited with {scripts[0][0]}"
        # Where it ran: the failed pod and its node (the Outcome has no log file).
        assert outcome.where.startswith(f"pod={NS}/{job_name(row.key, attempts - 1)}-")
        assert " node=" in outcome.where and outcome.log_path is None


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
    run_models(make_backend(kube, store, max_retries=0), [row], outcomes)
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
        run_models(make_backend(kube, store), make_rows(1), outcomes)
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
    run_models(make_backend(kube, store), [row], outcomes)
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
    backend = make_backend(kube, store, max_active_jobs=3)
    with cluster.autopilot(by_attempt({0: [4]})):
        thread = run_in_thread(backend, rows, outcomes)
        wait_for(lambda: len(outcomes) >= 1)
        sim.api_down(1.0)
        thread.join(30)
    assert not thread.errors  # type: ignore[attr-defined]
    assert sorted(o.task.key for o in outcomes) == sorted(r.key for r in rows)
    assert {o.status for o in outcomes} == {"done"}
    names = job_names(sim)
    assert len(names) == len(set(names)) == 12  # each model: its Job and one retry


def test_rbac_denied_stops_with_the_missing_verb(sim: KubeSim, kube: KubeClient,
                                                 store: Store) -> None:
    """403 on create is not retried; the error names the verb and resource to grant, and
    leaves the backend as the sweep's InfrastructureError (exit 3) caused by the client's
    KubePermissionError."""
    sim.forbid("create", "jobs", namespace=NS)
    with pytest.raises(InfrastructureError, match=r"cannot create jobs\.batch") as raised:
        run_models(make_backend(kube, store), make_rows(1))
    assert isinstance(raised.value.__cause__, KubePermissionError)
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
    second = make_backend(kube, store)
    with cluster.autopilot():
        run_models(second, rows, outcomes)
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
    run_models(first, [row])
    cluster.fail(job_name(row.key), 4, log="connection reset\n")
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        run_models(make_backend(kube, store), [row], outcomes)
    assert [o.status for o in outcomes] == ["done"]
    assert sorted(job_names(sim)) == [job_name(row.key), job_name(row.key, 1)]


def test_other_parameters_are_not_adopted(sim: KubeSim, kube: KubeClient, store: Store,
                                          cluster: MarkerSimulator) -> None:
    """A running Job of the same model and output but other analysis flags is not this
    sweep's work: the next attempt number is used instead of adopting it."""
    row = make_rows(1)[0]
    run_models(make_backend(kube, store, wait=False), [row])
    settings = ClusterSettings(namespace=NS, watch_timeout_s=2, telemetry=False)
    job_settings = settings.job_settings(
        run_id="r2", instance=sweep_instance(store.url), gpus_per_job=1,
        worker=WorkerInvocation(MODEL, log_format="json",
                                analysis=AnalysisSettings(fix_fingers="DKS")))
    outcomes: list[Outcome] = []
    backend = KubernetesBackend(settings, kube, job_settings=job_settings,
                                output_url=store.url)
    with cluster.autopilot():
        run_models(backend, [row], outcomes)
    assert backend.adopted == 0
    assert job_name(row.key, 1) in job_names(sim)


def test_restart_with_another_log_format_still_adopts(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """The in-cluster controller logs JSON; a person re-running the sweep from a laptop
    logs text. The worker's --log-format (and --device) do not change what it computes or
    where it writes: the running Job is adopted, not submitted a second time."""
    row = make_rows(1)[0]
    run_models(make_backend(kube, store, wait=False), [row])
    settings = ClusterSettings(namespace=NS, watch_timeout_s=2, telemetry=False,
                               image="ghcr.io/example/esd-sweep:0.1.0")
    job_settings = settings.job_settings(
        run_id="r2", instance=sweep_instance(store.url), gpus_per_job=1,
        worker=WorkerInvocation(MODEL, log_format="text"))
    outcomes: list[Outcome] = []
    backend = KubernetesBackend(settings, kube, job_settings=job_settings,
                                output_url=store.url)
    with cluster.autopilot():
        run_models(backend, [row], outcomes)
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
        run_models(make_backend(kube, store), rows, outcomes)
    assert sorted(o.status for o in outcomes) == ["done", "done"]
    assert sorted(job_names(sim)) == sorted(job_name(r.key) for r in rows)


def test_max_active_jobs_caps_submissions(sim: KubeSim, kube: KubeClient,
                                          store: Store) -> None:
    """--no-wait with a cap of 2: two Jobs, then the controller returns leaving them."""
    backend = make_backend(kube, store, max_active_jobs=2, wait=False)
    assert run_models(backend, make_rows(5)) == []
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
        run_models(make_backend(kube, store, kueue_queue="gpu-queue"), make_rows(2),
                   outcomes)
    assert {o.status for o in outcomes} == {"done"}
    for job in sim.objects("jobs", NS):
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"


# -- the Backend contract: building, dry runs, the report, Outcome.where ----------------------


def sweep_settings(output: str, **overrides: Any) -> SweepSettings:
    cluster = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False, watch_timeout_s=2,
                              **overrides.pop("cluster", {}))
    return SweepSettings(output=output, backend="kubernetes", cluster=cluster, **overrides)


@pytest.mark.parametrize(
    ("output", "allow_local", "dry_run", "refused"),
    [
        pytest.param("/data/out", False, False, True, id="local-path-refused"),
        pytest.param("file:///data/out", False, False, True, id="file-url-refused"),
        pytest.param("/data/out", True, False, False, id="allowed-shared-volume"),
        pytest.param("/data/out", False, True, False, id="dry-run-not-checked"),
        pytest.param("s3://bucket/atlas", False, False, False, id="object-storage"),
    ],
)
def test_from_settings_checks_the_output(
    kube: KubeClient, output: str, allow_local: bool, dry_run: bool, refused: bool,
) -> None:
    """Pods cannot see the controller's disk: a local output needs --allow-local-output (a
    volume mounted at the same path in every pod); a dry run creates nothing, so it is
    not asked."""
    settings = sweep_settings(output, dry_run=dry_run,
                              cluster={"allow_local_output": allow_local})
    spec = WorkerSpec(run_id=RUN_ID, store_url=output)
    if refused:
        with pytest.raises(SweepError, match="--allow-local-output"):
            KubernetesBackend.from_settings(settings, spec, kube=kube)
    else:
        KubernetesBackend.from_settings(settings, spec, kube=kube).close()


def test_dry_run_prints_valid_jobs_and_creates_nothing(sim: KubeSim, tmp_path: Path) -> None:
    """--dry-run: no client is opened (no kubeconfig needed), the first-attempt Job of each
    model is printed as YAML that the strict 1.31 schema accepts, nothing reaches the API."""
    settings = sweep_settings(str(tmp_path / "out"), dry_run=True)
    spec = WorkerSpec(run_id=RUN_ID, store_url=str(tmp_path / "out"))
    backend = KubernetesBackend.from_settings(settings, spec)
    assert backend.kube is None
    rows = make_rows(3)
    out = io.StringIO()
    assert backend.dry_run([Task.for_model(r) for r in rows], out) == 3
    docs = list(yaml.safe_load_all(out.getvalue()))
    assert [d["metadata"]["name"] for d in docs] == [job_name(r.key) for r in rows]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert sim.count("create", "jobs") == 0


def test_dry_run_reports_every_bad_model_at_once(tmp_path: Path) -> None:
    """Model ids are untrusted: one that reads as a flag cannot become a Job. Every such
    problem is reported in one SweepError, joined with "; ", and nothing is printed."""
    settings = sweep_settings(str(tmp_path / "out"), dry_run=True)
    backend = KubernetesBackend.from_settings(
        settings, WorkerSpec(run_id=RUN_ID, store_url=str(tmp_path / "out")))
    rows = [ModelRow(model_id=f"-bad{i}", revision=None, relation="", source_model=None)
            for i in range(2)]
    out = io.StringIO()
    with pytest.raises(SweepError) as raised:
        backend.dry_run([Task.for_model(r) for r in rows], out)
    assert str(raised.value).count("; model=") == 1
    assert "model=-bad0:" in str(raised.value) and "model=-bad1:" in str(raised.value)
    assert out.getvalue() == ""


def test_report_and_where(sim: KubeSim, kube: KubeClient, store: Store,
                          cluster: MarkerSimulator) -> None:
    """The report has exactly the run report's keys; a done model's Outcome says which
    Job ran it (no pod was read), the Task is the one given, and there is no log file."""
    settings = sweep_settings(store.url, cluster={"allow_local_output": True})
    spec = WorkerSpec(run_id=RUN_ID, store_url=store.url)
    backend = KubernetesBackend.from_settings(settings, spec, kube=kube)
    tasks = [Task.for_model(r) for r in make_rows(2)]
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        backend.run(tasks, outcomes.append)
    assert len(outcomes) == 2 and {o.status for o in outcomes} == {"done"}
    for outcome in outcomes:
        assert outcome.task in tasks
        assert outcome.where == f"job={NS}/{job_name(outcome.task.key)}"
        assert outcome.log_path is None and outcome.gpus == ()
    report = backend.report()
    assert report == {
        "device": "cuda", "gpus": [], "running": 0,
        "kubernetes": {
            "namespace": NS, "instance": sweep_instance(store.url), "image": IMAGE,
            "placement": "plain", "jobs_created": 2, "jobs_adopted": 0,
            "jobs_left_running": [], "pending": {}, "api_requests": kube.requests,
            "waited": True,
        },
    }
    assert backend.stop_notice(1) == backend.stop_notice(2) == (
        "stopping: no new Jobs; submitted Jobs keep running on the cluster "
        "(the next run adopts them)")
    backend.close()
    assert kube.read_job(NS, "gone") is None  # not opened by the backend: still open


def test_cpu_device_asks_for_no_gpu(kube: KubeClient, store: Store) -> None:
    """--device cpu: Jobs request no GPU whatever --gpus-per-job says, and the report says
    cpu."""
    settings = sweep_settings(store.url, device="cpu", cluster={"allow_local_output": True})
    backend = KubernetesBackend.from_settings(
        settings, WorkerSpec(run_id=RUN_ID, store_url=store.url), kube=kube)
    assert backend.report()["device"] == "cpu" and backend.gpus_per_job == 0
    assert backend.job_settings.gpus_per_job == 0


def test_a_custom_command_is_refused(kube: KubeClient, store: Store) -> None:
    backend = make_backend(kube, store)
    with pytest.raises(SweepError, match="local backend only"):
        backend.run([Task(key="cmd-1", label="echo hi", argv=("echo", "hi"))],
                    lambda outcome: None)
