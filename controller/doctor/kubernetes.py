"""`esd-sweep doctor --backend kubernetes`: can the sweep run on this cluster? One Check each.

Owns the cluster's checks, in order:

- kube-api: the kubeconfig context (or the pod's service account) loads and the API server
  answers (GET /version);
- kube-rbac: a SelfSubjectAccessReview for every verb the sweep's controller uses in its
  namespace (CONTROLLER_PERMISSIONS: what KubeClient calls, as manifests/base/rbac.yaml
  grants it), the exporter pods' listing in the telemetry namespace, and Kueue Workloads with
  --kueue-queue; the missing ones are named;
- kube-nodes: nodes (those matching --node-selector) with allocatable --gpu-resource
  (nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-1g.10gb); none is a failure unless
  --device cpu. The controller's Role grants no node access (the sweep
  needs none), so "cannot list nodes" is reported, not failed;
- kube-secrets: the Secrets --hf-token-secret and --s3-secret name, with their keys
  (controller.doctor.secrets);
- kube-telemetry: the GPU exporters the sweep would scrape (--telemetry-url, or the running
  pods of --telemetry-selector at --telemetry-port), scraped once each.

The doctor's own two calls (SelfSubjectAccessReview, list nodes) go through KubeClient's one
retry and error path but are not KubeClient methods: KubeClient's public methods are exactly
what the controller's Role must grant (tests/deploy/test_rbac.py), and these need no Role.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from controller.backends.kubernetes.common.client import (
    KubeClient,
    RetryPolicy,
    _json,
    _Op,
    load_client,
)
from controller.backends.kubernetes.common.errors import (
    KubeConfigError,
    KubeError,
    KubePermissionError,
)
from controller.backends.kubernetes.common.names import KUEUE_GROUP
from controller.backends.kubernetes.common.placement import exporter_targets
from controller.backends.kubernetes.common.settings import ClusterSettings, cluster_from_args
from controller.backends.kubernetes.common.telemetry import NodeGpu, TelemetryError, scrape
from controller.doctor.checks import FAIL, INFO, PASS, SKIP, Check
from controller.doctor.secrets import check_secrets
from controller.errors import SweepError

# A doctor answers in seconds: two tries, then the API counts as unreachable.
DOCTOR_RETRY = RetryPolicy(attempts=2, base_s=0.2, max_s=1.0, deadline_s=15.0)
_SHOWN = 5  # nodes / exporters named in a line


@dataclass(frozen=True)
class Permission:
    """One RBAC verb on a resource (plural, "pods/log" for a subresource) of an API group."""

    verb: str
    resource: str
    group: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


# What the controller's KubeClient calls in the sweep's namespace: manifests/base/rbac.yaml's
# Role, which tests/deploy/test_rbac.py holds equal to the client's calls.
CONTROLLER_PERMISSIONS: tuple[Permission, ...] = (
    *(Permission(verb, "jobs", "batch") for verb in ("create", "get", "list", "watch", "delete")),
    Permission("list", "pods"),
    Permission("get", "pods/log"),
    Permission("list", "events"),
    Permission("create", "events"),  # the sweep's Events on its Jobs (common.jobevents)
    Permission("get", "podtemplates"),  # the worker image (--worker-template)
)
# In the telemetry namespace: the exporter pods are listed to find their IPs.
TELEMETRY_PERMISSIONS = (Permission("list", "pods"),)
# With --kueue-queue: why a Job is still suspended, from its Workload.
KUEUE_PERMISSIONS = (Permission("list", "workloads", KUEUE_GROUP),)


def cluster_settings(args: argparse.Namespace) -> ClusterSettings:
    """ClusterSettings from doctor's kubernetes flags (those of `run`); bad ones: exit 2."""
    problems: list[str] = []
    # `run`'s flags that doctor does not take, at the values a sweep starts with.
    full = argparse.Namespace(**{"gpus_per_job": 1, "mode": "esd", **vars(args)})
    cluster = cluster_from_args(full, problems)
    if problems:
        raise SweepError("; ".join(problems))
    return cluster


def kube_checks(settings: ClusterSettings, *, device: str,
                kube: KubeClient | None = None) -> Iterator[Check]:
    """The cluster's checks, each as it finishes. kube: a client (tests); None loads one
    from the kubeconfig context (--kube-context) or the pod's service account."""
    client = kube
    if client is None:
        try:
            client = load_client(settings.kube_context, retry=DOCTOR_RETRY)
        except KubeConfigError as e:
            yield Check("kube-api", FAIL, str(e), "point KUBECONFIG or --kube-context at the "
                        "cluster (kubectl config get-contexts lists the contexts)")
            yield from _not_checked()
            return
    try:
        yield from _cluster_checks(client, settings, device)
    finally:
        if kube is None:
            client.close()


def _not_checked() -> Iterator[Check]:
    for name in ("kube-rbac", "kube-nodes", "kube-secrets", "kube-telemetry"):
        yield Check(name, SKIP, "not checked: the API server cannot be used (see kube-api)")


