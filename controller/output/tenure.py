"""Whether this process may still write the output whose lease it took (controller.output.lease):
the
one signal a sweep or a refit reacts to when an S3 lease is lost, and the error it ends with.

Owns `Tenure` (lost or not, the reactions registered, `check` before a write, `holding`
while a task starts), what a backend holds of it (`Guarded`) and `LeaseLostError` (exit 3).
Does not take, renew or release a lease (controller.output.lease) nor decide what a run does
when it is lost (controller.run.sweep, controller.results.refit).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from controller.errors import InfrastructureError

log = logging.getLogger(__name__)


class LeaseLostError(InfrastructureError):
    """This sweep's S3 lease was taken over while it ran (exit 3): it stopped writing the
    output, which is another sweep's now."""


class Tenure:
    """Whether this process may still write the output it holds the lease of.

    `lost` once the lease is lost: an S3 lease another sweep took over after this one failed
    to renew it within its TTL (paused, cut off from the store). A lock on a local file is
    never lost. `expired` while the lease has gone unrenewed for its TTL (`renewed` says
    until when it surely is ours): lost or not, nobody can tell until the next renewal.
    Callbacks given to `when_lost` run once, in the thread that finds the loss (the renewal
    thread): they must only ask for a stop, not wait for one.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._lost = threading.Event()
        self._held_until = math.inf  # time.monotonic(): a local lock is held until released
        self._expiry_told = False
        # Re-entrant: a reaction registered from inside `holding` must not deadlock.
        self._lock = threading.RLock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def when_lost(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the lease is lost (now, if it is already)."""
        with self._lock:
            if not self._lost.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def renewed(self, until: float) -> None:
        """The store accepted a write of the lease: it is surely ours until `until`
        (time.monotonic(): when that write was sent, plus the TTL)."""
        self._held_until = until
        self._expiry_told = False

    @property
    def expired(self) -> bool:
        """Not renewed for its TTL: another sweep may have taken it over already (this process
        was paused, say), though the renewal that would say so has not come back yet."""
        return time.monotonic() >= self._held_until

    @contextmanager
    def holding(self) -> Iterator[bool]:
        """Whether the lease is still held, and it stays so until the block ends: `lose`
        waits for the block, so that a check and the start it allows are one step (a task
        starts before the loss is known, or not at all). False too while it is `expired`:
        a sweep resumed after a pause past the TTL starts nothing until a renewal says
        whether the output is still its own. Keep the block short: the thread that found the
        loss waits on it."""
        with self._lock:
            held = not self._lost.is_set()
            if held and self.expired:
                held = False
                if not self._expiry_told:
                    self._expiry_told = True
                    log.warning("the lease on %s was not renewed within its TTL: no task "
                                "starts until a renewal says whether it is still ours",
                                self.url)
            yield held

    def lose(self) -> None:
        with self._lock:
            if self._lost.is_set():
                return
            self._lost.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one failed reaction must not keep the others from running
                log.exception("reacting to the loss of the lease on %s", self.url)

    def check(self) -> None:
        """LeaseLostError when the lease is lost: call before each write of the output."""
        if self.lost:
            raise LeaseLostError(
                f"the lease on {self.url} was lost (not renewed within its TTL, then taken "
                "over): this process stopped writing there; run the same command again once "
                "the other sweep has ended"
            )


class Guarded:
    """A backend's hold on the output's lease (Backend.guard): once `guard` is given the
    tenure, no task starts after its loss (`may_start`, the one step of a check and a start;
    `lease_lost` for backends that only stop submitting). Before it, tasks always may."""

    _tenure: Tenure | None = None

    def guard(self, tenure: Tenure) -> None:
        self._tenure = tenure

    def may_start(self) -> AbstractContextManager[bool]:
        """Held while one task starts: True while the lease is held (Tenure.holding)."""
        return nullcontext(True) if self._tenure is None else self._tenure.holding()

    @property
    def lease_lost(self) -> bool:
        return self._tenure is not None and self._tenure.lost
