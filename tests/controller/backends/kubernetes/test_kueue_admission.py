"""Does Kueue admit the Jobs the controller builds? The sample ClusterQueue
(manifests/kueue/cluster-queue.yaml) against every resource class's Indexed Job, and the
queue docs/kubernetes.md used to show, which covered no ephemeral-storage and so admitted
none; then a sharded run through the test API server under each (tests.support.kueuesim
plays Kueue v0.19.2's admission, its messages copied from Kueue's source).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.resources import ResourceClass
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.sharded.backend import ShardedBackend
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from controller.backends.kubernetes.sharded.plan import default_classes, multi_gpu_class
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.stores import Store
from tests.support.cluster import IMAGE, NS, wait_for
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim
from tests.support.kueuesim import ClusterQueueSim, KueueSim, amount, show
from tests.support.kustomize import MANIFESTS, read_yaml12
from tests.support.shardworker import ShardWorker

SAMPLE = read_yaml12((MANIFESTS / "kueue" / "cluster-queue.yaml").read_text())
# docs/kubernetes.md's queue before issue 33: no ephemeral-storage.
OLD_DOC = read_yaml12("""
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: gpu}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: gpu-cluster-queue}
spec:
  namespaceSelector: {}
  resourceGroups:
    - coveredResources: ["cpu", "memory", "nvidia.com/gpu"]
      flavors:
        - name: gpu
          resources:
            - {name: cpu, nominalQuota: 64}
            - {name: memory, nominalQuota: 512Gi}
            - {name: "nvidia.com/gpu", nominalQuota: 8}
