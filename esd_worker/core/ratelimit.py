"""A token bucket shared by threads: at most `rate` operations a second on average, bursts of
up to `burst`, and a hold ("nothing before T") for when the other side says to back off.

Owns only the arithmetic of waiting. What is limited (hub requests) and when a hold starts (a
429's Retry-After) are the hub clients' (esd_worker.fetch.hub, controller.weights.hubclient).
Pure: the clock and the sleep are injected, so tests need no real time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class TokenBucket:
    """`acquire()` takes one token, waiting until there is one; thread-safe and first come,
    first served (each caller reserves its slot under the lock, then sleeps outside it).

    rate: tokens per second (> 0). burst: the most tokens held (default max(1, rate)).
    initial: tokens at the start (default 1, not a full bucket: the pods of a sweep start
    together and share one sweep-wide rate, so each starts at its rate rather than with a
    burst; an idle bucket refills up to `burst`).

    Kept as the time the next token is due ("generic cell rate algorithm"): `_due` is when
    the bucket would next be empty-and-refilled-by-one; a request may go `tolerance` seconds
    (burst - 1 tokens) before it.
    """

    def __init__(self, rate: float, *, burst: float | None = None, initial: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
        self.rate = float(rate)
        self.burst = max(1.0, self.rate) if burst is None else float(burst)
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ValueError(f"burst must be >= 1, got {burst!r}")
        if not 1 <= initial <= self.burst:
            raise ValueError(f"initial must be between 1 and burst ({self.burst:g}), "
                             f"got {initial!r}")
        self._interval = 1.0 / self.rate
        self._tolerance = (self.burst - 1.0) * self._interval
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        # `initial` tokens are there now: the first goes at once, the others right after.
        self._due = clock() + self._tolerance - (initial - 1.0) * self._interval

    def reserve(self) -> float:
        """Take the next token without waiting for it: the seconds until it may be used."""
        with self._lock:
            now = self._clock()
            due = max(self._due, now)
            at = max(now, due - self._tolerance)
            self._due = due + self._interval
            return at - now

    def acquire(self) -> float:
        """Take one token, sleeping until it is due; the seconds waited."""
        wait = self.reserve()
        if wait > 0:
            self._sleep(wait)
        return wait

    def hold(self, seconds: float) -> None:
        """No token before `seconds` from now, and then one at a time at `rate` (no burst):
        the other side asked to back off, and every thread must hear it."""
        if not seconds > 0:
            return
        with self._lock:
            self._due = max(self._due, self._clock() + seconds + self._tolerance)
