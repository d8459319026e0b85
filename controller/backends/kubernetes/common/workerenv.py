"""The worker container's environment: fixed paths, Secrets by reference, extra variables.

Owns what every worker pod's env holds (HF_HOME, HOME and TMPDIR on the writable volumes,
the node's name, NVIDIA_VISIBLE_DEVICES for pods without GPUs, the HF token and S3 keys as
secretKeyRefs) and which extra variables --env style settings may add (no credentials, no
names esd-sweep sets). Pure. Does not build the pod (controller.backends.kubernetes.common
.jobs) or read the Secrets (the doctor checks they exist: controller.doctor.secrets).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from esd_worker.core.redact import has_userinfo

CACHE_DIR = "/cache"
HF_HOME = "/cache/hf"
TMP_DIR = "/tmp"
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Env names set here or from Secrets, which extra env must not override.
_RESERVED_ENV = frozenset({
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", *S3_KEYS, "HF_HOME", "HOME", "TMPDIR",
    "XDG_CACHE_HOME", "NODE_NAME", "NVIDIA_VISIBLE_DEVICES",
})
# Names that say "this is a credential": those belong in a Secret, not in the Job object.
_SECRETISH_ENV = re.compile(r"(?i)(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|API_KEY)")


def env_problems(env: Mapping[str, str]) -> list[str]:
    """Every problem with the extra variables, each starting "env: " (empty: usable)."""
    out: list[str] = []
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            out.append(f"env: {key!r} is not an environment variable name")
        elif key in _RESERVED_ENV:
            out.append(f"env: {key} is set by esd-sweep (secrets go in hf_token_secret "
                       "or s3_secret)")
        elif _SECRETISH_ENV.search(key):
            out.append(f"env: {key} looks like a credential: put it in a Secret, "
                       "not in the Job")
        if not isinstance(value, str) or _CONTROL.search(value):
            out.append(f"env: the value of {key} must be a single-line string")
        elif has_userinfo(value):  # the value is not repeated
            out.append(f"env: {key} holds user:password@, readable in the Job: give the "
                       "URL without it, S3 keys in --s3-secret, the token in --hf-token-secret")
    return out


def worker_env(*, gpus: int, hf_token_secret: str | None, s3_secret: str | None,
               env: Mapping[str, str]) -> list[dict[str, Any]]:
    """The worker container's env list. gpus: what the pod requests (0: none);
    hf_token_secret: "NAME:KEY"; s3_secret: a Secret with the S3_KEYS."""
    out: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HOME", "value": TMP_DIR},  # the root filesystem is read-only
        {"name": "TMPDIR", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{CACHE_DIR}/xdg"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The worker's log names its node: a broken GPU is the node's fault, not a model's.
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if gpus == 0:
        # On a GPU node whose default runtime is nvidia, a container without this sees
        # every GPU of the node (the device plugin sets it only for pods it gave GPUs).
        out.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
    # Secrets by reference only. The HF token is required: a Secret or key misnamed would
    # otherwise reach the worker as no token, and every gated model would fail as
    # "permanently" gated; required, the pod waits in CreateContainerConfigError, which the
    # controller reads as the run's end (common.diagnosis.config_error). The S3 keys stay
    # optional: without them boto3 falls back to IRSA / pod identity / instance roles.
    if hf_token_secret:
        name, _, key = hf_token_secret.partition(":")
        out.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": name, "key": key, "optional": False}}})
    if s3_secret:
        out.extend({"name": key, "valueFrom": {
            "secretKeyRef": {"name": s3_secret, "key": key, "optional": True}}}
            for key in S3_KEYS)
    out.extend({"name": k, "value": v} for k, v in sorted(env.items()))
    return out
