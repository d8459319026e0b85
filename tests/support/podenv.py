"""A container's environment as the kubelet gives it to the process, for the simulators'
workers (tests.support.indexed, .shardworker) and their tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resolve_env(pod: Mapping[str, Any], container: str | None = None) -> dict[str, str]:
    """A container's environment as the kubelet resolves it: plain values and downward-API
    fieldRefs to metadata (labels['k'], annotations['k'], name, namespace, uid) and
    spec.nodeName ("" until the pod is bound)."""
    spec = next(c for c in pod["spec"]["containers"] if container in (None, c["name"]))
    meta = pod["metadata"]
    env: dict[str, str] = {}
    for var in spec.get("env") or []:
        path = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if path is None:
            env[var["name"]] = str(var.get("value", ""))
        elif path.startswith(("metadata.labels['", "metadata.annotations['")):
            where, _, key = path[len("metadata."):].partition("['")
            env[var["name"]] = str((meta.get(where) or {}).get(key[:-2], ""))
        elif path.startswith("metadata."):
            env[var["name"]] = str(meta.get(path[len("metadata."):], ""))
        elif path == "spec.nodeName":
            env[var["name"]] = str(pod["spec"].get("nodeName") or "")
    return env