def _cluster_checks(kube: KubeClient, settings: ClusterSettings,
                    device: str) -> Iterator[Check]:
    host = kube._api.configuration.host
    context = settings.kube_context or "the current context"
    try:
        version = kube.server_version()
    except KubeError as e:
        fix = ("log in again or refresh the context's credentials" if e.status == 401 else
               "check the context's server address and the network to it (VPN, "
               "`kubectl version`)")
        yield Check("kube-api", FAIL, f"{host} ({context}): {e}", fix)
        yield from _not_checked()
        return
    yield Check("kube-api", PASS, f"{host} answers ({context}): Kubernetes "
                f"{version or '(version not given)'}, namespace {settings.namespace}")
    yield check_rbac(kube, settings, device)
    yield check_nodes(kube, settings, device)
    yield check_secrets(kube, settings)
    yield check_telemetry(kube, settings, device)


# -- RBAC ----------------------------------------------------------------------------------


def access_review(kube: KubeClient, namespace: str, permission: Permission) -> bool:
    """Whether the caller may do `permission` in `namespace` (a SelfSubjectAccessReview,
    which every authenticated user may create)."""
    resource, _, sub = permission.resource.partition("/")
    attributes = {"namespace": namespace, "verb": permission.verb, "group": permission.group,
                  "resource": resource, **({"subresource": sub} if sub else {})}
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes}}
    op = _Op("create", "selfsubjectaccessreviews", "authorization.k8s.io", "")
    resp = kube._call(op, kube._api.call_api, "/apis/authorization.k8s.io/v1/"
                      "selfsubjectaccessreviews", "POST", body=body,
                      header_params={"Accept": "application/json",
                                     "Content-Type": "application/json"},
                      auth_settings=["BearerToken"], _preload_content=False,
                      _return_http_data_only=True)
    doc = _json(resp) or {}
    return bool((doc.get("status") or {}).get("allowed"))


def sweep_permissions(settings: ClusterSettings,
                      device: str) -> list[tuple[str, Permission]]:
    """(namespace, permission) for everything the sweep's controller will do."""
    wanted = [(settings.namespace, p) for p in CONTROLLER_PERMISSIONS]
    if _telemetry_skipped(settings, device) is None and not settings.telemetry_urls:
        namespace = settings.telemetry_namespace or settings.namespace
        wanted += [(namespace, p) for p in TELEMETRY_PERMISSIONS]
    if settings.kueue_queue:
        wanted += [(settings.namespace, p) for p in KUEUE_PERMISSIONS]
    return list(dict.fromkeys(wanted))  # the telemetry namespace may be the sweep's


def check_rbac(kube: KubeClient, settings: ClusterSettings, device: str) -> Check:
    wanted = sweep_permissions(settings, device)
    missing: list[tuple[str, Permission]] = []
    for namespace, permission in wanted:
        try:
            if not access_review(kube, namespace, permission):
                missing.append((namespace, permission))
        except KubeError as e:
            return Check("kube-rbac", FAIL, f"cannot ask the API server what is allowed: {e}",
                         "check the permissions with `kubectl auth can-i --list -n "
                         f"{settings.namespace}`")
    if missing:
        return Check("kube-rbac", FAIL, f"missing: {_grouped(missing)}",
                     "apply the controller's Role (manifests/base/rbac.yaml: kubectl apply -k "
                     "manifests) or add these verbs to a Role bound to you")
    return Check("kube-rbac", PASS, f"allowed: {_grouped(wanted)}")


def _grouped(items: Sequence[tuple[str, Permission]]) -> str:
    """"create, get jobs.batch; list pods in namespace esd-sweep; …", in first-seen order."""
    by_namespace: dict[str, dict[str, list[str]]] = {}
    for namespace, p in items:
        by_namespace.setdefault(namespace, {}).setdefault(p.qualified, []).append(p.verb)
    return "; ".join(
        "; ".join(f"{', '.join(verbs)} {resource}" for resource, verbs in resources.items())
        + f" in namespace {namespace}" for namespace, resources in by_namespace.items())


# -- nodes ---------------------------------------------------------------------------------


def list_nodes(kube: KubeClient, label_selector: str) -> list[dict[str, Any]]:
    """Nodes matching the selector ("" for all), through KubeClient's paging and retries."""
    op = _Op("list", "nodes", "", "")

    def page(_namespace: str, **kwargs: Any) -> Any:
        return kube._core.list_node(**kwargs)

    items, _ = kube._list(op, page, "", label_selector=label_selector)
    return items


def _allocatable_gpus(node: dict[str, Any], resource: str) -> int:
    value = ((node.get("status") or {}).get("allocatable") or {}).get(resource, "0")
    try:
        return int(float(str(value)))
    except ValueError:
        return 0