""")
NO_DISK = ("couldn't assign flavors to pod set main: resource ephemeral-storage "
           "unavailable in ClusterQueue")
RUN = "20261123T070501Z-3fa9c2"
GB = 10**9
STORE = "s3://esd-results/atlas"
CLASSES = (*default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB),
           *default_classes(device="cpu", gpus_per_job=0, large_bytes=30 * GB),
           multi_gpu_class(2, 140 * GB), multi_gpu_class(8, 700 * GB))


def queue_of(docs: list[dict[str, Any]], **kw: Any) -> ClusterQueueSim:
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    return ClusterQueueSim(cq, [d for d in docs if d["kind"] == "ResourceFlavor"], **kw)


def job_for(cls: ResourceClass, parallelism: int = 100) -> dict[str, Any]:
    """The Indexed Job the sharded backend builds for `cls` at the default --max-parallel
    (100 GPUs: more pods than the sample's 8 GPUs), queued to the kueue component's
    LocalQueue, in its namespace."""
    cluster = ClusterSettings(namespace="esd-sweep", image="esd-sweep:1", telemetry=False,
                              kueue_queue="esd-sweep")
    worker = WorkerSpec(run_id=RUN, store_url=STORE).invocation()
    job = cluster.for_class(cluster.job_settings(run_id=RUN, instance="i", gpus_per_job=1,
                                                 worker=worker), cls)
    return build_indexed_job(run_id=RUN, class_name=cls.name, completions=400,
                             parallelism=parallelism, backoff_limit_per_index=3,
                             shards_url=f"{STORE}/_shards/{RUN}/{cls.name}",
                             output_url=STORE, settings=job)


@pytest.mark.parametrize("cls", CLASSES, ids=[c.name for c in CLASSES])
def test_the_sample_queue_admits_every_class_and_the_old_one_none(cls: ResourceClass) -> None:
    """Each class's Job is admitted by the sample queue, with as many pods as its quota
    holds (partial admission, from the Job's min-parallelism 1); the old doc's queue leaves
    every one suspended, and says it is the disk."""
    job = job_for(cls)
    decision = queue_of(SAMPLE).decide(job)
    assert decision.admitted, decision.message
    requests = job["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert set(decision.flavors) == set(requests)  # every resource the pod asks for
    gpus = int(requests.get("nvidia.com/gpu", 0))
    if gpus:
        assert decision.count == 8 // gpus  # the GPUs bound it
    else:
        assert decision.count >= 1
    old = queue_of(OLD_DOC).decide(job)
    assert not old.admitted  # no count fits: every pod asks for disk
    # One pod fits the old queue's cpu, memory and GPUs: the disk is its only problem (with
    # 100 pods Kueue may name either, as it walks the requests in Go's map order).
    one = queue_of(OLD_DOC).decide(job_for(cls, 1))
    assert (one.admitted, one.message) == (False, NO_DISK)


def test_excluding_ephemeral_storage_in_kueues_configuration_is_the_alternative() -> None:
    """resources.excludeResourcePrefixes: ["ephemeral-storage"] makes the old queue admit."""
    queue = queue_of(OLD_DOC, exclude_resource_prefixes=["ephemeral-storage"])
    assert queue.decide(job_for(CLASSES[0])).admitted


def _mig(doc: list[dict[str, Any]], job: dict[str, Any]) -> tuple[
        list[dict[str, Any]], dict[str, Any]]:
    """The sample's queue and a Job with nvidia.com/gpu renamed to the MIG resource (what
    --gpu-resource nvidia.com/mig-1g.10gb makes the pods request)."""
    def renamed(obj: Any) -> Any:
        return json.loads(json.dumps(obj).replace('"nvidia.com/gpu"',
                                                  '"nvidia.com/mig-1g.10gb"'))

    return renamed(doc), renamed(job)


@pytest.mark.parametrize(("queue", "job", "parallelism", "expected"), [
    pytest.param(None, "gpu-large", 1, (True, 1, ""), id="fits"),
    pytest.param(None, "gpu-x8", 2, (True, 1, ""), id="partial"),
    pytest.param("no-min", "gpu-x8", 2, (False, 0, (
        "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in "
        "flavor default-flavor, previously considered podsets requests (0) + current podset "
        "request (16) > maximum capacity (8)")), id="too-big-without-partial"),
    pytest.param("other-namespace", "gpu", 1, (False, 0, (
        "workload namespace doesn't match ClusterQueue selector")), id="namespace"),
    pytest.param("no-flavor", "gpu", 1, (False, 0, (
        "ClusterQueue gpu-cluster-queue is inactive")), id="no-resource-flavor"),
    pytest.param("mig-job", "gpu", 1, (False, 0, (
        "couldn't assign flavors to pod set main: resource nvidia.com/mig-1g.10gb "
        "unavailable in ClusterQueue")), id="mig-pods-gpu-queue"),
    pytest.param("mig-both", "gpu", 1, (True, 1, ""), id="mig-pods-mig-queue"),
])
def test_admission_decisions(queue: str | None, job: str, parallelism: int,
                             expected: tuple[bool, int, str]) -> None:
    """Kueue's decisions and messages, case by case, on the sample queue."""
    (cls,) = [c for c in CLASSES if c.name == job]
    built, docs = job_for(cls, parallelism), SAMPLE
    if queue == "no-min":
        del built["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"]
    if queue == "other-namespace":
        built["metadata"]["namespace"] = "team-b"
    if queue == "no-flavor":
        docs = [d for d in SAMPLE if d["kind"] == "ClusterQueue"]
    if queue == "mig-job":
        _, built = _mig(SAMPLE, built)
    if queue == "mig-both":
        docs, built = _mig(SAMPLE, built)
    d = queue_of(docs).decide(built)
    assert (d.admitted, d.count, d.message) == expected


def test_quota_held_by_admitted_workloads_and_released() -> None:
    """A second Job waits for what the first holds, "N more needed"; the first's end frees it."""
    queue = queue_of(SAMPLE)
    (large,) = [c for c in CLASSES if c.name == "gpu-large"]
    assert queue.admit("a", job_for(large, 6)).count == 6
    second = job_for(large, 3)
    del second["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"]
    assert queue.admit("b", second).message == (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu "
        "in flavor default-flavor, 1 more needed")
    queue.release("a")
    assert queue.admit("b", second).count == 3


@pytest.mark.parametrize(("resource", "quantity", "shown"), [
    ("cpu", "64", "64"), ("cpu", "500m", "500m"), ("cpu", "1500m", "1500m"),
    ("memory", "768Gi", "768Gi"), ("memory", "1.5Gi", "1536Mi"), ("memory", "1000", "1000"),
    ("ephemeral-storage", "4Ti", "4Ti"), ("nvidia.com/gpu", "8", "8"),
    ("nvidia.com/gpu", "1000", "1k"),
])
def test_quantities_read_and_shown_as_kueue_does(resource: str, quantity: str,
                                                 shown: str) -> None:
    assert show(resource, amount(resource, quantity)) == shown


# -- a sharded run through the test API server --------------------------------------------


def rows(names: list[str], size: int = GB) -> list[ModelRow]:
    return [ModelRow(model_id=f"org/{n}", revision=None, relation="", source_model=None,
                     metadata={"size_bytes": str(size)}) for n in names]


def backend_for(kube: KubeClient, store: Store) -> ShardedBackend:
    """The sharded backend with Jobs queued to Kueue, a short --pending-timeout."""
    settings = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False,
                               poll_interval_s=0.02, max_parallel=4, kueue_queue="gpu-queue",
                               pending_timeout_s=0.1)
    spec = WorkerSpec(run_id=RUN, store_url=store.url, max_retries=2)
    job_settings = settings.job_settings(run_id=RUN, instance=sweep_instance(store.url),
                                         gpus_per_job=1, worker=spec.invocation())
    return ShardedBackend(
        settings, kube, spec=spec, job_settings=job_settings, store=store,
        classes=default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB),
        size=lambda row: int(row.metadata["size_bytes"]), poll_s=0.02)


