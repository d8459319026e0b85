"""esd_worker.core.hubretry: the one retry policy of both hub clients (the worker's,
esd_worker.fetch.hub, and the controller's, controller.weights.hubclient). The controller's
client once had its own copy of the waits, which took any float in Retry-After ("1.5",
"-3", "inf") where the worker's took only the RFC's whole seconds."""

from __future__ import annotations

import pytest

from esd_worker.core.errors import WorkerError
from esd_worker.core.hubretry import RetryPolicy, retry_after_s
from esd_worker.fetch.hub import RetryPolicy as WorkerPolicy

WAITS = {
    "first-backoff": (None, 1, 1.0),
    "third-backoff": (None, 3, 4.0),
    "backoff-capped": (None, 9, 60.0),
    "retry-after": ("7", 1, 7.0),
    "retry-after-spaced": (" 7 ", 2, 7.0),
    "retry-after-zero": ("0", 3, 0.0),
    "retry-after-capped": ("3600", 1, 60.0),
    "http-date-backs-off": ("Wed, 21 Oct 2015 07:28:00 GMT", 2, 2.0),
    "fraction-backs-off": ("1.5", 1, 1.0),
    "negative-backs-off": ("-3", 2, 2.0),
    "inf-backs-off": ("inf", 1, 1.0),
    "non-ascii-digits-back-off": ("\u0663", 1, 1.0),  # ARABIC-INDIC THREE: isdigit, no float
    "empty-backs-off": ("", 2, 2.0),
}


@pytest.mark.parametrize(("retry_after", "attempt", "wait"), WAITS.values(), ids=WAITS.keys())
def test_waits(retry_after: str | None, attempt: int, wait: float) -> None:
    """Exponential from 1 s, or the hub's Retry-After in whole seconds, never over 60 s."""
    assert RetryPolicy().wait_s(attempt, retry_after) == wait


def test_the_worker_uses_the_core_policy() -> None:
    assert WorkerPolicy is RetryPolicy


@pytest.mark.parametrize(("value", "seconds"), [(None, None), ("12", 12.0), ("1e3", None)])
def test_retry_after_seconds(value: str | None, seconds: float | None) -> None:
    assert retry_after_s(value) == seconds


@pytest.mark.parametrize(("env", "attempts"), [(None, 4), ("0", 1), ("2", 3), ("-5", 1)])
def test_attempts_from_env(monkeypatch: pytest.MonkeyPatch, env: str | None,
                           attempts: int) -> None:
    monkeypatch.delenv("ESD_HUB_RETRIES", raising=False)
    if env is not None:
        monkeypatch.setenv("ESD_HUB_RETRIES", env)
    assert RetryPolicy.from_env().attempts == attempts


def test_a_bad_retries_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESD_HUB_RETRIES", "many")
    with pytest.raises(WorkerError, match="ESD_HUB_RETRIES must be a whole number"):
        RetryPolicy.from_env()
