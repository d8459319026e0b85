"""The GPU rule on Kubernetes: a model the rule gives N GPUs gets a Job asking for N
(`--shard-size 1`), or, sharded, an Indexed Job of its own class "gpu-x<N>" whose pods ask
for N and whose parallelism counts N GPUs per pod against --max-parallel.

Shapes come from the list's num_params / matrix_dim columns or a local directory's
safetensors headers (the hub is offline in these tests: tests/controller/test_weightmeta.py
covers it). Jobs are checked as the API server would: every object the real client creates
on KubeSim passes strict Kubernetes 1.31 validation, dry-run YAML is validated and read
back under YAML 1.2 (ruamel) as the same objects.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from ruamel.yaml import YAML

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.per_model.backend import KubernetesBackend
from controller.backends.kubernetes.sharded.backend import ShardedBackend
from controller.backends.kubernetes.sharded.plan import default_classes
from controller.backends.kubernetes.sharded.sharding import write_shards
from controller.gpu.counts import GpuCounts
from controller.gpu.exporter import GpuReading, make_server
from controller.gpu.gpurule import GpuRule
from controller.gpu.gpus import GpuSettings
from controller.run.recorder import Recorder
from controller.settings import SweepSettings
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import ShapeFinder
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.stores import Store
from tests.controller.test_weightmeta import llama_layers, write_st
from tests.support.cluster import IMAGE, K8S_VERSION, NS, RUN_ID, MarkerSimulator
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim
from tests.support.shardworker import ShardWorker

GB = 10**9
HUGE = {"num_params": "405e9", "matrix_dim": "16384", "size_bytes": str(810 * GB)}
SMALL = {"size_bytes": str(GB)}


def row(name: str, columns: dict[str, str]) -> ModelRow:
    return ModelRow(f"org/{name}", None, "", None, metadata=dict(columns))


def gpu_counts(rule: GpuRule | None = None) -> GpuCounts:
    rule = rule or GpuRule()
    return GpuCounts(rule, ShapeFinder(Sizer(offline=True), rule), rule.max_gpus_per_job)


def gpu_request(job: dict[str, Any]) -> str:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    return str(resources["limits"]["nvidia.com/gpu"])


def assert_valid_yaml(text: str) -> list[dict[str, Any]]:
    """Strict 1.31 schema, and the same objects under YAML 1.2 (ruamel) and 1.1 (PyYAML)."""
    docs = list(yaml.safe_load_all(text))
    assert docs == list(YAML(typ="safe", pure=True).load_all(io.StringIO(text)))
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return docs


# --- one Job per model --------------------------------------------------------------------------


def test_dry_run_jobs_ask_for_the_rules_gpus(tmp_path: Path) -> None:
    """From the settings, as `esd-sweep run --backend kubernetes --shard-size 1 --dry-run`:
    a 405B from the list's columns and a local checkpoint whose headers say 405B ask for 4
    GPUs (~72 GPU-min / 20); a small model for 1; --max-gpus-per-job caps; an explicit
    --gpus-per-job is every Job's."""
    local = tmp_path / "llama-405b"
    write_st(local / "model.safetensors", llama_layers(16384, 53248, range(126), kv=1024))
    rows = [row("huge", HUGE), row("small", SMALL),
            ModelRow(str(local), None, "", None, metadata={"size_bytes": str(810 * GB)})]
    cases = [(GpuRule(), ["4", "1", "4"]), (GpuRule(max_gpus_per_job=2), ["2", "1", "2"]),
             (GpuRule(explicit=2), ["2", "2", "2"]), (GpuRule(parallel=False), ["1"] * 3)]
    for rule, expected in cases:
        cluster = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False, shard_size=1)
        settings = SweepSettings(output=str(tmp_path / "out"), backend="kubernetes",
                                 cluster=cluster, dry_run=True, gpu_rule=rule,
                                 parallel_gpu=rule.parallel,
                                 gpu=GpuSettings(gpus_per_job=rule.base))
        spec = WorkerSpec(run_id=RUN_ID, store_url=str(tmp_path / "out"))
        backend = KubernetesBackend.from_settings(settings, spec)
        out = io.StringIO()
        assert backend.dry_run([Task.for_model(r) for r in rows], out) == 3
        assert [gpu_request(doc) for doc in assert_valid_yaml(out.getvalue())] == expected


