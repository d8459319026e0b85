"""Tests of controller.errors: the one table from an error to `esd-sweep`'s exit status and line."""

from __future__ import annotations

import pytest

from controller.errors import (
    EXIT_INFRA,
    EXIT_USAGE,
    InfrastructureError,
    ResultsError,
    SweepError,
    describe_error,
)
from esd_worker.core.errors import (
    ModelListError,
    PermanentModelError,
    StoreError,
    StorePermanentError,
    TransientError,
    UsageError,
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(SweepError("bad flag"), (EXIT_USAGE, "bad flag"), id="sweep"),
        pytest.param(InfrastructureError("no cluster"), (EXIT_INFRA, "no cluster"), id="infra"),
        pytest.param(ResultsError("no results"), (EXIT_USAGE, "no results"), id="results"),
        pytest.param(ModelListError("no list"), (EXIT_USAGE, "no list"), id="model-list"),
        pytest.param(StoreError("timeout"), (EXIT_INFRA, "result store: timeout"),
                     id="store-transient"),
        pytest.param(StorePermanentError("no bucket"), (EXIT_INFRA, "no bucket"),
                     id="store-permanent"),
        pytest.param(UsageError("bad url"), (EXIT_USAGE, "bad url"), id="worker-usage"),
        pytest.param(PermanentModelError("x"), (EXIT_USAGE, "x"), id="other-worker-error"),
        pytest.param(TransientError("x"), (EXIT_USAGE, "x"), id="transient-not-a-store"),
    ],
)
def test_each_expected_error_has_one_status_and_line(
    error: Exception, expected: tuple[int, str]
) -> None:
    """Why: CI scripts branch on 2 (fix the command) vs 3 (the store or cluster is down)."""
    assert describe_error(error) == expected


@pytest.mark.parametrize("error", [RuntimeError("bug"), KeyError("k"), ValueError("v")])
def test_a_bug_is_not_described(error: Exception) -> None:
    """A bug keeps its traceback: None tells the CLI to re-raise."""
    assert describe_error(error) is None
