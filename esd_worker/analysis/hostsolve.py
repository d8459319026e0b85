"""The host's share of a model's analysis: idle host cores as a second eigensolver beside the
device, and each layer's fit (the power law, its row) run off the device's thread.

Owns the host threads of one model's analysis (HostSolvers: `threads` eigensolvers and one
finisher), which side diagonalises a layer's Gram matrix (`offer`: by each side's measured
throughput, so that both finish together), and the host memory the host solves may hold (a
byte budget). How many eigensolvers a worker runs by default is `default_host_solvers`.
Does not own what a spectrum is (esd_worker.analysis.spectra: the same float64 `solve_gram`
on both sides, so a layer's result does not depend on which side solved it) nor the fit
(esd_worker.core.powerlaw).

Why: a GPU host has many cores and the device thread uses one. LAPACK's eigvalsh releases
the GIL, so host threads diagonalise Gram matrices (formed on the device: the costly matmul,
milliseconds there) while the device diagonalises others. A layer goes to the host only when
a host thread is idle, its matrices fit the budget, and the host would finish it before the
device finishes what is left of the model (measured rates; until the host has solved one, it
is taken to be HOST_PRIOR times slower): at the end the device takes every layer, and no
host solve outlasts the device.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from esd_worker.analysis.spectra import Gram, solve_gram, sorted_evals
from esd_worker.analysis.staging import BufferPool
from esd_worker.core.cpus import usable_cpus

log = logging.getLogger(__name__)

R = TypeVar("R")

BUDGET_BYTES = 2 * 2**30  # host memory the host solves may hold at once
HOST_PRIOR = 30.0  # host time / device time of a solve, until both are measured
RESERVED_CPUS = 2  # the read-ahead and the finisher, beside each device's own thread
# At most this many by default: the budget lets ~6 solves of 4096² run at once, and a pod
# without a CPU limit sees every core of its node.
DEFAULT_MAX = 32
_SMOOTHING = 0.3  # weight of a new measurement in a side's rate


def default_host_solvers(devices: Sequence[torch.device], cpus: float | None = None) -> int:
    """Host eigensolvers by default: the cores free within the process's CPU quota
    (esd_worker.core.cpus.usable_cpus, or `cpus`) beside the devices' threads, the read-ahead
    and the finisher, at most DEFAULT_MAX; 0 on the CPU, where the device is the host
    already."""
    if not any(d.type == "cuda" for d in devices):
        return 0
    free = usable_cpus() if cpus is None else cpus
    return min(DEFAULT_MAX, max(0, int(free) - len(devices) - RESERVED_CPUS))


def solve_units(shape: Sequence[int], conv2d: bool) -> float:
    """What a layer's eigensolve costs, in units of n³ (k matrices of n² each)."""
    k = shape[2] * shape[3] if conv2d and len(shape) == 4 else 1
    n = min(shape[0], shape[1]) if len(shape) >= 2 else 0
    return float(k) * float(n) ** 3


class HostSolvers:
    """One model's host threads: `threads` eigensolvers (0: the device solves every layer)
    and a finisher for the fits of the layers the device solved. pinned: Gram matrices come
    from a GPU (page-locked host slots, so their copy does not stall the device's thread)."""

    def __init__(self, threads: int, *, pinned: bool, budget_bytes: int = BUDGET_BYTES) -> None:
        self.threads = max(0, threads)
        self.budget_bytes = budget_bytes
        self._slots = BufferPool(max(1, self.threads), pinned=pinned)
        self._solvers = ThreadPoolExecutor(
            self.threads, thread_name_prefix="esd-host-solve", initializer=torch.set_num_threads,
            initargs=(1,)) if self.threads else None
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="esd-finish")
        self._lock = threading.Lock()
        self._busy = 0
        self._held = 0
        self._device_rate: float | None = None  # seconds per unit (solve_units)
        self._host_rate: float | None = None
        self.host_layers = 0  # layers a host thread solved

    # -- the device's thread ----------------------------------------------------------------

    def finish(self, fn: Callable[..., R], *args: object) -> Future[R]:
        """Run `fn(*args)` (a layer's fit and row) on the finisher thread."""
        return self._finisher.submit(fn, *args)

    def device_solved(self, units: float, seconds: float) -> None:
        """The device thread diagonalised `units` in `seconds`."""
        if units > 0:
            with self._lock:
                self._device_rate = _smooth(self._device_rate, seconds / units)

    def offer(self, gram: Gram, units: float, remaining: float, streams: int,
              finish: Callable[[np.ndarray], R]) -> Future[R] | None:
        """Hand the layer's Gram matrices to a host eigensolver, whose thread then calls
        `finish(sorted eigenvalues)`; None when the device should solve it: no host thread
        idle, no room in the budget, or the host would still be at it when the device ends
        the `remaining` units of the model (over `streams` device streams)."""
        need = gram.nbytes + 2 * gram.gram.numel() * 8  # the slot, float64 copy, LAPACK's copy
        with self._lock:
            if (self._solvers is None or self._busy >= self.threads
                    or self._held + need > self.budget_bytes or self._device_rate is None):
                return None
            host_rate = self._host_rate or self._device_rate * HOST_PRIOR
            if host_rate * units > self._device_rate * remaining / max(1, streams):
                return None
            self._busy += 1
            self._held += need
        try:
            slot = self._slots.acquire(gram.nbytes)  # never waits: a slot per thread
            host = slot[:gram.nbytes].view(gram.gram.dtype).view(gram.gram.shape)
            host.copy_(gram.gram, non_blocking=True)  # on the device's stream, in its order
            copied: torch.cuda.Event | None = None
            if gram.gram.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            return self._solvers.submit(self._solve, slot, host, copied, units, need, finish)
        except BaseException:
            self._release(need)
            raise

    # -- a host thread ------------------------------------------------------------------------

    def _solve(self, slot: torch.Tensor, host: torch.Tensor, copied: torch.cuda.Event | None,
               units: float, need: int, finish: Callable[[np.ndarray], R]) -> R:
        """A host thread's layer: wait for its copy, diagonalise it, then fit it; the thread
        counts busy until the fit is done, its memory until the solve is."""
        try:
            try:
                if copied is not None:
                    copied.synchronize()
                t = time.perf_counter()
                gram64 = host.to(torch.float64)
            finally:
                self._slots.release(slot)
            evals = sorted_evals(solve_gram(gram64))
            del gram64
            with self._lock:
                self._held -= need
                need = 0
                self._host_rate = _smooth(self._host_rate, (time.perf_counter() - t) / units)
                self.host_layers += 1
            return finish(evals)
        finally:
            self._release(need)

    def _release(self, need: int) -> None:
        with self._lock:
            self._busy -= 1
            self._held -= need

    def close(self) -> None:
        """Wait for the host threads' layers and end the threads."""
        if self._solvers is not None:
            self._solvers.shutdown(wait=True, cancel_futures=True)
        self._finisher.shutdown(wait=True, cancel_futures=True)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
