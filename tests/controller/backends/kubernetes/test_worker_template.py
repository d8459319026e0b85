"""--worker-template: the worker image read from a PodTemplate when the run starts, and the
API server's version check in both modes.

`esd-sweep run --backend kubernetes` end to end against KubeSim through a kubeconfig (as in
test_cli_cluster.py): the template's image is the worker Jobs' (sharded, one Job per model,
--dry-run), a missing or imageless template and --image given with it are exit 2 in one
line; a server older than jobs.MIN_KUBERNETES is refused in one line by one Job per model
too (the sharded mode's refusal: test_sharded.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from controller.backends.kubernetes.common.client import KubeClient
from controller.cli import main
from controller.errors import SweepError
from esd_worker.core.store.stores import Store
from tests.support.cluster import NS, RETRY, make_backend, make_rows, run_models, write_list
from tests.support.kubesim import KubeSim

pytestmark = pytest.mark.usefixtures("restore_logging")

TEMPLATE_IMAGE = "registry.internal/ml/esd-sweep@sha256:" + "0123456789abcdef" * 4
FLAG_IMAGE = "ghcr.io/example/esd-sweep:0.1.0"


def template(containers: list[dict[str, Any]], name: str = "esd-sweep-worker") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": {"spec": {"containers": containers}}}


def create(sim: KubeSim, body: dict[str, Any]) -> None:
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_namespaced_pod_template(NS, body)


def args(tmp_path: Path, *extra: str) -> list[str]:
    models = write_list(tmp_path / "m.csv", ["org/alpha"])
    return ["run", "--backend", "kubernetes", "--namespace", NS, "--model-list", str(models),
            "--output-dir", str(tmp_path / "out"), "--allow-local-output", "--no-telemetry",
            "--no-wait", *extra]


@pytest.mark.parametrize("mode", [[], ["--shard-size", "1"]], ids=["sharded", "per-model"])
@pytest.mark.parametrize("containers", [
    [{"name": "worker", "image": TEMPLATE_IMAGE}],
    [{"name": "sidecar", "image": "busybox:1"}, {"name": "worker", "image": TEMPLATE_IMAGE}],
    [{"name": "esd", "image": TEMPLATE_IMAGE}],  # the only container, whatever its name
], ids=["worker", "worker-of-two", "only"])
def test_the_templates_image_is_the_worker_jobs(
    sim: KubeSim, kubeconfig: Path, tmp_path: Path, mode: list[str],
    containers: list[dict[str, Any]], capsys: pytest.CaptureFixture[str],
) -> None:
    create(sim, template(containers))
    assert main(args(tmp_path, "--worker-template", "esd-sweep-worker", *mode)) == 0
    (job,) = sim.objects("jobs", NS)
    assert {c["image"] for c in job["spec"]["template"]["spec"]["containers"]} == {
        TEMPLATE_IMAGE}
    logged = [x for x in capsys.readouterr().err.splitlines() if "worker image" in x]
    assert len(logged) == 1 and logged[0].endswith(
        f"INFO controller.backends.kubernetes.common.wiring: worker image {TEMPLATE_IMAGE} "
        f"(from PodTemplate esd-sweep-worker in namespace {NS} (--worker-template))")


def test_a_dry_run_reads_the_template_and_creates_nothing(
    sim: KubeSim, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    create(sim, template([{"name": "worker", "image": TEMPLATE_IMAGE}]))
    assert main(args(tmp_path, "--worker-template", "esd-sweep-worker", "--dry-run")) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs and all(d["spec"]["template"]["spec"]["containers"][0]["image"]
                        == TEMPLATE_IMAGE for d in docs)
    assert sim.count("create", "jobs") == 0 and sim.count("get", "podtemplates") == 1


@pytest.mark.parametrize(("setup", "extra", "message"), [
    (None, ["--image", FLAG_IMAGE],
     "give --image or --worker-template, not both"),
    (None, [],
     f"PodTemplate esd-sweep-worker not found in namespace {NS} (--worker-template): apply "
     "the manifests, or give --image"),
    (template([{"name": "worker"}]), [],
     f"PodTemplate esd-sweep-worker in namespace {NS} (--worker-template) has no image"),
    (template([{"name": "a", "image": "x:1"}, {"name": "b", "image": "y:1"}]), [],
     f"PodTemplate esd-sweep-worker in namespace {NS} (--worker-template) has no image"),
], ids=["with-image", "missing", "no-image", "no-worker-of-two"])
@pytest.mark.parametrize("mode", [[], ["--shard-size", "1"]], ids=["sharded", "per-model"])
def test_a_template_that_cannot_name_the_image_is_exit_2_in_one_line(
    sim: KubeSim, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    setup: dict[str, Any] | None, extra: list[str], message: str, mode: list[str],
) -> None:
    if setup is not None:
        create(sim, setup)
    code = main(args(tmp_path, "--worker-template", "esd-sweep-worker", *extra, *mode))
    err = capsys.readouterr().err
    assert code == 2
    assert len([x for x in err.splitlines() if message in x]) == 1, err
    assert "Traceback" not in err
    assert sim.count("create", "jobs") == 0


def test_without_the_flag_the_image_is_images_and_no_template_is_read(
    sim: KubeSim, kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--image's documented default is kept: env ESD_IMAGE when no --image is given."""
    monkeypatch.setenv("ESD_IMAGE", FLAG_IMAGE)
    assert main(args(tmp_path)) == 0
    (job,) = sim.objects("jobs", NS)
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == FLAG_IMAGE
    assert sim.count("get", "podtemplates") == 0


@pytest.mark.parametrize("version", ["1.30.9", "1.27.16-eks-a737599"])
def test_one_job_per_model_refuses_a_server_too_old_in_one_line(version: str,
                                                                store: Store) -> None:
    with KubeSim(server_version=version) as old, KubeClient(old.configuration(),
                                                            retry=RETRY) as kube:
        backend = make_backend(kube, store)
        with pytest.raises(SweepError) as raised:
            run_models(backend, make_rows(1))
        assert old.count("create", "jobs") == 0
    message = str(raised.value)
    assert "\n" not in message and "needs Kubernetes 1.31 or newer" in message
