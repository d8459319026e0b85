"""controller.backends.kubernetes.common.placement: Jobs placed by GPU telemetry (the real exporter
HTTP server, or exporter pods found by selector) or plainly, through the backend on KubeSim."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from controller.backends.base import Outcome
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.per_model.backend import KubernetesBackend
from controller.gpu.exporter import GpuReading, make_server
from esd_worker.core.store.stores import Store
from tests.support.cluster import (
    NS,
    MarkerSimulator,
    job_names,
    make_backend,
    make_rows,
    run_models,
)
from tests.support.kubesim import KubeSim
from tests.support.scheduler import Node, schedule

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
    idle GPU. Every Job prefers node-b, one at a time (the reservation holds until the pod
    runs there); none requires it."""
    busy, busy_url = _exporter("node-a", [30000.0, 41000.0])
    idle, idle_url = _exporter("node-b", [0.0, 52000.0])
    try:
        outcomes: list[Outcome] = []
        backend = make_backend(kube, store, telemetry=True,
                               telemetry_urls=(busy_url, idle_url), max_checks=2)
        with cluster.autopilot():
            run_models(backend, make_rows(3), outcomes)
    finally:
        for server in (busy, idle):
            server.shutdown()
            server.server_close()
    assert backend.placement == "telemetry"
    assert {o.status for o in outcomes} == {"done"}
    for job in sim.objects("jobs", NS):
        affinity = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        # The exact node name (matchFields), which the exporter reports from spec.nodeName:
        # the kubernetes.io/hostname label differs from it under --hostname-override.
        assert affinity == {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "preference": {"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}}]}


def test_the_scheduler_model_refuses_a_required_pin_to_a_full_node() -> None:
    """The model below is not permissive: a pod *required* on a node whose GPUs are all
    allocated stays pending (what hard pinning did), a preferred one goes elsewhere."""
    nodes = [Node("node-a", gpus=2, allocated=2), Node("node-b", gpus=2, allocated=1)]
    pod = {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}]}
    pinned = {**pod, "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In",
                              "values": ["node-a"]}]}]}}}}
    assert schedule(pinned, nodes) is None
    assert schedule(pod, nodes) == "node-b"
    assert schedule(pod, [Node("node-a", gpus=2, allocated=2)]) is None


def test_placement_never_pins_a_job_to_a_node_whose_gpus_are_all_allocated(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """node-a's two GPUs are allocated to workers still importing or downloading: their
    memory is idle, so telemetry ranks node-a first. The Jobs only prefer it; the scheduler
    (modelled by tests/support/scheduler.py: filter by free nvidia.com/gpu, then score the
    preference) binds them to node-b, which has a GPU left, and nothing waits on node-a."""
    idle_but_allocated, url_a = _exporter("node-a", [0.0, 0.0])
    half, url_b = _exporter("node-b", [0.0, 52000.0])
    try:
        backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url_a, url_b),
                               max_checks=1, wait=False)
        run_models(backend, make_rows(1))
    finally:
        for server in (idle_but_allocated, half):
            server.shutdown()
            server.server_close()
    assert backend.placement == "telemetry"
    (job,) = sim.objects("jobs", NS)
    pod = job["spec"]["template"]["spec"]
    node_affinity = pod["affinity"]["nodeAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in node_affinity
    preferred = node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["preference"]["matchFields"][0]["values"] == ["node-a"]
    nodes = [Node("node-a", gpus=2, allocated=2), Node("node-b", gpus=2, allocated=1)]
    assert schedule(pod, nodes) == "node-b"
    # Pending for room costs the run nothing: the deadline is the pod's, counted on a node.
    assert "activeDeadlineSeconds" not in job["spec"]
    assert pod["activeDeadlineSeconds"] == 6 * 3600


def test_under_kueue_telemetry_adds_no_affinity(
    sim: KubeSim, kube: KubeClient, store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """With a Kueue queue, Kueue's quota and the scheduler decide: even with exporters
    answering, Jobs carry no node affinity at all, and submission is not paced by them."""
    caplog.set_level(logging.INFO, logger="controller.backends.kubernetes.common.placement")
    busy, url = _exporter("node-a", [30000.0, 41000.0])
    try:
        backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url,),
                               kueue_queue="gpu-queue", wait=False)
        run_models(backend, make_rows(3))
    finally:
        busy.shutdown()
        busy.server_close()
    assert backend.placement == "plain"
    jobs = sim.objects("jobs", NS)
    assert len(jobs) == 3  # every GPU looks busy, yet all three are queued for Kueue
    for job in jobs:
        assert job["spec"]["suspend"] is True
        assert "affinity" not in job["spec"]["template"]["spec"]
    assert any("Kueue admits the Jobs" in r.getMessage() for r in caplog.records)


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
                           telemetry_port=9400, scrape_fn=fake_scrape)
    backend.placer.poll(0.0)
    assert scraped == [("http://10.0.0.1:9400/metrics", "node-0")]
    assert backend.placement == "plain"


