"""A node whose GPU is broken, in a sharded run: no model pays for it, its shards run elsewhere.

The worker exits 6 (EXIT_DEVICE) when its device is broken, recording nothing; the Indexed
Job fails that index at once (FailIndex) and the controller hands the index to a
replacement Job whose pods may not land on the bad node (a required node affinity). The
cluster is tests.support.indexed.IndexedJobSimulator with several nodes, its pods the
worker's real batch loop (tests.support.shardworker), the controller the real one over
HTTP (KubeSim), with test_sharded.py's helpers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest
from ruamel.yaml import YAML

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.names import CLASS_LABEL, sharded_selector
from controller.backends.kubernetes.common.resources import ResourceClass
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from controller.backends.kubernetes.sharded.devicefaults import REPLACE_EVERY_S, DeviceFaults
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from controller.backends.kubernetes.sharded.sharding import ClassShards
from controller.backends.kubernetes.sharded.status import IndexedRun
from esd_worker.core.errors import EXIT_DEVICE
from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.store.layout import list_failure_keys, shard_key, shard_prefix
from esd_worker.core.store.stores import Store
from tests.controller.backends.kubernetes.test_sharded import (
    GB,
    RUN_A,
    backend_for,
    by_status,
    rows,
    run,
)
from tests.support.cluster import IMAGE, NS
from tests.support.indexed import Exit, IndexedJobSimulator
from tests.support.indexed import Outcome as PodOutcome
from tests.support.kubesim import KubeSim
from tests.support.shardworker import ShardWorker, shard_url

NODES = [f"gpu-node-{i}" for i in range(8)]
BROKEN = "gpu-node-3"
HOSTNAME = "kubernetes.io/hostname"


def avoided_nodes(job: dict[str, Any]) -> list[str]:
    """The nodes a Job's pod template may not land on (a required NotIn on the hostname)."""
    required = (((job["spec"]["template"]["spec"].get("affinity") or {})
                 .get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    out: list[str] = []
    for term in required.get("nodeSelectorTerms") or []:
        for req in term.get("matchExpressions") or []:
            if req["key"] == HOSTNAME and req["operator"] == "NotIn":
                out += req["values"]
    return out


def test_a_broken_gpu_node_costs_no_model_and_its_shards_run_elsewhere(
    sim: KubeSim, kube: KubeClient, store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """2,000 models in 40 shards over 8 nodes, one of which fails every pod at once with
    exit 6: every model is analysed exactly once, no failure record is written, the run
    report and the log (with the command that quarantines it) name the node, and no pod of
    a replacement Job runs there. The original Job did
    put pods on the node (the fault happened): those indexes ran again elsewhere."""
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=NODES)
    models = rows([f"ok-{i}" for i in range(2000)])
    worker = ShardWorker(store, broken_nodes=frozenset({BROKEN}))
    backend = backend_for(kube, store, max_parallel=16, shard_size=50)
    with indexed.autopilot(worker):
        outcomes, recorder = run(backend, models, store)
    assert by_status(outcomes) == {"done": {m.ref for m in models}, "failed": set()}
    assert len(worker.analysed) == len(models) and set(worker.analysed.values()) == {1}
    assert not list_failure_keys(store) and recorder.failed == {}
    (bad,) = backend.report()["kubernetes"]["bad_nodes"]
    assert bad["node"] == BROKEN and bad["device_faults"] >= 1
    assert "DeviceError" in bad["error"] and BROKEN in bad["error"]  # NODE_NAME reached it
    assert f"node {BROKEN}: GPU broken" in caplog.text
    assert f"kubectl cordon {BROKEN}" in caplog.text
    jobs = {j["metadata"]["name"]: j for j in indexed.jobs()}
    first = [n for n, j in jobs.items() if j["metadata"]["labels"][CLASS_LABEL] == "gpu-small"]
    replacements = [n for n in jobs if n not in first]
    assert len(first) == 1 and replacements
    broke = indexed.counters(first[0]).outcomes["exit 6"]
    assert broke >= 1 and indexed.counters(first[0]).nodes[BROKEN] == broke
    # Batched: the first Job ended within the minute, so one replacement took every shard
    # that broke, its lists copied under this run's shard prefix for class gpu-small-r1.
    (replacement,) = replacements
    assert jobs[replacement]["spec"]["completions"] == broke
    assert len(list(store.list_keys(shard_prefix(RUN_A, "gpu-small-r1")))) == broke
    # A restarted controller finds it with the sweep's Jobs (the same labels).
    listed, _ = kube.list_jobs(NS, sharded_selector(backend.instance))
    assert {j["metadata"]["name"] for j in listed} == set(jobs)
    for name in replacements:
        assert BROKEN in avoided_nodes(jobs[name])
        assert indexed.counters(name).nodes[BROKEN] == 0
        assert sum(indexed.counters(name).nodes.values()) >= 1


def build(class_name: str, *, avoid: tuple[str, ...] = (), completions: int = 3,
          parallelism: int = 3, output: str = "s3://esd/out") -> dict[str, Any]:
    """The Indexed Job the sharded backend makes for a class of this run (--max-retries 2)."""
    settings = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False)
    spec = WorkerSpec(run_id=RUN_A, store_url=output, max_retries=2)
    job_settings = settings.job_settings(run_id=RUN_A, instance="out", gpus_per_job=1,
                                         worker=spec.invocation())
    return build_indexed_job(
        run_id=RUN_A, class_name=class_name, completions=completions,
        parallelism=parallelism, backoff_limit_per_index=3,
        shards_url=f"{output}/{shard_prefix(RUN_A, class_name).rstrip('/')}",
        output_url=output, settings=job_settings, avoid_nodes=avoid)


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
def test_a_replacement_job_keeps_its_pods_off_the_bad_nodes(version: str) -> None:
    """A required (not preferred: the scheduler would still send pods to a broken node with
    room) NotIn on the kubernetes.io/hostname label, each bad node once, sorted. Valid in
    the strict schema, and the same object once its YAML is read back as the API server
    reads it (YAML 1.2, ruamel); a Job of no bad node carries no affinity."""
    job = build("gpu-small-r1", avoid=("gpu-node-7", "gpu-node-3", "gpu-node-7"))
    kubernetes_validate.validate(job, version, strict=True)
    assert job["spec"]["template"]["spec"]["affinity"] == {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": HOSTNAME, "operator": "NotIn",
                                  "values": ["gpu-node-3", "gpu-node-7"]}]}]}}}
    (read_back,) = YAML(typ="safe", pure=True).load_all(jobs_to_yaml([job]))
    assert read_back == job
    assert "affinity" not in build("gpu-small")["spec"]["template"]["spec"]


