"""The manifests' RBAC allows exactly what the controller calls: nothing missing, nothing extra.

What the controller calls is not written down by hand: every public method of
controller.backends.kubernetes.common.client.KubeClient (the only code that talks to the API
server) is run against tests/support/kubesim.py's API server, which counts the requests it
serves by (verb, resource), and the union is compared with the rules the manifests grant
the controller's service account. A KubeClient method added later fails
`test_every_client_method_is_exercised` until it has a row in CALLS here (and, if it needs a
new verb, a rule in manifests/base/rbac.yaml).
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from controller.backends.kubernetes.common.client import KubeClient, RetryPolicy
from controller.backends.kubernetes.common.errors import KubePermissionError
from controller.backends.kubernetes.common.jobevents import build_event
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import managed_selector
from esd_worker.core.models.naming import model_key
from tests.support.kubesim import RESOURCES, KubeSim
from tests.support.kustomize import KUSTOMIZATIONS, Obj, components_of, render_kustomization

NS = "esd-sweep"
CONTROLLER_SA = "esd-sweep-controller"
FAST = RetryPolicy(attempts=2, base_s=0.001, max_s=0.01, deadline_s=2.0)
MODEL = "openai-community/gpt2"
# Resources without a namespace: permissions for them come from a ClusterRole.
CLUSTER_SCOPED = frozenset({"nodes"})
# The KubeClient methods the controller calls in the telemetry namespace
# (controller.backends.kubernetes.common.placement lists the exporter pods there, then scrapes them
# over HTTP, which RBAC does not cover).
TELEMETRY_METHODS = frozenset({"list_pods"})
# The KubeClient methods only a sweep with Kueue calls (why a Job is still suspended, from
# its Workload): granted by the kueue component alone.
KUEUE_METHODS = frozenset({"list_workloads"})

Perm = tuple[str, str, str]  # (API group, resource, verb), as an RBAC rule spells them


def _job() -> dict[str, Any]:
    return build_job(
        model_ref=MODEL, model_key=model_key(MODEL), relation="", source_model=None,
        output_url="s3://esd-results/atlas",
        settings=JobSettings(image="registry.example.com/esd/esd-sweep:0.1.0", namespace=NS,
                             run_id="rbac"))


def _event() -> dict[str, Any]:
    job = {"metadata": {"name": "esd-rbac-job", "namespace": NS, "uid": "0-1"}}
    return build_event(job, type_="Normal", reason="ShardsCreated", message="rbac",
                       host="controller-pod", when=datetime.datetime.now(datetime.UTC),
                       serial=1)


# One call of every KubeClient method, as the controller makes it (arguments matter only in
# that they reach the server: a 404 is still a request RBAC had to allow).
CALLS: dict[str, Callable[[KubeClient], Any]] = {
    "create_job": lambda kube: kube.create_job(NS, _job()),
    "read_job": lambda kube: kube.read_job(NS, "esd-missing-0123456789"),
    "read_pod_template": lambda kube: kube.read_pod_template(NS, "esd-sweep-worker"),
    "list_jobs": lambda kube: kube.list_jobs(NS, managed_selector()),
    "watch_jobs": lambda kube: list(kube.watch_jobs(NS, managed_selector(), None, timeout_s=1)),
    "delete_job": lambda kube: kube.delete_job(NS, "esd-missing-0123456789"),
    "list_pods": lambda kube: kube.list_pods(NS, "batch.kubernetes.io/job-name=x"),
    "read_pod_log": lambda kube: kube.read_pod_log(NS, "missing-pod"),
    "list_events": lambda kube: kube.list_events(NS, "involvedObject.name=missing-pod"),
    "create_event": lambda kube: kube.create_event(NS, _event()),
    "list_workloads": lambda kube: kube.list_workloads(NS, "kueue.x-k8s.io/job-uid=x"),
    # GET /version: a non-resource URL every authenticated user may read (the default
    # ClusterRole system:public-info-viewer); no Role rule can grant or refuse it.
    "server_version": lambda kube: kube.server_version(),
}
NON_RESOURCE = {"server_version": "/version"}
_NOT_API_CALLS = frozenset({"close"})


def _group_of(resource: str) -> str:
    plural = resource.split("/")[0]
    for key in RESOURCES:
        *api, name = key.split("/")
        if name == plural:
            return api[0] if len(api) == 2 else ""
    raise AssertionError(f"kubesim does not serve {resource}: add it to tests/support/kubesim.py")


@pytest.fixture(scope="module")
def sim() -> Iterator[KubeSim]:
    with KubeSim() as server:
        yield server


@pytest.fixture(scope="module")
def requests_by_method(sim: KubeSim) -> dict[str, set[Perm]]:
    """{method: the (group, resource, verb) requests it sent}, from the server's counters."""
    out: dict[str, set[Perm]] = {}
    with KubeClient(sim.configuration(), retry=FAST) as kube:
        for method, call in CALLS.items():
            before = dict(sim.emulator.counts)
            call(kube)
            after = dict(sim.emulator.counts)
            out[method] = {(_group_of(resource), resource, verb)
                           if resource not in (None, "None") else ("", NON_RESOURCE[method], "get")
                           for (verb, resource), n in after.items()
                           if n > before.get((verb, resource), 0)}
    return out


