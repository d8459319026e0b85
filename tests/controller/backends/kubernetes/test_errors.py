"""controller.backends.kubernetes.common.errors: each KubeError becomes the sweep error (and exit
status) that says what to do, and the module imports without the `kubernetes` package."""

from __future__ import annotations

import pytest

from controller.backends.kubernetes.common.errors import (
    JobSpecError,
    KubeConfigError,
    KubeConflictError,
    KubeError,
    KubeInvalidError,
    KubeNotFoundError,
    KubePermissionError,
    KubeQuotaError,
    KubeUnavailableError,
    ResourceVersionExpired,
    as_sweep_error,
)
from controller.errors import EXIT_INFRA, EXIT_USAGE, InfrastructureError, SweepError


@pytest.mark.parametrize(
    ("error", "kind", "exit_code", "message"),
    [
        # The cluster's state: someone with rights must act (exit 3).
        pytest.param(KubePermissionError("cannot create jobs.batch"), InfrastructureError,
                     EXIT_INFRA, "kubernetes: cannot create jobs.batch", id="permission"),
        pytest.param(KubeUnavailableError("503 after 6 tries"), InfrastructureError,
                     EXIT_INFRA, "kubernetes API unreachable: 503 after 6 tries",
                     id="unavailable"),
        # The user's to fix: a flag or the kubeconfig (exit 2).
        pytest.param(KubeConfigError("no context 'prod'"), SweepError, EXIT_USAGE,
                     "kubernetes: no context 'prod'", id="config"),
        pytest.param(KubeNotFoundError('namespaces "esd" not found'), SweepError, EXIT_USAGE,
                     'kubernetes: namespaces "esd" not found (does the namespace exist? '
                     "--namespace)", id="not-found"),
        pytest.param(KubeInvalidError("spec.template: Required value"), SweepError,
                     EXIT_USAGE, "kubernetes rejected a Job: spec.template: Required value",
                     id="invalid"),
        # Any other API trouble is the cluster's (exit 3).
        pytest.param(KubeConflictError("conflict"), InfrastructureError, EXIT_INFRA,
                     "kubernetes: conflict", id="conflict"),
        pytest.param(KubeQuotaError("exceeded quota"), InfrastructureError, EXIT_INFRA,
                     "kubernetes: exceeded quota", id="quota"),
        pytest.param(ResourceVersionExpired("410"), InfrastructureError, EXIT_INFRA,
                     "kubernetes: 410", id="expired"),
        pytest.param(KubeError("odd", status=418), InfrastructureError, EXIT_INFRA,
                     "kubernetes: odd", id="other"),
    ],
)
def test_as_sweep_error(error: KubeError, kind: type[SweepError], exit_code: int,
                        message: str) -> None:
    mapped = as_sweep_error(error)
    assert type(mapped) is kind
    assert mapped is not None and mapped.exit_code == exit_code and str(mapped) == message


@pytest.mark.parametrize(
    "error",
    [pytest.param(ValueError("x"), id="value-error"),
     pytest.param(JobSpecError("bad"), id="job-spec-error"),
     pytest.param(SweepError("already one"), id="sweep-error")],
)
def test_other_errors_are_not_mapped(error: Exception) -> None:
    """Not a KubeError: not this mapping's to word (JobSpecError is a model's failure)."""
    assert as_sweep_error(error) is None
