"""docs/kubernetes.md's "A first run on EKS" and "A first run on GKE" are what a platform
engineer copies: their shell blocks are checked here as far as this machine can run them.

What runs for real: the variable assignments and the heredocs that write the user's files
(bash, with sample values standing in only for what `aws`, `docker` or `gcloud` would
print), then `kubectl kustomize` of the user's kustomization (beside a link to manifests/,
as in a checkout), every built-in object validated strictly (Kubernetes 1.31 and 1.37), the
user's values found where they must land and no placeholder left. The IAM JSON is parsed
and its statements checked; the eksctl and Karpenter YAML read as YAML 1.2 with their fields
checked against allowlists from their reference pages. Commands of programs absent here
(aws, eksctl, helm, gcloud, docker, kubectl) pass `bash -n` and use only flags of a
per-program table checked against their documentation; `esd-sweep` lines go through the
real parser, and EKS's `esd-sweep run … --dry-run` runs for real against moto's S3 server,
its Jobs validated. Not run: anything against a cloud.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT
from tests.support.kubesim import StrictValidator
from tests.support.kustomize import (
    MANIFESTS,
    container_env,
    controller_args,
    expand,
    find_kubectl,
    one,
    pod_spec,
    read_yaml12,
)
from tests.support.s3server import S3Server, serve_s3

DOC = REPO_ROOT / "docs" / "kubernetes.md"
TEXT = DOC.read_text(encoding="utf-8")
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_HEREDOC = re.compile(r"^cat > (\S+) <<'?EOF'?\n.*?^EOF\n", re.MULTILINE | re.DOTALL)
_ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")
PLACEHOLDERS = ("example.com", "111122223333", "REPLACE_ME")
VALIDATORS = [StrictValidator(v) for v in ("1.31.0", "1.37.0")]


def section(title: str) -> str:
    start = TEXT.index(f"\n## {title}\n")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end]


def shell_blocks(text: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(text) if lang in ("sh", "bash")]


# Values only a cloud can print (command substitutions); everything else is the doc's own.
DIGEST_W = "sha256:" + "1" * 64
DIGEST_C = "sha256:" + "2" * 64
WALKS: dict[str, dict[str, str]] = {
    "A first run on EKS": {
        "ACCOUNT_ID": "444455556666",
        "OIDC": "oidc.eks.eu-west-1.amazonaws.com/id/0123456789ABCDEF0123456789ABCDEF",
        "WORKER_DIGEST": DIGEST_W, "CONTROLLER_DIGEST": DIGEST_C,
    },
    "A first run on GKE": {
        "PROJECT": "my-sweep-project",
        "WORKER_DIGEST": DIGEST_W, "CONTROLLER_DIGEST": DIGEST_C,
    },
}
TOP_VARIABLES = {"CLUSTER", "REGION", "BUCKET", "REG", "VERSION", "OUTPUT"}


def logical_lines(block: str) -> list[str]:
    """The block's lines, continuations joined, heredoc bodies left out."""
    return [ln for ln in _HEREDOC.sub("", block).replace("\\\n", " ").splitlines() if ln.strip()]


def assignments(title: str) -> list[tuple[str, str]]:
    return [(m[1], m[0]) for block in shell_blocks(section(title))
            for m in (_ASSIGN.match(ln) for ln in logical_lines(block)) if m]


