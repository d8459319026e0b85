"""Weights on their way to a device: read into a few reusable host buffers (page-locked where
the device is a GPU) and copied on a CUDA stream of their own, so the copy of the next layer
overlaps the kernels of this one.

Owns the host buffers (BufferPool: a fixed number of slots, so what is read ahead is bounded
to a few layers' bytes whatever the model) and staging one tensor (stage: read into a slot,
start its copy, hand over the device tensor with the event the compute stream waits on).
Does not decide which layers are read ahead (esd_worker.analysis.streams) nor what is computed
on them (esd_worker.analysis.analyze).

Why page-locked: a copy from pageable memory is synchronous (the driver bounces it through a
staging buffer of its own: measured ~1.7 GB/s on an H100 host, 7.3 s of a 7B model's 31 s
with the GPU idle meanwhile); from page-locked memory it is a DMA that runs beside the
kernels. Allocating page-locked memory is slow (it is pinned page by page), so the slots are
kept and reused: a slot grows to the largest tensor it has held, never shrinks.

On the CPU (tests, a CPU-only worker) the same path runs with plain buffers: the "copy" is the
buffer itself, so a slot goes back to the pool only once its layer is analysed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from esd_worker.core.errors import WorkerError

SLOTS = 3  # the layer on the device, the one being copied, the one being read
WAIT_S = 600.0  # a slot is freed when a layer is analysed: minutes mean a stuck device
_ROUND = 1 << 24


class Reader(Protocol):
    """What stage needs of a checkpoint (esd_worker.analysis.weights.Checkpoint)."""

    def read(self, key: str) -> torch.Tensor: ...

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self, key: str) -> int: ...

    def in_memory(self, key: str) -> bool: ...


class BufferPool:
    """`slots` reusable uint8 host buffers; page-locked when `pinned`. Thread-safe."""

    def __init__(self, slots: int = SLOTS, *, pinned: bool, wait_s: float = WAIT_S) -> None:
        if slots < 1:
            raise ValueError("a buffer pool needs at least one slot")
        self.pinned = pinned
        self.wait_s = wait_s
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (torch.empty(0, dtype=torch.uint8), None) for _ in range(slots)]
        self._cond = threading.Condition()
        self.allocated_bytes = 0  # what the slots hold now: the read-ahead's host memory

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A free slot of at least `nbytes` (the free slot nearest in size, grown if none is
        big enough); waits up to wait_s for one to be released."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(f"no host buffer freed in {self.wait_s:.0f}s: the "
                                      "analysis of the layers ahead is stuck")
                self._cond.wait(left)
            fits = [i for i, (b, _) in enumerate(self._free) if b.numel() >= nbytes]
            pick = (min(fits, key=lambda i: self._free[i][0].numel()) if fits
                    else max(range(len(self._free)), key=lambda i: self._free[i][0].numel()))
            buffer, copied = self._free.pop(pick)
        if copied is not None:
            copied.synchronize()  # its last copy to the device has left it
        if buffer.numel() < nbytes:
            buffer = self._grow(buffer, nbytes)
        return buffer

    def _grow(self, old: torch.Tensor, nbytes: int) -> torch.Tensor:
        # Rounded up to 16 MiB, so that layers of nearly the same size share an allocation.
        size = nbytes if nbytes <= _ROUND else -(-nbytes // _ROUND) * _ROUND
        new = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        with self._cond:
            self.allocated_bytes += size - old.numel()
        return new

    def release(self, buffer: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Give a slot back; `after`: the copy out of it, waited for before its next use."""
        with self._cond:
            self._free.append((buffer, after))
            self._cond.notify()


@dataclass
class Staged:
    """A layer's tensor on its device. `ready`: the event its copy recorded (None: nothing to
    wait for); `buffer`: the host slot it came through (None: read without one)."""

    tensor: torch.Tensor
    ready: torch.cuda.Event | None = None
    buffer: torch.Tensor | None = None


def stage(reader: Reader, key: str, device: torch.device, pool: BufferPool | None,
          copy_stream: torch.cuda.Stream | None) -> Staged:
    """Read `key` into a slot of `pool` and start its copy to `device` on `copy_stream` (the
    caller's read-ahead thread; the compute stream waits on the event, see `take`). Without a
    pool, or for a tensor the checkpoint holds in memory already (.bin), the tensor as read:
    copied by the compute stream from where it is."""
    if pool is None or reader.in_memory(key):
        return Staged(reader.read(key))
    buffer = pool.acquire(reader.nbytes(key))
    try:
        host = reader.read_into(key, buffer)
    except BaseException:
        pool.release(buffer)
        raise
    if device.type != "cuda" or copy_stream is None:
        return Staged(host, None, buffer)  # the buffer is the tensor: freed after analysis
    with torch.cuda.stream(copy_stream):
        on_device = host.to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy_stream)
    pool.release(buffer, after=ready)  # free again once the copy has left it
    return Staged(on_device, ready, None)


def take(staged: Staged) -> torch.Tensor:
    """The staged tensor for the calling thread's current stream: it waits (on the device,
    not here) for the copy, and the allocator keeps the copy's memory until this stream is
    done with it."""
    if staged.ready is not None:
        stream = torch.cuda.current_stream(staged.tensor.device)
        stream.wait_event(staged.ready)
        staged.tensor.record_stream(stream)
    return staged.tensor
