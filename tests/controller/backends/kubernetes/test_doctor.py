"""`esd-sweep doctor --backend kubernetes` against the simulated cluster: the real kubernetes
client from a kubeconfig, KubeSim's API server (nodes, SelfSubjectAccessReviews answered
from `forbid`), and the real exporter HTTP server (controller.gpu.exporter) found as a pod."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from controller.cli import main
from controller.doctor.kubernetes import CONTROLLER_PERMISSIONS, Permission
from controller.gpu.exporter import GpuReading, make_server
from tests.support import REPO_ROOT
from tests.support.cluster import NS, write_kubeconfig
from tests.support.kubesim import KubeSim

pytestmark = pytest.mark.usefixtures("restore_logging", "kubeconfig")

EXPORTER_LABELS = {"app.kubernetes.io/name": "esd-gpu-exporter"}  # --telemetry-selector's


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def exporter_port() -> Iterator[int]:
    """Our exporter serving node-a's two GPUs on 127.0.0.1 (an exporter pod's address)."""
    readings = [GpuReading(i, f"GPU-node-a-{i}", "NVIDIA H100 80GB HBM3", used, 81559.0 - used,
                           81559.0) for i, used in enumerate((3.0, 40000.0))]
    server = make_server("127.0.0.1", 0, lambda: list(readings), "node-a", cache_s=0.0)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_node(sim: KubeSim, name: str, gpus: int, labels: dict[str, str] | None = None) -> None:
    allocatable = {"cpu": "32", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_node({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
        "status": {"allocatable": allocatable, "capacity": allocatable}})


def add_exporter_pod(sim: KubeSim, namespace: str = NS, node: str = "node-a") -> None:
    core = k8s.CoreV1Api(sim.api_client(bypass=True))
    name = f"exporter-{node}"
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": EXPORTER_LABELS},
        "spec": {"nodeName": node, "containers": [{"name": "exporter", "image": "x"}]}})
    core.patch_namespaced_pod_status(name, namespace, {"status": {
        "phase": "Running", "podIP": "127.0.0.1"}},
        _content_type="application/merge-patch+json")


@pytest.fixture
def healthy(sim: KubeSim) -> KubeSim:
    """A GPU node with 8 GPUs, a CPU node, an exporter pod on the GPU node."""
    add_node(sim, "node-a", 8, {"pool": "gpu"})
    add_node(sim, "cpu-a", 0, {"pool": "cpu"})
    add_exporter_pod(sim)
    return sim


def doctor(argv: list[str], port: int, capsys: pytest.CaptureFixture[str],
           ) -> tuple[int, dict[str, str]]:
    code = main(["doctor", "--backend", "kubernetes", "--namespace", NS,
                 "--telemetry-port", str(port), *argv])
    lines = capsys.readouterr().out.splitlines()
    return code, {line.split(":", 1)[0].split(" ", 1)[1]: line for line in lines}


def test_healthy_cluster(healthy: KubeSim, exporter_port: int,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """Every check passes, one access review per controller permission, nothing created."""
    code, lines = doctor([], exporter_port, capsys)
    assert code == 0, lines
    assert list(lines) == ["gpus", "worker", "store", "hf-token", "kube-api", "kube-rbac",
                           "kube-nodes", "kube-secrets", "kube-telemetry"]
    assert lines["gpus"].startswith("– gpus: not this machine's")
    assert lines["kube-api"].startswith(f"✓ kube-api: {healthy.url} answers")
    assert "Kubernetes v1.31.0, namespace esd" in lines["kube-api"]
    assert lines["kube-rbac"] == ("✓ kube-rbac: allowed: create, get, list, watch, delete "
                                  "jobs.batch; list pods; get pods/log; list, create events; get "
                                  "podtemplates in namespace esd")
    assert lines["kube-nodes"] == ("✓ kube-nodes: 1 of 2 node(s) expose nvidia.com/gpu: 8 "
                                   "GPU(s) allocatable (node-a 8)")
    assert lines["kube-telemetry"] == ("✓ kube-telemetry: 1 of 1 exporter(s) answered: 2 GPU(s) "
                                       "on 1 node(s) (node-a)")
    assert healthy.count("create", "selfsubjectaccessreviews") == len(CONTROLLER_PERMISSIONS)
    assert healthy.objects("jobs") == [] and healthy.count("create", "jobs") == 0


@pytest.mark.parametrize(
    ("verb", "resource", "named"),
    [
        pytest.param("create", "jobs", "create jobs.batch", id="create-jobs"),
        pytest.param("watch", "jobs", "watch jobs.batch", id="watch-jobs"),
        pytest.param("get", "pods/log", "get pods/log", id="pod-logs"),
        pytest.param("list", "events", "list events", id="events"),
    ],
)
def test_a_denied_verb_is_named(healthy: KubeSim, exporter_port: int, verb: str, resource: str,
                                named: str, capsys: pytest.CaptureFixture[str]) -> None:
    healthy.forbid(verb, resource, namespace=NS)
    code, lines = doctor([], exporter_port, capsys)
    assert code == 1
    assert lines["kube-rbac"].startswith(f"✗ kube-rbac: missing: {named} in namespace esd — "
                                         "fix: apply the controller's Role")
    assert lines["kube-nodes"].startswith("✓") and lines["kube-api"].startswith("✓")


def test_telemetry_namespace_of_its_own(sim: KubeSim, exporter_port: int,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Exporters in gpu-operator: their listing is asked about there; denied, both the RBAC
    and the telemetry lines say so."""
    add_node(sim, "node-a", 8)
    add_exporter_pod(sim, namespace="gpu-operator")
    argv = ["--telemetry-namespace", "gpu-operator"]
    code, lines = doctor(argv, exporter_port, capsys)
    assert code == 0, lines
    assert lines["kube-rbac"].endswith("list, create events; get podtemplates in namespace "
                                       "esd; list pods in namespace gpu-operator")
    sim.forbid("list", "pods", namespace="gpu-operator")
    code, lines = doctor(argv, exporter_port, capsys)
    assert code == 1
    assert "missing: list pods in namespace gpu-operator" in lines["kube-rbac"]
    assert lines["kube-telemetry"].startswith("✗ kube-telemetry: cannot list the exporter pods")