def run_walkthrough(title: str, where: Path) -> dict[str, str]:
    """The doc's assignments (a sample for a command substitution) and its heredocs, run by
    bash in `where`, beside a link to manifests/; the variables' values come back."""
    samples = WALKS[title]
    lines = ["set -euo pipefail"]
    for name, line in assignments(title):
        if "$(" in line:
            assert name in samples, f"{title}: no sample for {name} (set by a command)"
            lines.append(f"{name}={shlex.quote(samples[name])}")
        else:
            lines.append(line)
    lines.append("mkdir -p my-sweep")
    for block in shell_blocks(section(title)):
        lines += [m[0] for m in _HEREDOC.finditer(block)]
    names = sorted({n for n, _ in assignments(title)})
    lines += [f'printf "%s=%s\\0" {n} "${n}"' for n in names]
    (where / "manifests").symlink_to(MANIFESTS)
    out = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=where, capture_output=True,
                         check=False, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if kv)


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([find_kubectl(), "kustomize", str(path)], capture_output=True,
                         text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    return read_yaml12(out.stdout)


@pytest.mark.parametrize("title", list(WALKS))
def test_the_settings_are_set_once_at_the_top(title: str) -> None:
    first = shell_blocks(section(title))[0]
    at_top = {m[1] for m in (_ASSIGN.match(ln) for ln in logical_lines(first)) if m}
    assert at_top >= TOP_VARIABLES
    names = [n for n, _ in assignments(title)]
    assert len(names) == len(set(names)), f"assigned twice: {names}"


@pytest.mark.parametrize("title", list(WALKS))
def test_the_users_kustomization_renders_with_the_users_values(title: str,
                                                               tmp_path: Path) -> None:
    """The heredoc's kustomization, built and validated: no placeholder survives, and the
    images (by digest), the store settings and (EKS) the role land where they act."""
    from controller.cli import build_parser

    env = run_walkthrough(title, tmp_path)
    objs = render(tmp_path / "my-sweep")
    for obj in objs:
        if "." in obj["apiVersion"].split("/")[0] and not obj["apiVersion"].startswith(
                ("rbac.authorization.k8s.io/", "scheduling.k8s.io/", "batch/", "apps/")):
            continue  # CRDs (Kueue, Prometheus operator): test_kustomize checks those
        for validator in VALIDATORS:
            errors = validator.errors(obj)
            assert not errors, f"{obj['kind']} {obj['metadata']['name']}: {errors}"
    dumped = json.dumps(objs)
    for placeholder in PLACEHOLDERS:
        assert placeholder not in dumped, f"{placeholder} survives in {title}"

    store = one(objs, "ConfigMap", "esd-sweep-s3")["data"]
    assert store["ESD_MODEL_LIST"] == f"s3://{env['BUCKET']}/lists/models.csv"
    assert store["ESD_OUTPUT_DIR"] == env["OUTPUT"] == f"s3://{env['BUCKET']}/sweeps/first-run"
    if "EKS" in title:
        assert store["AWS_REGION"] == env["REGION"] and "AWS_ENDPOINT_URL" not in store
        for name in ("esd-sweep-controller", "esd-sweep-worker"):
            notes = one(objs, "ServiceAccount", name)["metadata"]["annotations"]
            assert notes["eks.amazonaws.com/role-arn"] == env["ROLE_ARN"]
        role = f"arn:aws:iam::{env['ACCOUNT_ID']}:role/esd-sweep-{env['CLUSTER']}"
        assert env["ROLE_ARN"] == role
    else:
        assert store == {**store, "AWS_ENDPOINT_URL": "https://storage.googleapis.com",
                         "AWS_REGION": "auto"}

    worker = f"{env['REG']}/esd-sweep@{DIGEST_W}"
    for kind in ("Job", "CronJob"):
        args, container = controller_args(objs, kind)
        assert container["image"] == f"{env['REG']}/esd-sweep-controller@{DIGEST_C}"
        expanded = [expand(a, container_env(container, objs, "esd-sweep")) for a in args]
        parsed = build_parser().parse_args(expanded[1:])
        # The controller reads the worker image from the PodTemplate at run time
        # (--worker-template), so the user's `images:` is the one place the digest is.
        assert parsed.worker_template == "esd-sweep-worker" and parsed.image is None, kind
        assert "--kueue-queue=esd-sweep" in expanded
    template = one(objs, "PodTemplate", "esd-sweep-worker")
    assert pod_spec(template)["containers"][0]["image"] == worker


def test_the_iam_policies_grant_what_the_store_calls(tmp_path: Path) -> None:
    """esd_worker/core/store/s3.py: list_objects_v2, get/head, put (conditional too, and
    multipart through upload_fileobj, aborted on failure), delete (conditional too)."""
    env = run_walkthrough("A first run on EKS", tmp_path)
    policy = json.loads((tmp_path / "esd-sweep-s3-policy.json").read_text())
    granted: dict[str, set[str]] = {}
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow" and not any("*" in a for a in st["Action"])
        granted.setdefault(st["Resource"], set()).update(st["Action"])
    bucket = f"arn:aws:s3:::{env['BUCKET']}"
    assert granted == {bucket: {"s3:ListBucket"},
                       bucket + "/*": {"s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                       "s3:AbortMultipartUpload"}}

    trust = json.loads((tmp_path / "esd-sweep-trust.json").read_text())
    (st,) = trust["Statement"]
    oidc = env["OIDC"]
    provider = f"arn:aws:iam::{env['ACCOUNT_ID']}:oidc-provider/{oidc}"
    assert st["Principal"] == {"Federated": provider}
    assert st["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert st["Condition"] == {"StringEquals": {
        f"{oidc}:aud": "sts.amazonaws.com",
        f"{oidc}:sub": [f"system:serviceaccount:esd-sweep:{sa}"
                        for sa in ("esd-sweep-controller", "esd-sweep-worker")]}}
    rbac = read_yaml12((MANIFESTS / "base" / "rbac.yaml").read_text())
    assert {o["metadata"]["name"] for o in rbac if o["kind"] == "ServiceAccount"} == {
        "esd-sweep-controller", "esd-sweep-worker"}


# Field allowlists. eksctl: https://eksctl.io/usage/schema/ (ClusterConfig v1alpha5);
# Karpenter v1: https://karpenter.sh/docs/concepts/nodepools/ and .../nodeclasses/.
ANY = None
EKSCTL = {"apiVersion": ANY, "kind": ANY, "metadata": {"name": ANY, "region": ANY, "version": ANY},
          "iam": {"withOIDC": ANY},
          "managedNodeGroups": [{"name": ANY, "instanceType": ANY, "amiFamily": ANY,
                                 "minSize": ANY, "maxSize": ANY, "desiredCapacity": ANY,
                                 "volumeSize": ANY, "volumeType": ANY, "labels": ANY,
                                 "taints": [{"key": ANY, "value": ANY, "effect": ANY}]}]}
_TERM = [{"tags": ANY, "id": ANY}]
EC2NODECLASS = {"apiVersion": ANY, "kind": ANY, "metadata": {"name": ANY},
                "spec": {"role": ANY, "amiSelectorTerms": [{"alias": ANY, "id": ANY}],
                         "subnetSelectorTerms": _TERM, "securityGroupSelectorTerms": _TERM,
                         "instanceStorePolicy": ANY,
                         "blockDeviceMappings": [{"deviceName": ANY, "ebs": {
                             "volumeSize": ANY, "volumeType": ANY, "encrypted": ANY,
                             "deleteOnTermination": ANY}}]}}
NODEPOOL = {"apiVersion": ANY, "kind": ANY, "metadata": {"name": ANY},
            "spec": {"template": {"spec": {
                "nodeClassRef": {"group": ANY, "kind": ANY, "name": ANY},
                "requirements": [{"key": ANY, "operator": ANY, "values": ANY}],
                "taints": [{"key": ANY, "value": ANY, "effect": ANY}]}},
                "limits": ANY, "disruption": {"consolidationPolicy": ANY, "consolidateAfter": ANY}}}


def check_fields(obj: Any, allowed: Any, path: str = "") -> None:
    if allowed is ANY:
        return
    if isinstance(allowed, list):
        assert isinstance(obj, list), path
        for i, item in enumerate(obj):
            check_fields(item, allowed[0], f"{path}[{i}]")
        return
    assert isinstance(obj, dict), path
    assert set(obj) <= set(allowed), f"{path}: unknown {sorted(set(obj) - set(allowed))}"
    for key, value in obj.items():
        check_fields(value, allowed[key], f"{path}.{key}")


def test_the_node_configs_use_documented_fields(tmp_path: Path) -> None:
    env = run_walkthrough("A first run on EKS", tmp_path)
    (cluster,) = read_yaml12((tmp_path / "cluster.yaml").read_text())
    check_fields(cluster, EKSCTL)
    assert (cluster["apiVersion"], cluster["kind"]) == ("eksctl.io/v1alpha5", "ClusterConfig")
    assert cluster["metadata"] == {"name": env["CLUSTER"], "region": env["REGION"],
                                   "version": cluster["metadata"]["version"]}
    assert isinstance(cluster["metadata"]["version"], str)  # "1.33", not the float 1.33
    gpu = [g for g in cluster["managedNodeGroups"] if g["instanceType"].startswith("g5.")]
    assert gpu and all({"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
                       in g["taints"] and g["volumeSize"] >= 100 for g in gpu)

    nodeclass, nodepool = read_yaml12((tmp_path / "karpenter-gpu.yaml").read_text())
    check_fields(nodeclass, EC2NODECLASS)
    check_fields(nodepool, NODEPOOL)
    assert nodeclass["apiVersion"] == "karpenter.k8s.aws/v1"
    assert nodepool["apiVersion"] == "karpenter.sh/v1"
    assert nodeclass["spec"]["role"] == f"KarpenterNodeRole-{env['CLUSTER']}"
    assert nodeclass["spec"]["instanceStorePolicy"] == "RAID0"
    tmpl = nodepool["spec"]["template"]["spec"]
    assert tmpl["nodeClassRef"]["name"] == nodeclass["metadata"]["name"]
    families = [r for r in tmpl["requirements"] if r["key"] == "karpenter.k8s.aws/instance-family"]
    assert families and set(families[0]["values"]) <= {"g5", "g6"}
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in tmpl["taints"]


# Every flag the walkthroughs give a program absent here, by subcommand, as checked against
# its reference: AWS CLI v2 (awscli.amazonaws.com/v2/documentation/api/latest/reference/),
# eksctl (eksctl.io/usage), helm (helm.sh/docs/helm/helm_install), the GPU operator's
# values (docs.nvidia.com/datacenter/cloud-native/gpu-operator/latest/
# install-gpu-operator.html), gcloud (cloud.google.com/sdk/gcloud/reference/container/
# node-pools/create and siblings), docker (docs.docker.com/reference/cli/docker/), kubectl.
FLAGS: dict[str, dict[tuple[str, ...], set[str]]] = {
    "aws": {("sts", "get-caller-identity"): {"--query", "--output"},
            ("eks", "update-kubeconfig"): {"--name", "--region"},
            ("eks", "describe-cluster"): {"--name", "--region", "--query", "--output"},
            ("ecr", "create-repository"): {"--repository-name", "--region"},
            ("ecr", "get-login-password"): {"--region"},
            ("s3", "mb"): {"--region"}, ("s3", "cp"): set(),
            ("iam", "create-policy"): {"--policy-name", "--policy-document"},
            ("iam", "create-role"): {"--role-name", "--assume-role-policy-document"},
            ("iam", "attach-role-policy"): {"--role-name", "--policy-arn"}},
    "eksctl": {("create", "cluster"): {"-f", "--install-nvidia-plugin"},
               ("utils", "associate-iam-oidc-provider"): {"--cluster", "--region", "--approve"}},
    "helm": {("repo", "add"): set(), ("repo", "update"): set(),
             ("install",): {"--namespace", "--create-namespace", "--version", "--set", "--wait"}},
    "docker": {("login",): {"--username", "--password-stdin"},
               ("build",): {"--platform", "--target", "-t"}, ("push",): set(),
               ("inspect",): {"--format"}},
    "gcloud": {("config", "get-value"): set(),
               ("container", "clusters", "create"): {"--location", "--release-channel",
                                                     "--machine-type", "--num-nodes"},
               ("container", "clusters", "get-credentials"): {"--location"},
               ("container", "node-pools", "create"): {
                   "--cluster", "--location", "--machine-type", "--accelerator", "--disk-size",
                   "--enable-autoscaling", "--num-nodes", "--min-nodes", "--max-nodes",
                   "--ephemeral-storage-local-ssd"},
               ("artifacts", "repositories", "create"): {"--repository-format", "--location"},
               ("auth", "configure-docker"): set(),
               ("storage", "buckets", "create"): {"--location", "--uniform-bucket-level-access"},
               ("storage", "buckets", "add-iam-policy-binding"): {"--member", "--role"},
               ("iam", "service-accounts", "create"): set(),
               ("storage", "hmac", "create"): {"--format"}, ("storage", "cp"): set()},
    "kubectl": {("apply",): {"-f", "-k", "--server-side", "--dry-run"}, ("kustomize",): set(),
                ("wait",): {"-n", "--for", "--timeout"}, ("create", "namespace"): set(),
                ("create", "secret", "generic"): {"-n", "--from-file", "--from-env-file"},
                ("get",): {"-n", "-o", "-l"}, ("logs",): {"-n", "-f"}},
}
_SEPARATORS = {"|", "||", "&&", ";", "(", ")", "{", "}", "$("}


def commands(title: str) -> list[list[str]]:
    """argv of every command in the walkthrough's shell blocks (pipes, lists and command
    substitutions split apart; heredoc bodies left out)."""
    out: list[list[str]] = []
    for block in shell_blocks(section(title)):
        for line in logical_lines(block):
            lexer = shlex.shlex(line.replace("$(", " ( "), posix=True, punctuation_chars="|&;()")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            argv: list[str] = []
            for token in [*lexer, ";"]:
                if token in _SEPARATORS:
                    if argv:
                        out.append(argv)
                    argv = []
                elif not (argv == [] and _ASSIGN.match(token)):
                    argv.append(token)
    return out


CASES = [(title, argv) for title in WALKS for argv in commands(title)]


@pytest.mark.parametrize("title", list(WALKS))
def test_the_shell_blocks_parse(title: str) -> None:
    for block in shell_blocks(section(title)):
        out = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True,
                             check=False, timeout=30)
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("argv", [c[1] for c in CASES if c[1][0] in FLAGS],
                         ids=lambda a: " ".join(a[:3]))
def test_each_command_uses_documented_flags(argv: list[str]) -> None:
    table = FLAGS[argv[0]]
    rest = argv[1:]
    if rest[:1] == ["-n"]:  # kubectl -n NAMESPACE before its verb
        rest = rest[2:]
    words = [w for w in rest if not w.startswith("-")]
    matches = [sub for sub in table if tuple(words[:len(sub)]) == sub]
    assert matches, f"{argv[0]} {' '.join(words[:3])}: not a subcommand in the table"
    allowed = table[max(matches, key=len)]
    used = {w.split("=", 1)[0] for w in argv[1:] if w.startswith("-") and w != "-"}
    assert used <= allowed, f"{shlex.join(argv)}: {sorted(used - allowed)}"


def test_every_program_is_known_and_esd_sweep_lines_parse() -> None:
    """The programs a user needs are the ones named in the doc's prose; esd-sweep's own
    lines go through its real parser."""
    from controller.cli import build_parser

    known = set(FLAGS) | {"esd-sweep", "mkdir", "cat", "read", "printf", "cut", "sed"}
    seen = {argv[0] for _, argv in CASES}
    assert seen <= known, sorted(seen - known)
    runs = [argv for _, argv in CASES if argv[0] == "esd-sweep"]
    assert len(runs) >= 3
    for argv in runs:
        build_parser().parse_args(argv[1:])


def test_repository_paths_and_one_kubernetes_minimum() -> None:
    for title in WALKS:
        for path in re.findall(r"-f (manifests/\S+)", section(title)):
            assert (REPO_ROOT / path).exists(), path
    assert not re.search(r"≥ ?1\.\d+", TEXT), "a Kubernetes minimum besides Requirements"
    assert TEXT.count("Kubernetes 1.31 or newer") == 1


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_the_documented_dry_run_prints_valid_jobs(s3_server: S3Server, tmp_path: Path) -> None:
    """EKS step 9's `esd-sweep run … --dry-run`, run for real: the doc's own line with the
    walkthrough's values, its list in the bucket it names (moto's server standing in for
    S3; size and shape columns so that nothing asks the hub), and the Jobs it prints are
    valid under the strict schemas, pinned to the worker's digest, queued for Kueue and
    requiring the token's Secret."""
    title = "A first run on EKS"
    env = run_walkthrough(title, tmp_path)
    [argv] = [a for a in commands(title) if a[0] == "esd-sweep" and "--dry-run" in a]
    argv = [re.sub(r"\$(\w+)", lambda m: env[m[1]], a) for a in argv]
    s3_server.new_bucket(env["BUCKET"])
    rows = ("model_id,base_model_relation,source_model,size_bytes,num_params,matrix_dim\n"
            "org/small,,,2000000000,1e9,2048\norg/large,,,40000000000,2e10,6144\n")
    s3_server.client().put_object(Bucket=env["BUCKET"], Key="lists/models.csv",
                                  Body=rows.encode())
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli", *argv[1:]], capture_output=True, text=True,
        check=False, timeout=120, cwd=tmp_path,
        env=s3_server.subprocess_env(HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9",
                                     PYTHONPATH=str(REPO_ROOT)))
    assert out.returncode == 0, out.stderr
    jobs = [o for o in read_yaml12(out.stdout) if o and o.get("kind") == "Job"]
    assert len(jobs) == 2, [j["metadata"]["name"] for j in jobs]  # gpu-small and gpu-large
    for job in jobs:
        for validator in VALIDATORS:
            assert not validator.errors(job), validator.errors(job)
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "esd-sweep"
        [container] = pod_spec(job)["containers"]
        assert container["image"] == f"{env['REG']}/esd-sweep@{env['WORKER_DIGEST']}"
        token = {e["name"]: e for e in container["env"]}["HF_TOKEN"]["valueFrom"]
        assert token["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": False}