def test_without_telemetry_jobs_are_plain_and_it_is_said_once(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No exporter pods: Jobs request nvidia.com/gpu without affinity; one log line says so."""
    caplog.set_level(logging.INFO, logger="controller.backends.kubernetes.common.placement")
    with cluster.autopilot():
        backend = make_backend(kube, store, telemetry=True)
        run_models(backend, make_rows(3))
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
        backend.placer.poll(0.0)
        run_models(backend, make_rows(5))
    finally:
        busy.shutdown()
        busy.server_close()
    jobs = sim.objects("jobs", NS)
    assert len(jobs) == 2
    for job in jobs:
        template = job["spec"]["template"]
        assert "affinity" not in template["spec"]
        assert template["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


def test_no_wait_with_telemetry_waits_for_the_checks(sim: KubeSim, kube: KubeClient,
                                                     store: Store) -> None:
    """GPUs count as free only after --max-checks polls: --no-wait does not give up before
    then, and submits pinned Jobs once the idle GPUs qualify."""
    idle, url = _exporter("node-b", [0.0, 0.0])
    try:
        backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url,),
                               max_checks=3, wait=False)
        run_models(backend, make_rows(3))
    finally:
        idle.shutdown()
        idle.server_close()
    assert len(job_names(sim)) == 2  # two idle GPUs, reserved until the pods run
    assert backend.placer.polls >= 3


def test_all_telemetry_stale_falls_back_to_plain_placement(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The exporter pod (found by selector, scraped over HTTP) answers once, then goes away.
    While its node's readings are younger than the staleness limit (60 s here) placement
    stays on telemetry; once every node is stale, Jobs only request nvidia.com/gpu
    (pinning to nothing would stall the sweep), and a warning says so."""
    from kubernetes import client as k8s

    caplog.set_level(logging.INFO, logger="controller.backends.kubernetes.common.placement")
    idle, url = _exporter("node-b", [0.0])
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    core = k8s.CoreV1Api(sim.api_client(bypass=True))
    core.create_namespaced_pod("gpu", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "exporter-0", "namespace": "gpu",
            "labels": {"app.kubernetes.io/name": "esd-gpu-exporter"}},
        "spec": {"nodeName": "node-b", "containers": [{"name": "x", "image": "x"}]}})
    core.patch_namespaced_pod_status("exporter-0", "gpu", {"status": {
        "phase": "Running", "podIP": "127.0.0.1"}},
        _content_type="application/merge-patch+json")
    now = [0.0]
    backend = make_backend(kube, store, telemetry=True, telemetry_namespace="gpu",
                           telemetry_port=port, clock=lambda: now[0])
    try:
        backend.placer.poll(now[0])
        assert backend.placement == "telemetry"
    finally:
        idle.shutdown()
        idle.server_close()
    core.delete_namespaced_pod("exporter-0", "gpu")
    assert_stale_telemetry_turns_plain(backend, now, sim, cluster, caplog)


def test_silent_fixed_exporters_fall_back_to_plain_placement(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--telemetry-url exporters that stop answering: the last readings are used while fresh,
    then placement turns plain instead of pinning Jobs to nothing (a sweep stalled for good)."""
    caplog.set_level(logging.INFO, logger="controller.backends.kubernetes.common.placement")
    now = [0.0]
    idle, url = _exporter("node-b", [0.0])
    backend = make_backend(kube, store, telemetry=True, telemetry_urls=(url,),
                           clock=lambda: now[0])
    try:
        backend.placer.poll(now[0])
        assert backend.placement == "telemetry"
    finally:
        idle.shutdown()
        idle.server_close()
    assert_stale_telemetry_turns_plain(backend, now, sim, cluster, caplog)


def assert_stale_telemetry_turns_plain(
    backend: KubernetesBackend, now: list[float], sim: KubeSim, cluster: MarkerSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After the last readings (at 0 s) nothing more comes: at 30 s node-b is still fresh
    and placement stays on telemetry; at 100 s every node is stale (the limit is 60 s), so
    Jobs only request nvidia.com/gpu, and a warning says so."""
    now[0] = 30.0
    backend.placer.poll(now[0])
    assert backend.placement == "telemetry"
    now[0] = 100.0
    backend.placer.poll(now[0])
    assert backend.placement == "plain"
    assert any("GPU telemetry lost" in r.getMessage() for r in caplog.records)
    outcomes: list[Outcome] = []
    with cluster.autopilot():
        run_models(backend, make_rows(2), outcomes)
    assert {o.status for o in outcomes} == {"done"}
    for job in sim.objects("jobs", NS):
        spec = job["spec"]["template"]["spec"]
        assert "affinity" not in spec
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
