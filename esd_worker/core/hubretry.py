"""How a request to the HuggingFace hub is retried: how many attempts in all, and how long to
wait before the next one (exponential backoff, or the hub's Retry-After, never past a cap).

One policy for both hub clients: the worker's (esd_worker.fetch.hub, over huggingface_hub)
and the controller's (controller.weights.hubclient, over urllib, which cannot import the
worker's). Owns the numbers and the reading of Retry-After and of ESD_HUB_RETRIES. Does not
decide which failures are worth a retry (each client knows its errors), sleep, or limit the
rate (esd_worker.core.ratelimit). Pure: no I/O, no clock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from esd_worker.core.errors import WorkerError

RETRIES_ENV = "ESD_HUB_RETRIES"


@dataclass(frozen=True)
class RetryPolicy:
    """attempts: tries in all (1: no retry); the n-th wait is backoff_s * 2**(n-1), or the
    hub's Retry-After (seconds form) when it sends one, never more than max_wait_s."""

    attempts: int = 4
    backoff_s: float = 1.0
    max_wait_s: float = 60.0

    @classmethod
    def from_env(cls, **overrides: Any) -> RetryPolicy:
        """The defaults, with attempts = 1 + $ESD_HUB_RETRIES when set, then `overrides`."""
        raw = os.environ.get(RETRIES_ENV, "").strip()
        if raw:
            try:
                retries = int(raw)
            except ValueError:
                raise WorkerError(f"{RETRIES_ENV} must be a whole number, got {raw!r}") from None
            overrides.setdefault("attempts", max(0, retries) + 1)
        return cls(**overrides)

    def wait_s(self, attempt: int, retry_after: str | None = None) -> float:
        """The wait after failed attempt number `attempt` (from 1), given the answer's
        Retry-After header (None: it had none)."""
        seconds = retry_after_s(retry_after)
        wait = seconds if seconds is not None else self.backoff_s * 2 ** (attempt - 1)
        return max(0.0, min(wait, self.max_wait_s))


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header's seconds; None without one, or for its HTTP-date form (then
    the backoff applies: a date needs a clock both sides agree on). Only the RFC's
    delay-seconds, ASCII digits, count: "1.5", "-3" or "inf" are no delay."""
    text = (value or "").strip()
    return float(text) if text.isascii() and text.isdigit() else None
