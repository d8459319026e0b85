"""The sharded Kubernetes backend against the simulated cluster: Indexed Jobs over shards.

The controller (ShardedBackend, real KubeClient over HTTP to KubeSim, every object validated
strictly for Kubernetes 1.31) runs against tests.support.indexed.IndexedJobSimulator, whose
pods run the worker's real batch loop on their shard (tests.support.shardworker: only the
analysis is scripted). Outcomes come from the store, as in a real run.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from ruamel.yaml import YAML

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.names import MODE_LABEL
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.sharded.backend import ShardedBackend
from controller.backends.kubernetes.sharded.plan import default_classes
from controller.errors import SweepError
from controller.run.recorder import Recorder
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import list_markers, shard_prefix
from esd_worker.core.store.records import read_failure
from esd_worker.core.store.stores import Store
from tests.support.cluster import IMAGE, NS, RETRY, wait_for
from tests.support.indexed import Exit, IndexedJobSimulator
from tests.support.indexed import Outcome as PodOutcome
from tests.support.kubesim import KubeSim, condition
from tests.support.shardworker import ShardWorker

RUN_A = "20261123T070501Z-aaaaaa"
RUN_B = "20261123T080501Z-bbbbbb"
GB = 10**9


def rows(names: Sequence[str], size: int = GB) -> list[ModelRow]:
    return [ModelRow(model_id=f"org/{n}", revision=None, relation="", source_model=None,
                     metadata={"size_bytes": str(size)}) for n in names]


def backend_for(kube: KubeClient, store: Store, *, run_id: str = RUN_A, max_parallel: int = 4,
                base_size: Callable[[str], int] | None = None,
                **overrides: Any) -> ShardedBackend:
    settings = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False,
                               poll_interval_s=0.02, max_parallel=max_parallel, **overrides)
    spec = WorkerSpec(run_id=run_id, store_url=store.url, max_retries=2)
    job_settings = settings.job_settings(run_id=run_id, instance=sweep_instance(store.url),
                                         gpus_per_job=1, worker=spec.invocation())
    return ShardedBackend(
        settings, kube, spec=spec, job_settings=job_settings, store=store,
        classes=default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB),
        size=lambda row: int(row.metadata["size_bytes"]), base_size=base_size, poll_s=0.02)


def run(backend: ShardedBackend, models: Sequence[ModelRow],
        store: Store) -> tuple[list[Outcome], Recorder]:
    """Every outcome, as on_outcome got it (through the sweep's recorder); what run returns
    is the failed ones only (a run of millions keeps no list)."""
    recorder = Recorder(store, backend.spec.run_id)
    seen: list[Outcome] = []

    def on_outcome(outcome: Outcome) -> None:
        seen.append(outcome)
        recorder(outcome)

    kept = backend.run([Task.for_model(r) for r in models], on_outcome)
    assert list(kept) == [o for o in seen if o.status != "done"]
    return seen, recorder


@pytest.fixture
def indexed(sim: KubeSim) -> IndexedJobSimulator:
    return IndexedJobSimulator(sim, namespace=NS)


def by_status(outcomes: Sequence[Outcome]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"done": set(), "failed": set()}
    for o in outcomes:
        out[o.status].add(o.task.label)
    return out


def test_a_sharded_run_creates_one_indexed_job_and_every_model_is_done_once(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    models = rows([f"ok-{i}" for i in range(40)])
    worker = ShardWorker(store)
    with indexed.autopilot(worker):
        outcomes, recorder = run(backend_for(kube, store), models, store)
    assert by_status(outcomes)["done"] == {m.ref for m in models}
    assert all(o.recorded for o in outcomes)
    assert recorder.done == [] and recorder.done_count == len(models)  # counted, not listed
    assert set(worker.analysed.values()) == {1} and len(worker.analysed) == 40
    (job,) = sim.objects("jobs", NS)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == 4
    assert spec["completions"] >= 4 and spec["backoffLimitPerIndex"] == 3
    assert job["metadata"]["labels"][MODE_LABEL] == "sharded"
    # Every model is in exactly one shard, each shard a model list in the store.
    prefix = shard_prefix(RUN_A, "gpu-small")
    shard_keys = sorted(store.list_keys(prefix))
    assert len(shard_keys) == spec["completions"]
    listed = [line.split(",")[0] for key in shard_keys
              for line in (store.get_bytes(key) or b"").decode().splitlines()[1:]]
    assert sorted(listed) == sorted(m.ref for m in models)
    # A handful of API requests, whatever the number of models: no per-model object.
    assert sim.count("create", "jobs") == 1
    assert kube.requests < 200


def test_faults_each_model_ends_once_and_a_pod_killer_is_recorded(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """Evictions and a lost node do not cost retries; a transient failure is retried by the
    index; a permanent one is recorded and the shard goes on; a model that OOM-kills every
    pod is recorded as a poison model after --max-retries, the rest of its shard done."""
    names = ([f"ok-{i}" for i in range(12)] + ["bad-gone", "flaky-503", "oom-huge"]
             + [f"ok-tail-{i}" for i in range(5)])
    models = rows(names)
    disruptions: dict[int, dict[int, PodOutcome]] = {0: {0: "evict"}, 1: {0: "node_lost"}}
    worker = ShardWorker(store)

    def pod(job: dict[str, Any], index: int, attempt: int) -> PodOutcome:
        planned = disruptions.get(index, {}).get(attempt)
        return planned if planned is not None else worker(job, index, attempt)

    with indexed.autopilot(pod):
        outcomes, recorder = run(backend_for(kube, store, max_parallel=2), models, store)
    status = by_status(outcomes)
    assert status["failed"] == {"org/bad-gone", "org/oom-huge"}
    assert status["done"] == {m.ref for m in models} - status["failed"]
    assert all(worker.analysed[m.key] == 1 for m in models if m.ref in status["done"])
    bad = read_failure(store, models[names.index("bad-gone")].key)
    assert bad is not None and not bad.retryable and bad.run_id == RUN_A
    oom = read_failure(store, models[names.index("oom-huge")].key)
    assert oom is not None and "poison model" in oom.error and not oom.retryable
    assert worker.tried[models[names.index("oom-huge")].key] == 3  # max_retries + 1 pods died
    assert set(recorder.failed) == {models[names.index(n)].key for n in ("bad-gone", "oom-huge")}
    (job,) = indexed.jobs()
    counters = indexed.counters(job["metadata"]["name"])
    assert counters.outcomes["evict"] == 1 and counters.outcomes["node_lost"] == 1
    assert job["status"].get("failedIndexes") in (None, "")


def test_a_shard_that_cannot_run_fails_its_index_and_its_models_get_the_pods_diagnosis(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    models = rows([f"ok-{i}" for i in range(8)])
    worker = ShardWorker(store)

    def pod(job: dict[str, Any], index: int, attempt: int) -> PodOutcome:
        if index == 0:
            return Exit(2, log="esd-worker: error: shard 0 cannot run: bad flag\n")
        return worker(job, index, attempt)

    with indexed.autopilot(pod):
        outcomes, _ = run(backend_for(kube, store), models, store)
    failed = [o for o in outcomes if o.status == "failed"]
    assert failed and len(failed) < len(models)
    for outcome in failed:
        assert outcome.error.startswith("UsageError") and not outcome.recorded
        assert "index=0" in outcome.where
        record = read_failure(store, outcome.task.key)  # the recorder wrote it
        assert record is not None and record.exit_code == 2
        assert any("cannot run" in line for line in record.stderr_tail)
    (job,) = indexed.jobs()
    assert job["status"]["failedIndexes"] == "0"
    assert indexed.counters(job["metadata"]["name"]).outcomes["exit 2"] == 1  # no retry


def test_a_restarted_controller_reattaches_and_runs_nothing_twice(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """The first controller dies mid-run (it holds no state: its Jobs keep running); the
    second finds the sweep's Indexed Job by label, waits for it, then shards only what is
    still missing."""
    models = rows([f"ok-{i}" for i in range(30)])
    worker = ShardWorker(store)
    first = backend_for(kube, store, run_id=RUN_A, max_parallel=2)
    thread = threading.Thread(target=run, args=(first, models, store), daemon=True)
    thread.start()
    wait_for(lambda: indexed.jobs())
    for _ in range(6):  # a few pods run, then the first controller is gone
        indexed.tick(worker)
    first.request_stop()
    thread.join(10)
    assert not thread.is_alive()
    done_before = len(list_markers(store))
    assert 0 < done_before < len(models)

    second = backend_for(kube, store, run_id=RUN_B, max_parallel=2)
    with indexed.autopilot(worker):
        outcomes, _ = run(second, models, store)
    assert by_status(outcomes)["done"] == {m.ref for m in models}
    assert set(worker.analysed.values()) == {1} and len(worker.analysed) == len(models)
    assert [r.run_id for r in second.attached] == [RUN_A]
    # Nothing was left for the second run to shard: the first run's Job did it all.
    assert [j["metadata"]["labels"]["esd-sweep/run"] for j in sim.objects("jobs", NS)] == [RUN_A]


@pytest.mark.parametrize("version", ["1.30.9", "1.28.3", "1.27.16-eks-a737599"])
def test_a_server_older_than_the_sharded_mode_needs_is_refused_in_one_line(
    version: str, store: Store,
) -> None:
    with KubeSim(server_version=version) as old, KubeClient(old.configuration(),
                                                            retry=RETRY) as kube:
        with pytest.raises(SweepError) as raised:
            run(backend_for(kube, store), rows(["ok-0"]), store)
        assert old.count("create", "jobs") == 0
    message = str(raised.value)
    assert "\n" not in message and "needs Kubernetes 1.31 or newer" in message


def test_an_api_server_that_drops_backoff_limit_per_index_is_refused(store: Store) -> None:
    with KubeSim(per_index_backoff=False) as gated, KubeClient(gated.configuration(),
                                                               retry=RETRY) as kube:
        with pytest.raises(SweepError, match="backoffLimitPerIndex"):
            run(backend_for(kube, store), rows(["ok-0"]), store)
        assert gated.objects("jobs", NS) == []  # created, found wanting, deleted


def dry_run_small_and_large(backend: ShardedBackend, models: Sequence[ModelRow],
                            ) -> tuple[str, list[dict[str, Any]]]:
    """The dry run's text and its documents read back as YAML 1.2: two Jobs, gpu-small's
    then gpu-large's."""
    out = io.StringIO()
    assert backend.dry_run([Task.for_model(r) for r in models], out) == 2
    text = out.getvalue()
    docs = list(YAML(typ="safe", pure=True).load_all(text))
    assert [d["metadata"]["labels"]["esd-sweep/shard-class"] for d in docs] == [
        "gpu-small", "gpu-large"]
    return text, docs


def test_dry_run_prints_yaml_12_jobs_and_writes_no_shard(
    kube: KubeClient, store: Store, sim: KubeSim,
) -> None:
    models = rows([f"ok-{i}" for i in range(10)]) + rows(["huge"], size=80 * GB)
    _, docs = dry_run_small_and_large(backend_for(kube, store), models)
    # Each class's pods ask for what its biggest model needs (1 GB models fit a 16 GiB
    # node), the cache volume is bounded by the disk request, and a shard pod, which runs
    # many models, has no deadline.
    sized = {"gpu-small": ("7Gi", "23Gi"), "gpu-large": ("64Gi", "400Gi")}
    for doc in docs:
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert all(isinstance(a, str) for a in container["args"])  # YAML 1.2 reads strings
        memory, disk = sized[doc["metadata"]["labels"]["esd-sweep/shard-class"]]
        assert container["resources"]["requests"]["memory"] == memory
        assert container["resources"]["requests"]["ephemeral-storage"] == disk
        # A leaking model kills its own container, not its neighbours: limit = request.
        assert container["resources"]["limits"]["memory"] == memory
        (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
        assert cache["emptyDir"] == {"sizeLimit": disk}
        assert "activeDeadlineSeconds" not in pod and "activeDeadlineSeconds" not in doc["spec"]
        # The worker owns its download folder on that volume and deletes each model once
        # analysed, within the disk asked for less the headroom: a shard of many models
        # never outgrows the sizeLimit.
        args = container["args"]
        assert args[args.index("--cache-dir") + 1] == "/cache/models"
        budget = int(args[args.index("--cache-budget") + 1])
        assert budget == (int(disk.removesuffix("Gi")) - 8) * 1024**3
    assert list(store.list_keys()) == []
    assert sim.count("create", "jobs") == 0


def test_a_lora_on_a_large_base_is_classed_with_it_and_a_model_too_big_is_named(
    kube: KubeClient, store: Store, sim: KubeSim,
) -> None:
    """Dry run: a 200 MB LoRA on Llama-70B (141 GB, not listed: its size is the Sizer's
    base_size) goes to gpu-large, whose 400Gi holds the base; a 500 GB model fits no
    class's download budget: the plan names it, its size, the class and the flag, and
    shards it nowhere."""
    lora = ModelRow(model_id="org/lora-70b", revision=None, relation="lora",
                    source_model="meta-llama/Llama-3.1-70B",
                    metadata={"size_bytes": str(200 * 10**6)})
    models = [*rows([f"ok-{i}" for i in range(4)]), lora, *rows(["giant"], size=500 * GB)]
    bases = {"meta-llama/Llama-3.1-70B": 141 * GB}
    backend = backend_for(kube, store, base_size=lambda source: bases[source])
    text, _ = dry_run_small_and_large(backend, models)
    assert "# class gpu-large: 1 model(s)" in text
    (line,) = [ln for ln in text.splitlines() if "org/giant" in ln]
    assert line.startswith("# ModelTooLarge: org/giant needs 500.0 GB")
    assert "gpu-large" in line and "--ephemeral-storage-request" in line


def test_a_model_too_big_for_its_class_fails_at_plan_time_and_the_rest_run(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """No pod is given a model it cannot hold: the 500 GB model's outcome is a permanent
    ModelTooLarge failure (recorded by the sweep), the others are done."""
    models = rows([f"ok-{i}" for i in range(6)]) + rows(["giant"], size=500 * GB)
    worker = ShardWorker(store)
    with indexed.autopilot(worker):
        outcomes, _ = run(backend_for(kube, store), models, store)
    status = by_status(outcomes)
    assert status["failed"] == {"org/giant"}
    (giant,) = [o for o in outcomes if o.status == "failed"]
    assert giant.error.startswith("ModelTooLarge: org/giant") and not giant.retryable
    assert "giant" not in " ".join(worker.analysed)
    record = read_failure(store, models[-1].key)
    assert record is not None and "ModelTooLarge" in record.error


def test_a_sharded_job_kueue_holds_is_explained_from_its_workload(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kueue keeps the Indexed Job suspended for want of quota: the controller's pending
    line quotes the Workload's QuotaReserved message (kueue.x-k8s.io/v1beta2)."""
    message = ("couldn't assign flavors to pod set main: insufficient unused quota for "
               "nvidia.com/gpu in flavor h100, 3 more needed")
    backend = backend_for(kube, store, kueue_queue="gpu-queue", pending_timeout_s=0.1)
    thread = threading.Thread(target=run, args=(backend, rows(["a", "b"]), store),
                              daemon=True)
    thread.start()
    (job,) = wait_for(lambda: indexed.jobs())
    assert job["spec"]["suspend"] is True
    indexed.api.queue_workload(job["metadata"]["name"], [condition(
        "QuotaReserved", "Pending", message, status="False")], queue="gpu-queue")
    said = wait_for(lambda: [r.getMessage() for r in caplog.records
                             if message in r.getMessage()])
    backend.request_stop()
    thread.join(10)
    assert said and f"Kueue: Pending: {message}" in said[0]


def test_no_wait_creates_the_jobs_and_returns(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    backend = backend_for(kube, store, wait=False)
    outcomes, _ = run(backend, rows([f"ok-{i}" for i in range(5)]), store)
    assert outcomes == [] and len(sim.objects("jobs", NS)) == 1
    assert backend.report()["running"] == 5


def test_crashing_hanging_and_leaking_models_cost_their_own_retries_not_the_index(
    sim: KubeSim, kube: KubeClient, store: Store, indexed: IndexedJobSimulator,
) -> None:
    """Issue 29: 3 crash-prone models, 1 hanging and 1 leaking among 10 good ones. A pod's
    supervisor charges the model under a worker that died (segfault, killed as hung, killed
    past its memory limit) to that model's attempt note and goes on with a new worker in the
    same pod: every index completes with its first pod (none of its backoffLimitPerIndex is
    used), every good model is done once, and each bad one is recorded after --max-retries
    (2) + 1 attempts with the cause of the last, as the pod's supervisor wrote it."""
    bad = {"crash-a": "WorkerCrashed: killed by SIGSEGV while analysing org/crash-a",
           "crash-b": "WorkerCrashed: killed by SIGSEGV while analysing org/crash-b",
           "crash-c": "WorkerCrashed: killed by SIGSEGV while analysing org/crash-c",
           "hang-x": "ModelTimeout: no progress for 600 s",
           "leak-y": "HostOutOfMemory: the worker passed 8.00 GiB (--memory-limit"}
    names = [f"ok-{i}" for i in range(10)] + list(bad)
    models = rows(names)
    worker = ShardWorker(store)
    with indexed.autopilot(worker):
        outcomes, _ = run(backend_for(kube, store, max_parallel=2), models, store)
    status = by_status(outcomes)
    assert status["failed"] == {f"org/{name}" for name in bad}
    assert len(status["done"]) == 10
    assert all(worker.analysed[m.key] == 1 for m in models if m.ref in status["done"])
    for name, cause in bad.items():
        key = models[names.index(name)].key
        record = read_failure(store, key)
        assert record is not None and record.error.startswith(cause), (name, record)
        assert (record.attempts, record.retryable, worker.tried[key]) == (3, False, 3)
    (job,) = indexed.jobs()
    completions = job["spec"]["completions"]
    counters = indexed.counters(job["metadata"]["name"])
    assert counters.outcomes == {"succeed": completions} and counters.pods == completions
    assert not list(store.list_keys("_attempts/"))
