"""Kueue's side of a Job that waits: the Workloads that hold it suspended.

Owns asking the API for a suspended Job's Kueue Workloads (what describe_pending reads to
say why Kueue has not admitted it), and treating a permission refusal as "unknown". Both
Kubernetes modes use it to explain a pending Job. Does not interpret the Workloads
(common.diagnosis, which stays pure: no client) nor decide when to ask (the modes do).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.errors import KubePermissionError
from controller.backends.kubernetes.common.names import KUEUE_JOB_UID_LABEL
from controller.backends.kubernetes.common.settings import ClusterSettings

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)


def queued_workloads(kube: KubeClient, settings: ClusterSettings,
                     job: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The Kueue Workloads of a Job that Kueue holds suspended (none otherwise: a Job not
    queued, or one already admitted, has its answer in its pods); None when RBAC does not
    let the controller read them (the sweep goes on: this only explains a wait)."""
    if not settings.kueue_queue or not (job.get("spec") or {}).get("suspend"):
        return []
    uid = (job.get("metadata") or {}).get("uid")
    if not uid:
        return []
    try:
        return kube.list_workloads(settings.namespace, f"{KUEUE_JOB_UID_LABEL}={uid}")
    except KubePermissionError as e:
        log.debug("cannot read Kueue Workloads: %s", e)
        return None