@pytest.mark.parametrize(
    ("argv", "code", "line"),
    [
        pytest.param([], 1, "✗ kube-nodes: none of the 1 node(s) has allocatable nvidia.com/gpu "
                     "— fix: install the NVIDIA device plugin", id="auto-needs-gpu-nodes"),
        pytest.param(["--device", "cpu"], 0, "• kube-nodes: none of the 1 node(s) has "
                     "allocatable nvidia.com/gpu: fine with --device cpu", id="cpu-does-not"),
    ],
)
def test_no_gpu_nodes(sim: KubeSim, exporter_port: int, argv: list[str], code: int, line: str,
                      capsys: pytest.CaptureFixture[str]) -> None:
    add_node(sim, "cpu-a", 0)
    add_exporter_pod(sim)
    got, lines = doctor(argv, exporter_port, capsys)
    assert got == code
    assert lines["kube-nodes"].startswith(line)


def test_node_selector_narrows_the_nodes(healthy: KubeSim, exporter_port: int,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = doctor(["--node-selector", "pool=cpu"], exporter_port, capsys)
    assert code == 1
    assert "none of the 1 node(s) matching --node-selector pool=cpu" in lines["kube-nodes"]


def test_nodes_that_cannot_be_listed_are_not_a_failure(
    healthy: KubeSim, exporter_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The controller's Role grants no node access (the sweep needs none)."""
    healthy.fail("list", "nodes", status=403, times=None,
                 message='nodes is forbidden: User "system:serviceaccount:esd:esd-sweep" '
                 'cannot list resource "nodes" in API group "" at the cluster scope')
    code, lines = doctor([], exporter_port, capsys)
    assert code == 0
    assert lines["kube-nodes"].startswith("• kube-nodes: cannot list nodes, so GPU nodes are "
                                          "not checked")


@pytest.mark.parametrize(
    ("setup", "argv", "code", "start"),
    [
        pytest.param("silent", [], 1, "✗ kube-telemetry: none of the 1 exporter(s) answered "
                     "with GPU readings; no answer: http://127.0.0.1:", id="not-answering"),
        pytest.param("no-pods", [], 1, "✗ kube-telemetry: no running exporter pod "
                     "(app.kubernetes.io/name=esd-gpu-exporter in namespace esd)",
                     id="no-exporter"),
        pytest.param("no-pods", ["--no-telemetry"], 0, "– kube-telemetry: --no-telemetry",
                     id="off"),
        pytest.param("no-pods", ["--telemetry-url", "{url}"], 0,
                     "✓ kube-telemetry: 1 of 1 exporter(s) answered", id="fixed-url"),
        pytest.param("no-pods", ["--kueue-queue", "gpu"], 0,
                     "– kube-telemetry: Kueue admits the Jobs", id="kueue"),
    ],
)
def test_telemetry(sim: KubeSim, exporter_port: int, setup: str, argv: list[str], code: int,
                   start: str, capsys: pytest.CaptureFixture[str]) -> None:
    add_node(sim, "node-a", 8)
    port = exporter_port
    if setup == "silent":
        add_exporter_pod(sim)
        port = free_port()  # the pod's port answers nothing
    url = f"http://127.0.0.1:{exporter_port}/metrics"
    got, lines = doctor([a.replace("{url}", url) for a in argv], port, capsys)
    assert got == code, lines
    assert lines["kube-telemetry"].startswith(start)


def test_kueue_workloads_are_asked_about(healthy: KubeSim, exporter_port: int,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    healthy.forbid("list", "workloads", namespace=NS)
    code, lines = doctor(["--kueue-queue", "gpu"], exporter_port, capsys)
    assert code == 1
    assert "missing: list workloads.kueue.x-k8s.io in namespace esd" in lines["kube-rbac"]


@pytest.mark.parametrize("kind", ["unreachable", "no-kubeconfig"])
def test_api_not_usable(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing"
    if kind == "unreachable":
        path = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}", namespace=NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    code, lines = doctor([], free_port(), capsys)
    assert code == 1
    assert lines["kube-api"].startswith("✗ kube-api:")
    expected = "cannot reach the API server" if kind == "unreachable" else "cannot load"
    assert expected in lines["kube-api"]
    for name in ("kube-rbac", "kube-nodes", "kube-telemetry"):
        assert lines[name].startswith(f"– {name}: not checked")


def test_the_permissions_asked_about_are_the_controllers_role() -> None:
    """CONTROLLER_PERMISSIONS is what manifests/base/rbac.yaml grants the controller (which
    tests/deploy/test_rbac.py holds equal to what KubeClient calls): no more, no less."""
    docs = list(yaml.safe_load_all((REPO_ROOT / "manifests/base/rbac.yaml").read_text()))
    role: dict[str, Any] = next(d for d in docs if d["kind"] == "Role"
                                and d["metadata"]["name"] == "esd-sweep-controller")
    granted = {Permission(verb, resource, group) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert set(CONTROLLER_PERMISSIONS) == granted
    assert len(CONTROLLER_PERMISSIONS) == len(granted)
