"""Worker Job conventions both modes share (common.jobs, common.workerenv, common.names):
recommended labels, the HF token Secret required, GPU visibility of pods without GPUs, the
GPU resource (MIG slices), the /tmp volume's cap. Every object built here is also checked
against the strict schemas of the oldest and newest Kubernetes (jobs.MIN_KUBERNETES).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from controller import __version__
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import (
    is_extended_resource,
    is_label_value,
    version_label,
)
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from esd_worker.core.command.invocation import BatchOptions
from esd_worker.core.models.naming import model_key
from tests.support.kubesim import K8S_VERSIONS

MIG = "nvidia.com/mig-1g.10gb"


def settings(**overrides: Any) -> JobSettings:
    base = JobSettings(image="ghcr.io/example/esd-sweep:0.1.0", namespace="esd",
                       run_id="20261123T070501Z-3fa9c2", hf_token_secret="hf-token:token",
                       s3_secret="esd-s3")
    return replace(base, **overrides)


def per_model(**overrides: Any) -> dict[str, Any]:
    return build_job(model_ref="openai-community/gpt2",
                     model_key=model_key("openai-community/gpt2", None), relation="",
                     source_model=None, output_url="s3://esd-results/atlas",
                     settings=settings(**overrides))


def sharded(**overrides: Any) -> dict[str, Any]:
    job = settings(**overrides)
    job = replace(job, worker=job.worker.replace(batch=BatchOptions(run_id=job.run_id)))
    return build_indexed_job(
        run_id=job.run_id, class_name="gpu", completions=2, parallelism=1,
        backoff_limit_per_index=2, models=10,
        shards_url=f"s3://esd-results/atlas/_shards/{job.run_id}/gpu",
        output_url="s3://esd-results/atlas", settings=job)


BUILDERS = {"per-model": per_model, "sharded": sharded}


def pod(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def env_of(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod(job)["containers"][0]["env"]}


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_recommended_labels_on_jobs_and_pods(build: Any) -> None:
    """app.kubernetes.io/part-of and /version (the package's) beside name, instance,
    component, managed-by, on the Job and on its pods; every value a valid label value."""
    job = build()
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        assert labels["app.kubernetes.io/part-of"] == "esd-sweep"
        assert labels["app.kubernetes.io/version"] == __version__
        for key in ("name", "instance", "component", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels
        assert all(is_label_value(v) for v in labels.values()), labels


@pytest.mark.parametrize(("version", "label"), [
    ("0.1.0", "0.1.0"),
    ("0.2.0.dev3+g1a2b3c.d20261124", "0.2.0.dev3-g1a2b3c.d20261124"),
    ("1.0.0+", "1.0.0"),
    ("v" + "1" * 80, "v" + "1" * 62),
])
def test_version_label_is_a_valid_label_value(version: str, label: str) -> None:
    """A local version's "+" is not allowed in a label value: it becomes "-"; ends trimmed,
    63 characters at most."""
    assert version_label(version) == label
    assert is_label_value(label)


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_hf_token_secret_is_required_s3_keys_optional(build: Any) -> None:
    """A misnamed token Secret must stop the pod (CreateContainerConfigError, which the
    controller reads as the run's end), not reach the worker as "no token"; the S3 keys
    stay optional for IRSA / pod identity."""
    env = env_of(build())
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hf-token", "key": "token", "optional": False}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert env[key]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert "HF_TOKEN" not in env_of(build(hf_token_secret=None))


@pytest.mark.parametrize(("gpus", "visible"), [(0, "void"), (1, None), (4, None)])
@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_pods_without_gpus_see_none(build: Any, gpus: int, visible: str | None) -> None:
    """A CPU pod on a GPU node whose default runtime is nvidia sees no GPU (void); a GPU
    pod's visible devices are the device plugin's to set."""
    env = env_of(build(gpus_per_job=gpus))
    assert env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value") == visible
    assert "NVIDIA_VISIBLE_DEVICES" in "\n".join(settings(
        env={"NVIDIA_VISIBLE_DEVICES": "all"}).problems())


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_a_mig_slice_is_requested_and_limited(build: Any, version: str) -> None:
    """--gpu-resource nvidia.com/mig-1g.10gb: the pods request and limit that resource,
    not nvidia.com/gpu, and still tolerate the nvidia.com/gpu taint (MIG nodes carry it);
    the Job passes the strict schema."""
    job = build(gpu_resource=MIG, gpus_per_job=1)
    resources = pod(job)["containers"][0]["resources"]
    assert resources["requests"][MIG] == resources["limits"][MIG] == "1"
    assert "nvidia.com/gpu" not in resources["requests"] | resources["limits"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod(
        job)["tolerations"]
    kubernetes_validate.validate(job, version, strict=True)


@pytest.mark.parametrize(("name", "valid"), [
    ("nvidia.com/gpu", True),
    (MIG, True),
    ("nvidia.com/mig-3g.40gb", True),
    ("amd.com/gpu", True),
    ("gpu", False),
    ("nvidia.com/", False),
    ("/gpu", False),
    ("NVIDIA.com/gpu", False),
    ("nvidia.com/mig 1g", False),
    ("kubernetes.io/gpu", False),
    ("example.kubernetes.io/gpu", False),
    ("requests.nvidia.com/gpu", False),
    ("nvidia.com/" + "g" * 64, False),
])
def test_gpu_resource_names(name: str, valid: bool) -> None:
    """Extended resource names as the API server takes them; a bad one is a problem of the
    settings, named by field."""
    assert is_extended_resource(name) is valid
    problems = settings(gpu_resource=name).problems()
    assert (problems == []) is valid
    assert valid or problems[0].startswith("gpu_resource: ")


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_tmp_is_capped(build: Any) -> None:
    """/tmp (HOME, TMPDIR) is an emptyDir capped at 1Gi: a runaway temporary file gets the
    pod evicted, not the node's disk filled; the cache volume has its own cap."""
    volumes = {v["name"]: v for v in pod(build(ephemeral_storage_request="50Gi"))["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "1Gi"}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "50Gi"}
