"""`esd-sweep doctor --backend kubernetes`: the Secrets the worker pods read (kube-secrets).

Owns checking that the Secret --hf-token-secret names exists with its key (the pods require
it: without it they never start), and that the one --s3-secret names exists with the access
key pair; without --hf-token-secret, a note that gated models will fail. The Secrets are
read with the caller's credentials (the controller's Role grants no Secret access: only the
pods read them); a 403 is said, not failed. Only key names are ever shown, never a value.
Does not check anything else about the cluster (controller.doctor.kubernetes).
"""

from __future__ import annotations

from typing import Any

from controller.backends.kubernetes.common.client import KubeClient, _json, _Op
from controller.backends.kubernetes.common.errors import (
    KubeError,
    KubeNotFoundError,
    KubePermissionError,
)
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.doctor.checks import FAIL, INFO, PASS, Check

NAME = "kube-secrets"
S3_REQUIRED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")  # AWS_SESSION_TOKEN: optional


def read_secret_keys(kube: KubeClient, namespace: str, name: str) -> set[str] | None:
    """The key names of a Secret (its values are dropped at once); None when there is none
    of that name. KubePermissionError when the caller may not read it."""
    op = _Op("get", "secrets", "", namespace)
    try:
        resp = kube._call(op, kube._core.read_namespaced_secret, name, namespace,
                          _preload_content=False)
    except KubeNotFoundError:
        return None
    doc: dict[str, Any] = _json(resp) or {}
    return set(doc.get("data") or {}) | set(doc.get("stringData") or {})


def check_secrets(kube: KubeClient, settings: ClusterSettings) -> Check:
    """The Secrets the pods read, each with the keys they use."""
    ns = settings.namespace
    wanted: list[tuple[str, str, tuple[str, ...]]] = []  # (flag, Secret, keys it must hold)
    if settings.hf_token_secret:
        name, _, key = settings.hf_token_secret.partition(":")
        wanted.append(("--hf-token-secret", name, (key,)))
    if settings.s3_secret:
        wanted.append(("--s3-secret", settings.s3_secret, S3_REQUIRED))
    no_token = ("no --hf-token-secret: gated models will fail (create a Secret with the HF "
                "token, docs/kubernetes.md, and name it with --hf-token-secret NAME:KEY)")
    if not wanted:
        return Check(NAME, INFO, no_token)
    problems, found = [], []
    for flag, name, keys in wanted:
        try:
            held = read_secret_keys(kube, ns, name)
        except KubePermissionError:
            return Check(NAME, INFO, f"cannot check: not allowed to read secrets in namespace "
                         f"{ns} (the pods read {', '.join(n for _, n, _ in wanted)} themselves)")
        except KubeError as e:
            return Check(NAME, FAIL, f"cannot read Secret {name}: {e}",
                         "try again; `kubectl get secret -n " + ns + "` shows whether it exists")
        if held is None:
            problems.append(f"Secret {name} ({flag}) not found in namespace {ns}")
            continue
        missing = [k for k in keys if k not in held]
        if missing:
            problems.append(f"Secret {name} ({flag}) has no key {', '.join(missing)} "
                            f"(keys: {', '.join(sorted(held)) or 'none'})")
        else:
            found.append(f"{name} ({', '.join(keys)})")
    if problems:
        return Check(NAME, FAIL, "; ".join(problems),
                     "create the Secret with that key (docs/kubernetes.md), or fix the flag: "
                     "a pod whose HF token Secret is missing never starts")
    note = "" if settings.hf_token_secret else f"; {no_token}"
    return Check(NAME, PASS, f"in namespace {ns}: {'; '.join(found)}{note}")