def _exporter(node: str, used: Sequence[float]) -> tuple[Any, str]:
    readings = [GpuReading(i, f"GPU-{node}-{i}", "NVIDIA H100 80GB HBM3", u, 81559.0 - u,
                           81559.0) for i, u in enumerate(used)]
    server = make_server("127.0.0.1", 0, lambda: list(readings), node, cache_s=0.0)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_a_big_models_job_asks_for_its_gpus_and_prefers_a_node_with_room_for_them(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """Telemetry: node-wide has 8 idle GPUs, node-two 2. The 405B's Job asks for 4 GPUs and
    prefers node-wide, the only node with 4 free; the small models' Jobs ask for 1. Every
    Job passes KubeSim's strict validation."""
    wide, wide_url = _exporter("node-wide", [0.0] * 8)
    two, two_url = _exporter("node-two", [0.0] * 2)
    settings = ClusterSettings(namespace=NS, image=IMAGE, telemetry=True, watch_timeout_s=2,
                               telemetry_urls=(two_url, wide_url))
    job_settings = settings.job_settings(run_id=RUN_ID, instance=sweep_instance(store.url),
                                         gpus_per_job=1)
    backend = KubernetesBackend(settings, kube, job_settings=job_settings,
                                output_url=store.url, max_checks=1, poll_interval_s=0.02,
                                size=lambda r: int(r.metadata["size_bytes"]),
                                gpus=gpu_counts())
    rows = [row("huge", HUGE), row("small-a", SMALL), row("small-b", SMALL)]
    outcomes: list[Outcome] = []
    try:
        with cluster.autopilot():
            backend.run([Task.for_model(r) for r in rows], outcomes.append)
    finally:
        for server in (wide, two):
            server.shutdown()
            server.server_close()
    assert {o.status for o in outcomes} == {"done"}
    jobs = {j["metadata"]["annotations"]["esd-sweep/model-key"]: j
            for j in sim.objects("jobs", NS)}
    assert gpu_request(jobs[rows[0].key]) == "4"
    assert [gpu_request(jobs[r.key]) for r in rows[1:]] == ["1", "1"]
    preferred = jobs[rows[0].key]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchFields"]
    assert preferred[0]["values"] == ["node-wide"]


# --- sharded ------------------------------------------------------------------------------------


def test_big_models_get_a_class_of_their_own_whose_pods_count_their_gpus(
        store: Store) -> None:
    """write_shards: the two 405B models go to gpu-x4, sized from the biggest of them (64Gi,
    one 810 GB checkpoint on disk and the headroom); the budget of 16 GPUs gives that class
    3 pods' worth of bytes but it has 2 shards: 2 pods, 8 GPUs; the small models' class gets
    its pod."""
    models = [row(f"small-{i}", SMALL) for i in range(10)] + [row("huge-a", HUGE),
                                                                 row("huge-b", HUGE)]
    counts = gpu_counts()
    shards = write_shards(
        [Task.for_model(m) for m in models], store=store, run_id=RUN_ID,
        classes=default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB),
        size=lambda r: int(r.metadata["size_bytes"]), budget=16, max_models=1000,
        gpus=counts)
    by_name = {c.cls.name: c for c in shards}
    assert list(by_name) == ["gpu-small", "gpu-x4"]
    x4 = by_name["gpu-x4"]
    assert (x4.cls.gpus, x4.models, x4.shards, x4.parallelism) == (4, 2, 2, 2)
    disk = math.ceil(810 * GB / 2**30) + 8  # the checkpoint and the 8 GiB headroom
    assert (x4.cls.memory, x4.cls.ephemeral_storage) == ("64Gi", f"{disk}Gi")
    assert by_name["gpu-small"].parallelism == 1
    assert sum(c.parallelism * c.cls.gpus for c in shards) <= 16
    # Each model counted once though the plan reads the list twice; no hub: unknown.
    assert (counts.stats.column, counts.stats.unknown) == (2, 10)


def test_a_sharded_run_gives_the_big_model_an_indexed_job_asking_for_its_gpus(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    models = [row(f"ok-{i}", SMALL) for i in range(6)] + [row("ok-huge", HUGE)]
    settings = ClusterSettings(namespace=NS, image=IMAGE, telemetry=False,
                               poll_interval_s=0.02, max_parallel=8)
    spec = WorkerSpec(run_id=RUN_ID, store_url=store.url, max_retries=2)
    job_settings = settings.job_settings(run_id=RUN_ID, instance=sweep_instance(store.url),
                                         gpus_per_job=1, worker=spec.invocation())
    backend = ShardedBackend(
        settings, kube, spec=spec, job_settings=job_settings, store=store,
        classes=default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB),
        size=lambda r: int(r.metadata["size_bytes"]), gpus=gpu_counts(), poll_s=0.02)
    out = io.StringIO()
    assert backend.dry_run([Task.for_model(m) for m in models], out) == 2
    assert "# class gpu-x4: 1 model(s) in 1 shard(s), 1 pod(s) at once" in out.getvalue()
    recorder = Recorder(store, RUN_ID)
    with IndexedJobSimulator(sim, namespace=NS).autopilot(ShardWorker(store)):
        backend.run([Task.for_model(m) for m in models], recorder)
    assert recorder.done_count == len(models)
    jobs = {j["metadata"]["name"]: j for j in sim.objects("jobs", NS)}
    (x4,) = [j for name, j in jobs.items() if "gpu-x4" in name]
    assert gpu_request(x4) == "4" and x4["spec"]["parallelism"] == 1
    assert {gpu_request(j) for name, j in jobs.items() if "gpu-x4" not in name} == {"1"}
