"""The Kubernetes backend's exception family, and the one mapping of it to sweep errors.

Owns KubeError and its kinds (what the API server answered, by meaning, not HTTP status),
JobSpecError (a Job that cannot be built) and `as_sweep_error`, which turns a KubeError
into the SweepError that says what to do next (`sweep_errors`: around a backend's run).
Importable without the optional `kubernetes` package: only
controller.backends.kubernetes.common.client raises the KubeErrors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from controller.errors import InfrastructureError, SweepError


class KubeError(Exception):
    """Base of every error talking to the Kubernetes API; `status` is the HTTP status or None."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubePermissionError(KubeError):
    """401/403: the credentials were rejected or RBAC lacks a verb (the message says which)."""


class KubeNotFoundError(KubeError):
    """404: the object or the namespace does not exist."""


class KubeConflictError(KubeError):
    """409 outside create (e.g. an update raced another writer)."""


class KubeInvalidError(KubeError):
    """400/422: the server rejected the object; the message carries its field errors."""


class KubeQuotaError(KubeError):
    """403 "exceeded quota": a ResourceQuota is full; try again once something finishes."""


class KubeUnavailableError(KubeError):
    """The API server kept failing (429, 5xx, connection errors) after every retry."""


class ResourceVersionExpired(KubeError):
    """410 Gone: the resourceVersion is too old to watch (or page) from; list again."""


class KubeConfigError(KubeError):
    """No usable kubeconfig context or in-cluster service account."""


class JobSpecError(ValueError):
    """The Job cannot be built from these settings or this model; the message lists why."""


def as_sweep_error(e: BaseException) -> SweepError | None:
    """A KubeError as the sweep error that says what to do; None for anything else.

    Permissions and an unreachable API are the cluster's state (infrastructure, exit 3); a
    bad kubeconfig, a missing namespace and a rejected Job are the user's to fix (usage,
    exit 2). Subclasses come before KubeError, whose other kinds are infrastructure.
    """
    if isinstance(e, KubePermissionError):
        return InfrastructureError(f"kubernetes: {e}")
    if isinstance(e, KubeUnavailableError):
        return InfrastructureError(f"kubernetes API unreachable: {e}")
    if isinstance(e, KubeConfigError):
        return SweepError(f"kubernetes: {e}")
    if isinstance(e, KubeNotFoundError):
        return SweepError(f"kubernetes: {e} (does the namespace exist? --namespace)")
    if isinstance(e, KubeInvalidError):
        return SweepError(f"kubernetes rejected a Job: {e}")
    if isinstance(e, KubeError):
        return InfrastructureError(f"kubernetes: {e}")
    return None


@contextmanager
def sweep_errors() -> Iterator[None]:
    """Kubernetes errors leave a backend as the sweep errors that say what to do."""
    try:
        yield
    except KubeError as e:
        mapped = as_sweep_error(e)
        if mapped is None:
            raise
        raise mapped from e
