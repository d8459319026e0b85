"""manifests/kueue/cluster-queue.yaml, the admin's sample ClusterQueue: valid for Kueue's
v1beta2 CRDs and what the kueue component's LocalQueue and namespace expect.

Validated against the vendored v1beta2 openAPIV3Schema of Kueue v0.19.2 (tests/data/kueue),
strictly as kubectl's field validation is (an unknown field, such as v1beta1's `cohort`, is
an error), and against the CRD's CEL rules that a hand-written queue can break. Whether it
admits the Jobs the controller builds is tests/controller/backends/kubernetes/
test_kueue_admission.py's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.support.kustomize import KUSTOMIZATIONS, MANIFESTS, read_yaml12, render_kustomization

SAMPLE = MANIFESTS / "kueue" / "cluster-queue.yaml"
SCHEMAS = Path(__file__).resolve().parent.parent / "data" / "kueue"
COVERED = ["cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"]


def strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others: the API
    server's pruning, refused instead of dropped (kubectl's --validate=strict)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get(
                "x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def schema_of(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{kind.lower()}-v1beta2.schema.json")
                                     .read_text())
    return doc


def sample() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in read_yaml12(SAMPLE.read_text())}


def validate(obj: dict[str, Any]) -> None:
    schema = strict(schema_of(obj["kind"]))
    # metadata is `type: object` in a CRD's schema: the API server checks it itself.
    jsonschema.Draft7Validator(schema).validate(obj)


def test_the_sample_is_a_resource_flavor_and_a_cluster_queue_of_v1beta2() -> None:
    docs = read_yaml12(SAMPLE.read_text())
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [
        ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"), ("kueue.x-k8s.io/v1beta2", "ClusterQueue")]
    for doc in docs:
        validate(doc)
        assert "namespace" not in doc["metadata"]  # both are cluster-scoped


@pytest.mark.parametrize(("kind", "path", "value"), [
    pytest.param("ClusterQueue", ("spec",), {"cohort": "x"}, id="v1beta1-cohort"),
    pytest.param("ClusterQueue", ("spec", "resourceGroups", 0, "flavors", 0, "resources", 0),
                 {"quota": 1}, id="misspelt-nominalQuota"),
    pytest.param("ClusterQueue", ("spec",), {"queueingStrategy": "FIFO"}, id="bad-strategy"),
    pytest.param("ResourceFlavor", ("spec",), {"nodeLabel": {}}, id="misspelt-nodeLabels"),
])
def test_the_validation_refuses_what_the_api_server_would(
    kind: str, path: tuple[str | int, ...], value: dict[str, Any],
) -> None:
    """The check has teeth: a field v1beta2 does not have, or a value out of its enum."""
    obj = copy.deepcopy(sample()[kind])
    node: Any = obj
    for step in path:
        node = node[step]
    node.update(value)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_flavors_list_the_covered_resources_in_order_and_exist() -> None:
    """The CRD's rule "flavors must have the same number of resources as the
    coveredResources" and the webhook's order; every flavor named has its ResourceFlavor;
    no borrowingLimit without a cohort (the CRD's other rule)."""
    queue, flavor = sample()["ClusterQueue"], sample()["ResourceFlavor"]
    (group,) = queue["spec"]["resourceGroups"]
    assert group["coveredResources"] == COVERED
    for f in group["flavors"]:
        assert [r["name"] for r in f["resources"]] == group["coveredResources"]
        assert all("borrowingLimit" not in r for r in f["resources"])
        assert f["name"] == flavor["metadata"]["name"]


def test_the_local_queue_and_the_namespace_are_what_the_sample_admits() -> None:
    """The kueue overlay's LocalQueue points at this ClusterQueue, from the namespace its
    namespaceSelector selects (by the label the API server sets on every namespace)."""
    objs = render_kustomization(MANIFESTS / "overlays" / "kueue")
    (local,) = [o for o in objs if o["kind"] == "LocalQueue"]
    queue = sample()["ClusterQueue"]
    assert local["spec"]["clusterQueue"] == queue["metadata"]["name"] == "gpu-cluster-queue"
    assert queue["spec"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": local["metadata"]["namespace"]}}


def test_no_kustomization_applies_the_sample() -> None:
    """Cluster-scoped and the admin's: `kubectl apply -k manifests/...` never creates it."""
    for name, path in KUSTOMIZATIONS.items():
        kinds = {o["kind"] for o in render_kustomization(path)}
        assert not kinds & {"ClusterQueue", "ResourceFlavor"}, name