def granted(objs: list[Obj], subject: str, subject_ns: str, *,
            namespace: str | None) -> set[Perm]:
    """What the service account may do: in `namespace` through RoleBindings there, or
    cluster-wide (namespace=None) through ClusterRoleBindings. Wildcards are refused."""
    binding_kind, role_kind = (("RoleBinding", "Role") if namespace
                               else ("ClusterRoleBinding", "ClusterRole"))
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == role_kind
             and o["metadata"].get("namespace") == namespace}
    perms: set[Perm] = set()
    for binding in objs:
        if binding["kind"] != binding_kind or binding["metadata"].get("namespace") != namespace:
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == subject
                   and s.get("namespace") == subject_ns for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        assert ref["kind"] == role_kind, f"{binding['metadata']['name']} binds a {ref['kind']}"
        for rule in roles[ref["name"]]["rules"]:
            for part in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[part], f"wildcard in {ref['name']}"
            assert not rule.get("resourceNames"), "resourceNames: the Jobs' names vary"
            perms |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                      for v in rule["verbs"]}
    return perms


def test_every_client_method_is_exercised() -> None:
    """CALLS covers the whole KubeClient API surface, so nothing escapes the comparison."""
    public = {name for name, member in inspect.getmembers(KubeClient, inspect.isfunction)
              if not name.startswith("_")}
    assert public - _NOT_API_CALLS == set(CALLS)


def test_each_method_sends_what_its_name_says(requests_by_method: dict[str, set[Perm]]) -> None:
    """The recording works: each call reached the server as one kind of request."""
    assert requests_by_method["create_job"] == {("batch", "jobs", "create")}
    assert requests_by_method["watch_jobs"] == {("batch", "jobs", "watch")}
    assert requests_by_method["read_pod_log"] == {("", "pods/log", "get")}
    assert requests_by_method["server_version"] == {("", "/version", "get")}
    assert all(len(perms) == 1 for perms in requests_by_method.values()), requests_by_method


@pytest.mark.parametrize("overlay", ["default", "kueue", "autoscaling", "dcgm-exporter", "eks",
                                     "gke"])
def test_controller_role_is_exactly_what_it_calls(
    requests_by_method: dict[str, set[Perm]], overlay: str,
) -> None:
    """Namespaced: the Roles bound in the sweep's namespace equal the calls on namespaced
    resources (Kueue's Workloads only with the kueue component, the only setup that reads
    them). Cluster-wide: the ClusterRoles bound equal the calls on cluster-scoped ones
    (none today: no KubeClient method reads nodes, so no ClusterRole is granted)."""
    objs = render_kustomization(KUSTOMIZATIONS[overlay])
    methods = set(CALLS) - (set() if "kueue" in components_of(overlay) else KUEUE_METHODS)
    called = set().union(*(requests_by_method[m] for m in methods)) - {
        ("", url, "get") for url in NON_RESOURCE.values()}  # every user may: no rule needed
    namespaced = {p for p in called if p[1].split("/")[0] not in CLUSTER_SCOPED}
    cluster = called - namespaced
    assert granted(objs, CONTROLLER_SA, NS, namespace=NS) == namespaced
    assert granted(objs, CONTROLLER_SA, NS, namespace=None) == cluster


def test_dcgm_overlay_grants_exactly_the_telemetry_calls(
    requests_by_method: dict[str, set[Perm]],
) -> None:
    """With the GPU operator's dcgm-exporter, the controller lists pods in gpu-operator:
    that, and nothing more, is granted there."""
    objs = render_kustomization(KUSTOMIZATIONS["dcgm-exporter"])
    telemetry = set().union(*(requests_by_method[m] for m in TELEMETRY_METHODS))
    assert granted(objs, CONTROLLER_SA, NS, namespace="gpu-operator") == telemetry


def test_worker_gets_no_api_access() -> None:
    """The worker never talks to the API server: bound to nothing, and no token mounted."""
    objs = render_kustomization(KUSTOMIZATIONS["default"])
    for namespace in (NS, None):
        assert granted(objs, "esd-sweep-worker", NS, namespace=namespace) == set()
    sa = next(o for o in objs if o["kind"] == "ServiceAccount"
              and o["metadata"]["name"] == "esd-sweep-worker")
    assert sa["automountServiceAccountToken"] is False


@pytest.mark.parametrize("method", sorted(set(CALLS) - set(NON_RESOURCE)))
def test_a_denial_names_a_rule_the_role_has(sim: KubeSim, method: str,
                                            requests_by_method: dict[str, set[Perm]]) -> None:
    """When RBAC is missing a verb, the controller's message
    (controller.backends.kubernetes.common.client) names the verb and resource to add, and that is
    a rule the shipped Role grants: a user who trimmed the Role is told how to put back
    exactly what was taken out."""
    (perm,) = requests_by_method[method]
    group, resource, verb = perm
    setup = "kueue" if method in KUEUE_METHODS else "default"
    role = granted(render_kustomization(KUSTOMIZATIONS[setup]), CONTROLLER_SA, NS,
                   namespace=NS)
    assert perm in role
    fault = sim.forbid(verb, resource, namespace=NS,
                       subject=f"system:serviceaccount:{NS}:{CONTROLLER_SA}")
    try:
        with KubeClient(sim.configuration(), retry=FAST) as kube, \
                pytest.raises(KubePermissionError) as caught:
            CALLS[method](kube)
    finally:
        sim.clear_faults()
    message = str(caught.value)
    assert f"add verb {verb} on {resource}" in message
    assert f'apiGroups: ["{group}"]' in message
    assert f"service account {NS}/{CONTROLLER_SA}" in message
    assert fault.hits >= 1
