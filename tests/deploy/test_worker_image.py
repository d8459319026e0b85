"""The worker image is named once, under kustomize's `images:` (the base's, or a user's own
overlay's), and is the image of the worker Jobs the controller creates.

The controller reads it when it starts from the PodTemplate esd-sweep-worker
(--worker-template, manifests/base/worker-image.yaml), where `images:` rewrites it. Checked
end to end: the manifests rendered by the real kustomize with the user's pin, the rendered
PodTemplate created in tests/support/kubesim.py's API server, the controller's arguments
from the rendered Job parsed by the real CLI, the sharded backend built from them as
`esd-sweep run` builds it, and the image read back from the Indexed Job it created.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s

from controller.backends.base import Task, WorkerSpec
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.sharded.backend import ShardedBackend
from controller.cli import build_parser, settings_from_args
from esd_worker.core.models.modellist import ModelRow
from tests.support.cluster import RETRY
from tests.support.kubesim import K8S_VERSIONS, KubeSim
from tests.support.kustomize import (
    MANIFESTS,
    Obj,
    container_env,
    controller_args,
    copy_manifests,
    expand,
    one,
    pod_spec,
    render_components,
)

NS = "esd-sweep"  # the manifests' namespace, which the controller's --namespace expands to
DIGEST = "sha256:" + "0123456789abcdef" * 4
REPO = "registry.internal/ml/esd-sweep"
PINS = {"tag": {"newTag": "0.2.0"}, "digest": {"digest": DIGEST}}
WANT = {"tag": f"{REPO}:0.2.0", "digest": f"{REPO}@{DIGEST}"}


def _base_worker_name() -> str:
    """The worker image's name as the base's `images:` leaves it: what an overlay matches."""
    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    (worker,) = [i for i in base["images"] if i["name"] == "esd-sweep"]
    name: str = worker["newName"]
    return name


def _in_overlay(pin: str) -> list[Obj]:
    """The base and the gpu-exporter component under a user's kustomization whose own
    `images:` pins the worker image (the base left untouched)."""
    extra = ["images:", f"  - name: {_base_worker_name()}", f"    newName: {REPO}",
             *(f"    {k}: {v!r}" for k, v in PINS[pin].items())]
    return render_components(("gpu-exporter",), extra=extra)


def _in_base(pin: str, tmp_path: Path) -> list[Obj]:
    """The same, pinned in the base's own `images:` (a copy of manifests/)."""
    images = [{"name": "esd-sweep", "newName": REPO, **PINS[pin]},
              {"name": "esd-sweep-controller", "newName": REPO + "-controller",
               "newTag": "0.2.0"}]
    return render_components(("gpu-exporter",),
                             manifests=copy_manifests(tmp_path, images=images))


@pytest.fixture
def sim() -> Iterator[KubeSim]:
    with KubeSim() as server:
        yield server


def _worker_jobs_image(sim: KubeSim, objs: list[Obj], kind: str, store: str) -> str:
    """Apply the rendered PodTemplate, build the controller from the rendered `kind`'s args
    as `esd-sweep run` does, create its Jobs (--no-wait): the image they got."""
    template = one(objs, "PodTemplate", "esd-sweep-worker")
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_namespaced_pod_template(NS, template)
    args, container = controller_args(objs, kind)
    env = container_env(container, objs, "esd-sweep")
    settings = settings_from_args(build_parser().parse_args(
        [expand(a, env) for a in args][1:]))
    assert settings.cluster.worker_template == "esd-sweep-worker"
    # The store is a local folder here (the manifests' s3:// output is checked, not used),
    # and the Jobs are created without waiting for them.
    settings = dataclasses.replace(
        settings, cluster=dataclasses.replace(settings.cluster, wait=False))
    spec = WorkerSpec(run_id="20261123T070501Z-aaaaaa", store_url=store, max_retries=2)
    row = ModelRow(model_id="org/m", revision=None, relation="", source_model=None,
                   metadata={"size_bytes": str(10**9)})
    with KubeClient(sim.configuration(), retry=RETRY) as kube:
        backend = ShardedBackend.from_settings(settings, spec, kube=kube)
        assert backend.run([Task.for_model(row)], lambda _: None) == []
    (job,) = sim.objects("jobs", NS)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    image: str = worker["image"]
    return image


@pytest.mark.parametrize("kind", ["Job", "CronJob"])
@pytest.mark.parametrize("pin", sorted(PINS))
@pytest.mark.parametrize("where", ["overlay", "base"])
def test_the_pinned_worker_image_is_the_worker_jobs(
    sim: KubeSim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, pin: str,
    kind: str,
) -> None:
    """A pin by tag or by digest, in a user's overlay or in the base, is the rendered
    PodTemplate's image, the GPU exporter's, and the image of the worker Jobs a controller
    started from the rendered Job (or CronJob) creates."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # sizes come from the row's size_bytes
    objs = _in_overlay(pin) if where == "overlay" else _in_base(pin, tmp_path)
    want = WANT[pin]
    (template,) = pod_spec(one(objs, "PodTemplate", "esd-sweep-worker"))["containers"]
    assert template["image"] == want
    assert pod_spec(one(objs, "DaemonSet"))["containers"][0]["image"] == want
    args, _ = controller_args(objs, kind)
    assert not any(a.startswith("--image") for a in args)  # nothing for `images:` to miss
    assert _worker_jobs_image(sim, objs, kind, str(tmp_path / "store")) == want


def test_the_controller_may_read_the_template(sim: KubeSim) -> None:
    """The PodTemplate as rendered is one the API server takes (strict schema), and the
    client reads it back."""
    objs = render_components(())
    template: dict[str, Any] = one(objs, "PodTemplate", "esd-sweep-worker")
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_namespaced_pod_template(NS, template)
    with KubeClient(sim.configuration(), retry=RETRY) as kube:
        read = kube.read_pod_template(NS, "esd-sweep-worker")
        assert read is not None and read["metadata"]["name"] == "esd-sweep-worker"
        assert kube.read_pod_template(NS, "missing") is None
