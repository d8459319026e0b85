"""manifests/ and examples/ci/: what a cluster user applies or runs, checked without a cluster.

No cluster runs here, so the checks are what can be known without one: each kustomization
is rendered by the real kustomize (`kubectl kustomize`, tests/support/kustomize.py) and read
back as YAML 1.2, each built-in object is validated with kubernetes-validate (strict: unknown
fields are errors) against Kubernetes 1.31 (the oldest supported: podFailurePolicy is GA
there) and 1.37, the one CRD object (Kueue's LocalQueue) is checked field by field, and the
controller's arguments are parsed by the real `esd-sweep` parser. Every combination of the
components is checked in tests/deploy/test_kustomize.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from controller.output.lease import LEASE_TTL_S
from tests.support.kubesim import K8S_VERSIONS
from tests.support.kustomize import (
    _BINDINGS,
    KUSTOMIZATIONS,
    MANIFESTS,
    ROOT,
    TELEMETRY,
    Obj,
    _split_image,
    components_of,
    container_env,
    controller_args,
    empty_dirs,
    expand,
    one,
    pod_spec,
    render_components,
    render_kustomization,
    worker_image,
    workloads,
)

PLACEHOLDER = "REPLACE_ME"
WORKER_IMAGE = "esd-sweep"  # the image names in the manifests, before `images:` pins them
CONTROLLER_IMAGE = "esd-sweep-controller"


# -- helpers for the checks -----------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render_kustomization(path) for name, path in KUSTOMIZATIONS.items()}


# -- schemas --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_builtin_object_is_valid_strictly(
    rendered: dict[str, list[Obj]], name: str, version: str,
) -> None:
    """Strict schema validation: a misspelt or misplaced field is an error, as it would be
    for `kubectl apply --validate=strict`."""
    checked = 0
    for obj in rendered[name]:
        if obj["apiVersion"].startswith("kueue.x-k8s.io/"):
            continue  # a CRD: no schema in kubernetes-validate, checked below
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 2


def test_kueue_localqueue_shape(rendered: dict[str, list[Obj]]) -> None:
    """LocalQueue (kueue.x-k8s.io/v1beta2: Kueue 0.15 deprecates v1beta1 and 0.17 stops
    serving it) has no schema here: its fields are checked against Kueue's API: namespaced,
    spec.clusterQueue a DNS name, nothing else in spec."""
    queue = one(rendered["kueue"], "LocalQueue")
    assert queue["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert set(queue) == {"apiVersion", "kind", "metadata", "spec"}
    assert queue["metadata"]["namespace"] == "esd-sweep"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", queue["metadata"]["name"])
    assert set(queue["spec"]) <= {"clusterQueue", "stopPolicy", "fairSharing"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", queue["spec"]["clusterQueue"])
    args, _ = controller_args(rendered["kueue"], "Job")
    assert f"--kueue-queue={queue['metadata']['name']}" in args


# -- what the objects say -------------------------------------------------------------------

def test_secrets_hold_placeholders_only(rendered: dict[str, list[Obj]]) -> None:
    """Real credentials never live in the repository, and the applied kustomizations carry
    no Secret at all (so `kubectl apply -k` cannot overwrite the user's real ones)."""
    for name, objs in rendered.items():
        secrets = [o for o in objs if o["kind"] == "Secret"]
        if name != "secrets":
            assert secrets == [], name
            continue
        assert {s["metadata"]["name"] for s in secrets} == {"hf-token", "s3-credentials"}
        for secret in secrets:
            assert "data" not in secret
            assert set(secret["stringData"].values()) == {PLACEHOLDER}


def test_worker_flags_name_the_secret_templates(rendered: dict[str, list[Obj]]) -> None:
    """--hf-token-secret NAME:KEY and --s3-secret NAME point at keys the templates define."""
    secrets = {s["metadata"]["name"]: s["stringData"] for s in rendered["secrets"]}
    args, _ = controller_args(rendered["base"], "Job")
    hf = next(a for a in args if a.startswith("--hf-token-secret=")).split("=", 1)[1]
    name, _, key = hf.partition(":")
    assert key in secrets[name]
    s3 = next(a for a in args if a.startswith("--s3-secret=")).split("=", 1)[1]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets[s3])


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_containers_are_locked_down(rendered: dict[str, list[Obj]], name: str) -> None:
    """Non-root, no privilege escalation, no capabilities, read-only root, seccomp: the
    `restricted` Pod Security level the namespace enforces."""
    for workload in workloads(rendered[name]):
        pod = pod_spec(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        assert all("hostPath" not in v for v in pod.get("volumes", []))
        for container in pod["containers"] + pod.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["readOnlyRootFilesystem"] is True
            assert not ctx.get("privileged")
            assert "/tmp" in {m["mountPath"] for m in container.get("volumeMounts", [])}


def test_namespace_enforces_restricted_pod_security(rendered: dict[str, list[Obj]]) -> None:
    ns = one(rendered["default"], "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def _pinned() -> dict[str, str]:
    """The images `images:` in the base names, as kustomize writes them."""
    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    return {i["name"]: i["newName"] + (f"@{i['digest']}" if "digest" in i
                                       else f":{i['newTag']}") for i in base["images"]}


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_images_are_pinned_and_named_once(rendered: dict[str, list[Obj]], name: str) -> None:
    """Every image has a version tag or a digest (never :latest or none) and is one that
    `images:` pins, and the controller takes its Jobs' worker image from the PodTemplate
    `images:` rewrites (--worker-template; tests/deploy/test_worker_image.py runs it)."""
    pinned = _pinned()
    objs = rendered[name]
    for workload in [*workloads(objs), *(o for o in objs if o["kind"] == "PodTemplate")]:
        for container in pod_spec(workload)["containers"]:
            _, suffix = _split_image(container["image"])
            assert re.fullmatch(r":v?\d+\.\d+\.\d+\S*|@sha256:[0-9a-f]{64}", suffix), \
                container["image"]
            assert container["image"] in pinned.values()
    for kind in ("Job", "CronJob"):
        if any(o["kind"] == kind for o in objs):
            args, container = controller_args(objs, kind)
            assert container["image"] == pinned[CONTROLLER_IMAGE]
            assert "--worker-template=esd-sweep-worker" in args
            assert not any(a.startswith("--image") for a in args)
            assert worker_image(objs) == pinned[WORKER_IMAGE]


def test_the_registry_is_written_once() -> None:
    """No file of manifests/ but the base's kustomization.yaml names the registry: a new tag
    or digest is one edit."""
    registry = _pinned()[WORKER_IMAGE].split("/", 1)[0]
    naming = [p.relative_to(MANIFESTS) for p in MANIFESTS.rglob("*.yaml")
              if registry in p.read_text()]
    assert naming == [Path("base/kustomization.yaml")]


def test_cronjob_runs_the_same_controller_as_the_job(rendered: dict[str, list[Obj]]) -> None:
    """One controller definition, two ways to start it: the CronJob's Job spec is the Job's,
    in every kustomization (an overlay that patched one and not the other would differ)."""
    for name, objs in rendered.items():
        if not any(o["kind"] == "Job" for o in objs):
            continue
        job = one(objs, "Job", "esd-sweep-controller")
        cron = one(objs, "CronJob", "esd-sweep-periodic")
        assert cron["spec"]["jobTemplate"]["spec"] == job["spec"], name
        assert cron["spec"]["concurrencyPolicy"] == "Forbid"
        assert cron["spec"]["suspend"] is True


def test_controller_job_shape(rendered: dict[str, list[Obj]]) -> None:
    """The controller: its own service account (the worker's has no API access), the model
    list read from the store (a ConfigMap cannot hold a big one), a small backoffLimit,
    and exit 1/2 final."""
    objs = rendered["default"]
    job = one(objs, "Job", "esd-sweep-controller")
    pod = pod_spec(job)
    assert pod["serviceAccountName"] == "esd-sweep-controller"
    assert pod["restartPolicy"] == "Never"
    assert 0 < job["spec"]["backoffLimit"] <= 3
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [1, 2]
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {"/tmp"} and "emptyDir" in volumes[mounts["/tmp"]]
    args, _ = controller_args(objs, "Job")
    env = container_env(container, objs, "esd-sweep")
    assert "--model-list=$(ESD_MODEL_LIST)" in args and "--wait" in args
    assert env["ESD_MODEL_LIST"].startswith("s3://")
    assert not [o for o in objs if o["kind"] == "ConfigMap"
                and o["metadata"]["name"] == "esd-sweep-models"]

    worker_sa = one(objs, "ServiceAccount", "esd-sweep-worker")
    assert worker_sa["automountServiceAccountToken"] is False
    assert "--service-account=esd-sweep-worker" in args
    bound = {s["name"] for b in objs if b["kind"] in _BINDINGS for s in b["subjects"]}
    assert "esd-sweep-worker" not in bound


def test_model_list_example_loads() -> None:
    """The example models.csv is a valid model list for the controller's own loader."""
    from esd_worker.core.models.modellist import read_model_list

    models = read_model_list(MANIFESTS / "components" / "model-list-configmap" / "models.csv")
    assert [r.relation for r in models.rows] == ["base", "base", "finetune"]
    assert models.problems == ()


def test_shipped_kustomizations_install_no_exporter(rendered: dict[str, list[Obj]]) -> None:
    """Shards (the default mode, every shipped kustomization's) read no GPU telemetry: no
    exporter DaemonSet, and the controller is told so (no exporter pods looked for)."""
    for name, objs in rendered.items():
        assert not [o for o in objs if o["kind"] == "DaemonSet"], name
        if any(o["kind"] == "Job" for o in objs) and name != "dcgm-exporter":
            args, _ = controller_args(objs, "Job")
            assert "--no-telemetry" in args, name
            assert not [a for a in args if a.startswith(("--telemetry-", "--shard-size"))]


def test_gpu_exporter_daemonset() -> None:
    """With components/gpu-exporter: what NVML needs without taking a GPU: NVIDIA runtime,
    all devices visible, no nvidia.com/gpu request; on GPU nodes only, tolerating their
    taint; the node name from the downward API (Jobs prefer nodes by it); in the sweep's
    namespace (a component's objects miss the base's namespace transformer)."""
    objs = render_components(("gpu-exporter",))
    ds = one(objs, "DaemonSet", "esd-gpu-exporter")
    assert ds["metadata"]["namespace"] == "esd-sweep"
    pod = pod_spec(ds)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "esd-gpu-exporter"
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]
    (container,) = pod["containers"]
    assert container["args"][0] == "gpu-exporter"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    resources = container["resources"]
    assert not any("nvidia.com" in k for part in resources.values() for k in part)
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    # The controller scrapes the pods this DaemonSet makes, by the selector it is given.
    args, _ = controller_args(objs, "Job")
    flags = dict(a.split("=", 1) for a in args if a.startswith("--telemetry-"))
    key, _, value = flags["--telemetry-selector"].partition("=")
    assert labels[key] == value
    assert flags["--telemetry-port"] == str(port["containerPort"])
    # ...and the CLI's defaults find it too (`esd-sweep run` from a laptop, no flags).
    from controller.backends.kubernetes.common.settings import (
        DEFAULT_TELEMETRY_PORT,
        DEFAULT_TELEMETRY_SELECTOR,
    )

    assert flags["--telemetry-selector"] == DEFAULT_TELEMETRY_SELECTOR
    assert port["containerPort"] == DEFAULT_TELEMETRY_PORT
    # Telemetry places one Job per model only: the component runs that mode.
    assert "--shard-size=1" in args and "--no-telemetry" not in args


def test_gpu_exporter_args_parse() -> None:
    """The DaemonSet's arguments are ones `esd-sweep gpu-exporter` accepts (after the
    entrypoint turns `gpu-exporter ARGS` into `esd-sweep gpu-exporter ARGS`)."""
    from controller.cli import build_parser

    ds = one(render_components(("gpu-exporter",)), "DaemonSet")
    args = pod_spec(ds)["containers"][0]["args"]
    parsed = build_parser().parse_args(args)  # "gpu-exporter" is the subcommand's name
    assert parsed.port == 9400


def test_dcgm_overlay_points_at_the_gpu_operator(rendered: dict[str, list[Obj]]) -> None:
    """The controller scrapes the GPU operator's dcgm-exporter pods, and may list pods in
    that namespace (and nothing else there)."""
    objs = rendered["dcgm-exporter"]
    args, _ = controller_args(objs, "Job")
    assert "--telemetry-selector=app=nvidia-dcgm-exporter" in args
    assert "--telemetry-namespace=gpu-operator" in args
    assert "--shard-size=1" in args and "--no-telemetry" not in args
    assert not [o for o in objs if o["kind"] == "DaemonSet"]
    role = one(objs, "Role", "esd-sweep-telemetry-reader")
    assert role["metadata"]["namespace"] == "gpu-operator"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = one(objs, "RoleBinding", "esd-sweep-telemetry-reader")
    assert binding["metadata"]["namespace"] == "gpu-operator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "esd-sweep-controller",
                                    "namespace": "esd-sweep"}]