def test_replacements_are_batched_per_class_at_most_once_a_minute(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """While Jobs of the class still run, a shard whose GPU broke waits for the class's
    next replacement, made REPLACE_EVERY_S after the first fault (then after the last
    replacement), not one Job per failed index; the failed pods are listed once per Job
    with new failures, never again; the replacement has the class's settings and a copy
    of the shard's list, and the index is marked as handed on (ShardFailures skips it);
    its parallelism is what the class's running pods leave of the class's (its GPUs)."""
    for index in range(3):
        store.put_bytes(shard_key(RUN_A, "gpu-small", index),
                        f"model_id\norg/ok-{index}\n".encode())
    job = build("gpu-small", completions=3, parallelism=1)
    kube.create_job(NS, job)
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=["n0", "n1"])
    stored: dict[str, Any] | None = None
    for _ in range(20):  # until indexes 0 and 1 broke; index 2 then runs
        indexed.tick(lambda job, index, attempt: Exit(EXIT_DEVICE) if index < 2 else "succeed")
        stored = kube.read_job(NS, job["metadata"]["name"])
        if stored is not None and stored["status"].get("failedIndexes") == "0,1":
            break
    assert stored is not None
    run = IndexedRun.from_job(stored, per_shard=[1, 1, 1])
    assert run.failed == [0, 1] and not run.finished and run.active == 1
    cls = ResourceClass("gpu-small", 1, 8 * GB, "7Gi", "23Gi")
    faults = DeviceFaults(NS, store, run_id=RUN_A, max_faults=3)
    faults.track(run, ClassShards(cls=cls, parallelism=2, models=3, bytes=3 * GB,
                                  per_shard=[1, 1, 1]), pods=1)
    made: list[ClassShards] = []

    def create(shards: ClassShards, pods: int) -> IndexedRun:
        made.append(shards)
        return IndexedRun(name=f"esd-x-{shards.cls.name}", run_id=RUN_A,
                          class_name=shards.cls.name, completions=shards.shards,
                          models=shards.models, per_shard=list(shards.per_shard))

    assert faults.follow(kube, [run], 1000.0, create) == []  # the class still runs
    assert faults.avoided() == ["n0"]  # one pod at a time: each on the first idle node
    assert [n["device_faults"] for n in faults.report()] == [2]
    requests = kube.requests
    assert faults.follow(kube, [run], 1000.0 + REPLACE_EVERY_S - 1, create) == []
    (replacement,) = faults.follow(kube, [run], 1000.0 + REPLACE_EVERY_S, create)
    assert kube.requests == requests  # the failed indexes were read once
    assert replacement.class_name == "gpu-small-r1"
    assert run.replaced == {0: replacement.name, 1: replacement.name}
    (shards,) = made
    assert shards.cls == replace(cls, name="gpu-small-r1") and shards.per_shard == [1, 1]
    assert shards.parallelism == 1  # index 2's pod holds the class's other GPU
    for index in (0, 1):
        assert store.get_bytes(shard_key(RUN_A, "gpu-small-r1", index)) == \
            f"model_id\norg/ok-{index}\n".encode()
    assert faults.follow(kube, [run], 5000.0, create) == []  # nothing waits any more


