"""`esd-sweep doctor --backend kubernetes`: the Secrets the pods read (kube-secrets) and the
GPU resource the nodes are counted by (--gpu-resource, MIG slices). Over HTTP against
KubeSim, through the real CLI; values of Secrets are never printed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from controller.cli import main
from tests.support.cluster import NS
from tests.support.kubesim import KubeSim

TOKEN_VALUE = "aGZfU3VwZXJTZWNyZXRUb2tlbjEyMzQ1Njc4OTA="  # base64 of an hf_… token


@pytest.fixture
def kubeconfig_env(sim: KubeSim, kubeconfig: object) -> Iterator[KubeSim]:
    yield sim


def add_secret(sim: KubeSim, name: str, keys: list[str]) -> None:
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_namespaced_secret(NS, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
        "data": dict.fromkeys(keys, TOKEN_VALUE)})


def add_node(sim: KubeSim, name: str, allocatable: dict[str, str]) -> None:
    k8s.CoreV1Api(sim.api_client(bypass=True)).create_node({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "status": {"allocatable": allocatable, "capacity": allocatable}})


def doctor(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    code = main(["doctor", "--backend", "kubernetes", "--namespace", NS, "--no-telemetry",
                 *argv])
    out = capsys.readouterr().out
    assert "hf_SuperSecret" not in out and TOKEN_VALUE not in out
    return code, {line.split(":", 1)[0].split(" ", 1)[1]: line for line in out.splitlines()}


S3_KEYS = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
CASES = {
    "no-flags": ([], {}, 0, "• kube-secrets: no --hf-token-secret: gated models will fail"),
    "token-ok": (["--hf-token-secret", "hf-token"], {"hf-token": ["token"]}, 0,
                 "✓ kube-secrets: in namespace esd: hf-token (token)"),
    "token-and-s3-ok": (["--hf-token-secret", "hf:tok", "--s3-secret", "s3"],
                        {"hf": ["tok"], "s3": S3_KEYS}, 0,
                        "✓ kube-secrets: in namespace esd: hf (tok); s3 (AWS_ACCESS_KEY_ID, "
                        "AWS_SECRET_ACCESS_KEY)"),
    "s3-only": (["--s3-secret", "s3"], {"s3": S3_KEYS}, 0,
                "✓ kube-secrets: in namespace esd: s3 (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
                "; no --hf-token-secret: gated models will fail"),
    "token-missing": (["--hf-token-secret", "hf-tokn"], {"hf-token": ["token"]}, 1,
                      "✗ kube-secrets: Secret hf-tokn (--hf-token-secret) not found in "
                      "namespace esd — fix: create the Secret"),
    "key-missing": (["--hf-token-secret", "hf-token"], {"hf-token": ["hf_token"]}, 1,
                    "✗ kube-secrets: Secret hf-token (--hf-token-secret) has no key token "
                    "(keys: hf_token)"),
    "s3-key-missing": (["--s3-secret", "s3"], {"s3": ["AWS_ACCESS_KEY_ID"]}, 1,
                       "✗ kube-secrets: Secret s3 (--s3-secret) has no key "
                       "AWS_SECRET_ACCESS_KEY"),
}


@pytest.mark.parametrize(("argv", "secrets", "code", "line"), CASES.values(), ids=CASES.keys())
def test_secrets(kubeconfig_env: KubeSim, capsys: pytest.CaptureFixture[str], argv: list[str],
                 secrets: dict[str, list[str]], code: int, line: str) -> None:
    add_node(kubeconfig_env, "node-a", {"cpu": "8", "nvidia.com/gpu": "1"})
    for name, keys in secrets.items():
        add_secret(kubeconfig_env, name, keys)
    got, lines = doctor(argv, capsys)
    assert lines["kube-secrets"].startswith(line), lines["kube-secrets"]
    assert got == code


def test_secrets_the_caller_may_not_read_are_said_not_failed(
        kubeconfig_env: KubeSim, capsys: pytest.CaptureFixture[str]) -> None:
    add_node(kubeconfig_env, "node-a", {"cpu": "8", "nvidia.com/gpu": "1"})
    kubeconfig_env.forbid("get", "secrets", namespace=NS)
    code, lines = doctor(["--hf-token-secret", "hf-token"], capsys)
    assert lines["kube-secrets"].startswith(
        "• kube-secrets: cannot check: not allowed to read secrets in namespace esd")
    assert code == 0


MIG = "nvidia.com/mig-1g.10gb"


@pytest.mark.parametrize(("argv", "line"), [
    (["--gpu-resource", MIG], f"✓ kube-nodes: 1 of 2 node(s) expose {MIG}: 7 GPU(s) "
     "allocatable (mig-a 7)"),
    ([], "✓ kube-nodes: 1 of 2 node(s) expose nvidia.com/gpu: 2 GPU(s) allocatable (full-a 2)"),
    (["--gpu-resource", "nvidia.com/mig-3g.40gb"], "✗ kube-nodes: none of the 2 node(s) has "
     "allocatable nvidia.com/mig-3g.40gb"),
])
def test_nodes_are_counted_by_the_gpu_resource(
        kubeconfig_env: KubeSim, capsys: pytest.CaptureFixture[str], argv: list[str],
        line: str) -> None:
    """A MIG node (mixed strategy) exposes its slices as their own resources: the doctor
    counts the one the pods will request."""
    add_node(kubeconfig_env, "mig-a", {"cpu": "8", MIG: "7"})
    add_node(kubeconfig_env, "full-a", {"cpu": "8", "nvidia.com/gpu": "2"})
    _, lines = doctor(argv, capsys)
    assert lines["kube-nodes"].startswith(line), lines["kube-nodes"]


def test_a_bad_gpu_resource_is_a_usage_error(kubeconfig_env: KubeSim,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--backend", "kubernetes", "--namespace", NS, "--gpu-resource",
                 "mig-1g.10gb"])
    assert code == 2
    assert "--gpu-resource: 'mig-1g.10gb' is not an extended resource name" in (
        capsys.readouterr().err)