def test_autoscaling_overlay(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["autoscaling"]
    args, _ = controller_args(objs, "Job")
    assert {"--allow-pending", "--do-not-disrupt"} <= set(args)
    assert any(re.fullmatch(r"--max-pending=\d+", a) for a in args)
    meta = one(objs, "Job", "esd-sweep-controller")["spec"]["template"]["metadata"]
    assert meta["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


# -- the controller's arguments against the real CLI ----------------------------------------

@pytest.mark.parametrize("kind", ["Job", "CronJob"])
@pytest.mark.parametrize("name", ["default", "kueue", "autoscaling", "dcgm-exporter", "eks",
                                  "gke"])
def test_controller_args_parse_with_the_real_cli(
    rendered: dict[str, list[Obj]], name: str, kind: str,
) -> None:
    """The controller container's args, with $(VAR) expanded as the kubelet would, are an
    `esd-sweep run` command line the real CLI accepts and validates (settings_from_args
    reports every bad value), every $(VAR) is defined, and the worker Job those settings
    build is schema-valid."""
    from controller.backends.kubernetes.common.jobs import build_job
    from controller.cli import build_parser, settings_from_args

    objs = rendered[name]
    args, container = controller_args(objs, kind)
    env = container_env(container, objs, "esd-sweep")
    expanded = [expand(a, env) for a in args]
    assert not [a for a in expanded if "$(" in a], "undefined $(VAR) in args"
    assert expanded[0] == "esd-sweep"
    parsed = build_parser().parse_args(expanded[1:])
    assert parsed.command == "run" and parsed.backend == "kubernetes"
    settings = settings_from_args(parsed)
    assert settings.output.startswith("s3://")
    cluster = settings.cluster
    assert cluster.namespace == "esd-sweep" and cluster.wait
    # A pod that replaces a crashed controller finds its lease on the output until it
    # expires: it must wait past that, since exit 2 fails the Job (podFailurePolicy).
    assert settings.wait_lock_s is not None and settings.wait_lock_s > 2 * LEASE_TTL_S
    assert cluster.service_account == "esd-sweep-worker"
    components = components_of(name)
    assert (cluster.kueue_queue is not None) == ("kueue" in components)
    assert (cluster.allow_pending and cluster.do_not_disrupt) == ("autoscaling" in components)
    assert cluster.telemetry == bool(TELEMETRY & set(components))
    assert cluster.priority_class == "esd-sweep-batch"
    job = build_job(
        model_ref="Qwen/Qwen2.5-0.5B", model_key="qwen-qwen2-5-0-5b-0123456789", relation="",
        source_model=None, output_url=settings.output,
        settings=cluster.job_settings(run_id="manifests", instance="manifests",
                                      gpus_per_job=1))
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    # The worker pods use what these manifests and the Secret templates define.
    pod = job["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == one(objs, "PriorityClass")["metadata"]["name"]
    assert pod["serviceAccountName"] in {
        o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {s["metadata"]["name"] for s in render_kustomization(
        KUSTOMIZATIONS["secrets"])}



# -- cluster-wide objects, labels, the store, metrics, volumes ------------------------------

def test_worker_priority_class(rendered: dict[str, list[Obj]]) -> None:
    """Below the default 0 (ordinary workloads preempt a sweep pod, which a shard survives:
    its podFailurePolicy ignores DisruptionTarget), not below the cluster autoscaler's
    --expendable-pods-priority-cutoff (-10: pending pods under it trigger no scale-up); never
    preempting; cluster-scoped, so kustomize must not give it a namespace."""
    from controller.backends.kubernetes.common.jobs import pod_failure_policy
    from controller.backends.kubernetes.sharded.indexed import shard_failure_policy

    pc = one(rendered["default"], "PriorityClass")
    assert pc["apiVersion"] == "scheduling.k8s.io/v1"
    assert "namespace" not in pc["metadata"]
    assert -10 <= pc["value"] < 0 and pc["value"] == -5
    assert pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    for policy in (shard_failure_policy(), pod_failure_policy()):  # a shard's, a model's
        assert policy["rules"][0] == {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def test_version_label_is_pyprojects(rendered: dict[str, list[Obj]]) -> None:
    """app.kubernetes.io/version on every object of the base (and the exporter), equal to
    pyproject.toml's version, and in no selector (a selector is immutable)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    objs = [*rendered["default"], one(render_components(("gpu-exporter",)), "DaemonSet")]
    for obj in objs:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/version") == version, obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "esd-sweep"
        selector = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        assert "app.kubernetes.io/version" not in selector


def test_store_is_aws_s3_unless_an_overlay_merges_an_endpoint() -> None:
    """The base names no endpoint (AWS S3); an S3-compatible store's overlay adds one with
    configMapGenerator behavior: merge (as docs/kubernetes.md shows), keeping the rest."""
    base = one(render_kustomization(MANIFESTS / "base"), "ConfigMap", "esd-sweep-s3")
    assert "AWS_ENDPOINT_URL" not in base["data"]
    objs = render_components((), extra=[
        "configMapGenerator:", "  - name: esd-sweep-s3", "    namespace: esd-sweep",
        "    behavior: merge", "    literals:", "      - AWS_ENDPOINT_URL=http://minio.minio:9000"])
    merged = one(objs, "ConfigMap", "esd-sweep-s3")
    assert merged["data"] == {**base["data"], "AWS_ENDPOINT_URL": "http://minio.minio:9000"}
    _, container = controller_args(objs, "Job")
    env = container_env(container, objs, "esd-sweep")
    assert env["AWS_ENDPOINT_URL"] == "http://minio.minio:9000"


def test_controller_serves_metrics(rendered: dict[str, list[Obj]]) -> None:
    """The controller serves its metrics on every interface (Prometheus scrapes the pod IP)
    at the port its container names, and says so in the prometheus.io annotations."""
    from controller.cli import build_parser

    for kind in ("Job", "CronJob"):
        args, container = controller_args(rendered["default"], kind)
        parsed = build_parser().parse_args(args[1:])
        assert (parsed.metrics_port, parsed.metrics_address) == (9090, "0.0.0.0")
        (port,) = container["ports"]
        assert (port["name"], port["containerPort"]) == ("metrics", parsed.metrics_port)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_empty_dir_has_a_size_limit(rendered: dict[str, list[Obj]], name: str) -> None:
    """An emptyDir without sizeLimit may fill the node's disk (test_kustomize.py checks every
    combination of the components too)."""
    found = [(o["metadata"]["name"], where, volume) for o in rendered[name]
             for where, volume in empty_dirs(o)]
    assert found or name in ("secrets",)
    for obj_name, where, volume in found:
        assert volume.get("sizeLimit"), f"{obj_name}{where}"
