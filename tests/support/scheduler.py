"""The part of kube-scheduler that decides whether a node can take a worker pod, for tests.

Filter, then score, as the default scheduler does: a node passes the filter when its
allocatable nvidia.com/gpu minus what pods already requested there covers the pod's request
(NodeResourcesFit), its labels match the pod's nodeSelector, and it satisfies the pod's
required node affinity (NodeAffinity filter). Among those, the preferred node affinity's
weights score (NodeAffinity score); ties go to the first node by name. What a preference
can never do is put a pod on a node that failed the filter: this is what the tests of
placement hold the controller to. Taints, other resources and spreading are left out.
`least_loaded` is the Indexed Job simulator's choice: required affinity, then fewest pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int  # allocatable nvidia.com/gpu
    allocated: int = 0  # nvidia.com/gpu requested by pods bound here
    labels: Mapping[str, str] = field(default_factory=dict)


def _requirement_holds(req: Mapping[str, Any], value: str | None) -> bool:
    op, values = req["operator"], req.get("values") or []
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    raise AssertionError(f"operator {op} is not modelled")


def term_matches(term: Mapping[str, Any], node: Node) -> bool:
    """A NodeSelectorTerm: every matchExpressions (labels) and matchFields (metadata.name)
    requirement holds."""
    for req in term.get("matchExpressions") or []:
        if not _requirement_holds(req, node.labels.get(req["key"])):
            return False
    for req in term.get("matchFields") or []:
        assert req["key"] == "metadata.name", req
        if not _requirement_holds(req, node.name):
            return False
    return True


def gpu_request(pod_spec: Mapping[str, Any]) -> int:
    return sum(int((c.get("resources") or {}).get("requests", {}).get(GPU, 0))
               for c in pod_spec.get("containers") or [])


def feasible(pod_spec: Mapping[str, Any], node: Node) -> bool:
    """The filter: GPUs left, nodeSelector, required node affinity."""
    if node.gpus - node.allocated < gpu_request(pod_spec):
        return False
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if node.labels.get(key) != value:
            return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is not None:
        return any(term_matches(t, node) for t in required["nodeSelectorTerms"])
    return True


def score(pod_spec: Mapping[str, Any], node: Node) -> int:
    preferred = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("preferredDuringSchedulingIgnoredDuringExecution")) or []
    return sum(int(p["weight"]) for p in preferred if term_matches(p["preference"], node))


def schedule(pod_spec: Mapping[str, Any], nodes: list[Node]) -> str | None:
    """The node the pod is bound to, or None: it stays Pending (Unschedulable)."""
    fits = [n for n in sorted(nodes, key=lambda n: n.name) if feasible(pod_spec, n)]
    if not fits:
        return None
    return max(fits, key=lambda n: score(pod_spec, n)).name


HOSTNAME = "kubernetes.io/hostname"


def least_loaded(pod_spec: Mapping[str, Any], nodes: Sequence[str],
                 load: Mapping[str | None, int]) -> str | None:
    """A node for a pod when GPUs are not modelled (the Indexed Job simulator): among the
    `nodes` (each labelled only with its kubernetes.io/hostname) that meet the pod's required
    node affinity, the one with the fewest running pods (`load`), ties to the first listed;
    None: none meets it (the pod stays Pending, Unschedulable). nodeSelector is not checked:
    these nodes carry no other label a test could select on."""
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    fits = [name for name in nodes if required is None or any(
        term_matches(t, Node(name, 0, labels={HOSTNAME: name}))
        for t in required["nodeSelectorTerms"])]
    return min(fits, key=lambda name: load.get(name, 0), default=None)