def test_a_shard_that_breaks_every_gpu_ends_after_max_retries_plus_one_nodes(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """A shard whose pod breaks the GPU of whichever node it lands on (an Xid its model
    triggers) is not replaced for ever: each replacement avoids every bad node so far, and
    once the shard met broken GPUs on max_retries + 1 = 3 nodes and then a fourth, its
    models end failed, retryable, "DeviceError: … on 4 nodes (…)", with no failure record
    written against them (the next run tries them again). The other shards are done."""
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=NODES)
    models = rows([f"ok-{i}" for i in range(30)] + ["xid-kernel"] + [f"ok-z{i}" for i in range(9)])
    worker = ShardWorker(store)

    def pod(job: dict[str, Any], index: int, attempt: int,
            pod: dict[str, Any] | None = None) -> PodOutcome:
        listed = read_model_list(f"{shard_url(job)}/{index}.csv").rows
        if any(r.model_id.startswith("org/xid-") for r in listed):
            assert pod is not None
            return Exit(EXIT_DEVICE, log=f"DeviceError: Xid 79 on {pod['spec']['nodeName']}\n")
        return worker(job, index, attempt)

    backend = backend_for(kube, store, max_parallel=4, shard_size=10)
    with indexed.autopilot(pod):
        outcomes, recorder = run(backend, models, store)
    status = by_status(outcomes)
    assert status["failed"] and "org/xid-kernel" in status["failed"]
    assert status["done"] == {m.ref for m in models} - status["failed"]
    for outcome in outcomes:
        if outcome.status == "failed":
            assert outcome.retryable and outcome.error.startswith("DeviceError: ")
            assert "on 4 nodes (" in outcome.error and outcome.exit_code == EXIT_DEVICE
    assert not list_failure_keys(store)  # nothing against the models
    assert set(recorder.failed) == {m.key for m in models if m.ref in status["failed"]}
    jobs = sorted(indexed.jobs(), key=lambda j: j["metadata"]["creationTimestamp"])
    classes = [j["metadata"]["labels"][CLASS_LABEL] for j in jobs]
    assert sorted(classes) == ["gpu-small", "gpu-small-r1", "gpu-small-r2", "gpu-small-r3"]
    bad = [n["node"] for n in backend.report()["kubernetes"]["bad_nodes"]]
    assert len(bad) == 4
    by_class = {j["metadata"]["labels"][CLASS_LABEL]: j for j in jobs}
    for n in (1, 2, 3):  # each avoids the nodes that broke before it was made
        assert len(avoided_nodes(by_class[f"gpu-small-r{n}"])) == n


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