def check_nodes(kube: KubeClient, settings: ClusterSettings, device: str) -> Check:
    selector = ",".join(f"{k}={v}" for k, v in settings.node_selector.items())
    where = f" matching --node-selector {selector}" if selector else ""
    try:
        nodes = list_nodes(kube, selector)
    except KubePermissionError as e:
        return Check("kube-nodes", INFO, f"cannot list nodes, so GPU nodes are not checked "
                     f"(the sweep itself never lists them): {e}")
    except KubeError as e:
        return Check("kube-nodes", FAIL, f"cannot list nodes: {e}",
                     "try again; `kubectl get nodes` shows whether the API answers")
    resource = settings.gpu_resource
    gpus = {str((n.get("metadata") or {}).get("name")): _allocatable_gpus(n, resource)
            for n in nodes}
    with_gpus = {name: count for name, count in gpus.items() if count > 0}
    if not with_gpus:
        found = f"none of the {len(nodes)} node(s){where} has allocatable {resource}"
        if device == "cpu":
            return Check("kube-nodes", INFO, f"{found}: fine with --device cpu")
        return Check("kube-nodes", FAIL, found, "install the NVIDIA device plugin (or the GPU "
                     "operator; MIG: its mig.strategy mixed) on the GPU nodes, fix "
                     "--node-selector or --gpu-resource, or use --device cpu")
    shown = ", ".join(f"{name} {count}" for name, count in list(with_gpus.items())[:_SHOWN])
    more = ", …" if len(with_gpus) > _SHOWN else ""
    return Check("kube-nodes", PASS, f"{len(with_gpus)} of {len(nodes)} node(s){where} expose "
                 f"{resource}: {sum(with_gpus.values())} GPU(s) allocatable "
                 f"({shown}{more})")


# -- telemetry -----------------------------------------------------------------------------


def _telemetry_skipped(settings: ClusterSettings, device: str) -> str | None:
    """Why the sweep would read no telemetry (None: it would), as controller.backends
    .kubernetes.placement decides."""
    if not settings.telemetry:
        return (f"--no-telemetry: Jobs only request {settings.gpu_resource} and the "
                "scheduler places them")
    if device == "cpu":
        return "not used with --device cpu (pods request no GPU)"
    if settings.kueue_queue:
        return f"Kueue admits the Jobs (--kueue-queue {settings.kueue_queue}): not read"
    return None


def check_telemetry(kube: KubeClient, settings: ClusterSettings, device: str) -> Check:
    skipped = _telemetry_skipped(settings, device)
    if skipped is not None:
        return Check("kube-telemetry", SKIP, skipped)
    namespace = settings.telemetry_namespace or settings.namespace
    try:
        targets = exporter_targets(kube, settings)
    except KubeError as e:
        return Check("kube-telemetry", FAIL, f"cannot list the exporter pods: {e}",
                     f"let the controller list pods in {namespace} (manifests/components/"
                     "dcgm-exporter/telemetry-rbac.yaml), or pass --no-telemetry")
    if not targets:
        return Check("kube-telemetry", FAIL, f"no running exporter pod "
                     f"({settings.telemetry_selector} in namespace {namespace})",
                     "deploy the exporter (manifests/base/gpu-exporter.yaml, or the "
                     "dcgm-exporter overlay), point --telemetry-selector / "
                     "--telemetry-namespace at it, or pass --no-telemetry")
    results = _scrape_all(targets)
    samples = [s for found in results if isinstance(found, list) for s in found]
    failed = [f"{url} ({found})" for (url, _), found in zip(targets, results, strict=True)
              if isinstance(found, str)]
    answered = len(targets) - len(failed)
    nodes = sorted({s.node for s in samples})
    silent = f"; no answer: {', '.join(failed[:_SHOWN])}" if failed else ""
    if not samples:
        what = ("none of the" if not answered else f"{answered} of the")
        return Check("kube-telemetry", FAIL, f"{what} {len(targets)} exporter(s) answered "
                     f"with GPU readings{silent}",
                     f"the controller must reach the exporters (port "
                     f"{settings.telemetry_port} at pod IPs): run it in the cluster "
                     "(manifests/base/controller-job.yaml), give --telemetry-url, or pass "
                     "--no-telemetry (the scheduler then places the Jobs)")
    shown = ", ".join(nodes[:_SHOWN]) + (", …" if len(nodes) > _SHOWN else "")
    return Check("kube-telemetry", PASS, f"{answered} of {len(targets)} exporter(s) answered: "
                 f"{len(samples)} GPU(s) on {len(nodes)} node(s) ({shown}){silent}")


def _scrape_all(targets: list[tuple[str, str | None]]) -> list[list[NodeGpu] | str]:
    """Each target's GPUs, or why it gave none (the error line)."""
    def one(target: tuple[str, str | None]) -> list[NodeGpu] | str:
        url, node = target
        try:
            return scrape(url, default_node=node)
        except TelemetryError as e:
            return str(e).removeprefix(f"{url}: ")

    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(one, targets))