def run_in_background(backend: ShardedBackend, models: list[ModelRow]
                      ) -> tuple[threading.Thread, list[Outcome]]:
    outcomes: list[Outcome] = []
    thread = threading.Thread(target=backend.run, args=(
        [Task.for_model(m) for m in models], outcomes.append), daemon=True)
    thread.start()
    return thread, outcomes


@pytest.fixture
def indexed(sim: KubeSim) -> IndexedJobSimulator:
    return IndexedJobSimulator(sim, namespace=NS)


@pytest.fixture
def kueue_for(indexed: IndexedJobSimulator) -> Iterator[Any]:
    started: list[KueueSim] = []

    def start(docs: list[dict[str, Any]]) -> KueueSim:
        sim = KueueSim(indexed.api, queue_of(docs))
        sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


def _in_namespace(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sample selects the esd-sweep namespace; the test API server's is NS."""
    out = [dict(d) for d in docs]
    for d in out:
        if d["kind"] == "ClusterQueue":
            d["spec"] = {**d["spec"], "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": NS}}}
    return out


def test_a_sharded_run_under_the_sample_queue_is_admitted(
    kube: KubeClient, store: Store, indexed: IndexedJobSimulator, kueue_for: Any,
) -> None:
    """Every class's Job is admitted and runs; every model is done."""
    models = rows(["a", "b"]) + rows(["big"], size=40 * GB)
    kueue = kueue_for(_in_namespace(SAMPLE))
    backend = backend_for(kube, store)
    with indexed.autopilot(ShardWorker(store), admit=False):
        thread, outcomes = run_in_background(backend, models)
        thread.join(30)
    assert not thread.is_alive()
    assert {(o.task.key, o.status) for o in outcomes} == {(m.key, "done") for m in models}
    assert sorted(kueue.decisions) == sorted(j["metadata"]["name"] for j in indexed.jobs())
    assert len(kueue.decisions) == 2  # gpu-small and gpu-large
    assert all(d.admitted for d in kueue.decisions.values())


def test_a_sharded_run_under_the_old_doc_queue_waits_and_says_why(
    kube: KubeClient, store: Store, indexed: IndexedJobSimulator, kueue_for: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Job stays suspended; after --pending-timeout the controller quotes Kueue."""
    kueue_for(OLD_DOC)
    backend = backend_for(kube, store)
    with caplog.at_level(logging.WARNING), indexed.autopilot(ShardWorker(store), admit=False):
        thread, _ = run_in_background(backend, rows(["a", "b"]))
        wait_for(lambda: NO_DISK in caplog.text)
        backend.request_stop()
        thread.join(10)
    assert not thread.is_alive()
    (job,) = indexed.jobs()
    assert job["spec"]["suspend"] is True
    line = next(r.getMessage() for r in caplog.records if NO_DISK in r.getMessage())
    assert f"Kueue: Pending: {NO_DISK}" in line
