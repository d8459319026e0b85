"""One model's layers spread over the devices a worker is given: which devices (select_devices),
one analysis stream per device taking the next layer in model order (Streams), and the GPU
memory one layer needs (layer_peak_bytes, check_fits).

Owns the choice of devices for one model, the dealing of layers to streams with each
stream's read-ahead, gathering the results in the model's layer order, stopping every stream
at the first failure, and the per-layer memory bound. Does not own what is computed for a
layer (esd_worker.analysis.analyze, esd_worker.analysis.spectra) nor which GPUs a worker is given
(the
controller sets CUDA_VISIBLE_DEVICES).

Why streams give the one-stream result bit for bit: a layer's spectrum depends only on its
tensor, the settings and the kernels that run, never on which stream or in which order it
ran; results are stored by layer index and assembled in model order at the end. The same
kernels run on GPUs of one model (a machine's GPUs are); on the CPU (tests) every stream
thread uses the calling thread's torch thread count, as esd_worker.analysis.speculate does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

from esd_worker.analysis.layers import CONV2D, LayerSpec
from esd_worker.analysis.spectra import work_dtype
from esd_worker.core.errors import DeviceError, GpuOutOfMemoryError

log = logging.getLogger(__name__)

PREFETCH = 2  # tensors each stream reads ahead of the one it is analysing
GIB = 2**30

T = TypeVar("T")
# fetch(read-ahead pool, layer, the stream's device): the layer's input, read ahead.
Fetch = Callable[[ThreadPoolExecutor, LayerSpec, torch.device], "Future[Any]"]
# Usable bytes of a device for one layer, None where no bound is checked (the CPU).
Capacity = Callable[[torch.device], "int | None"]


# --- which devices --------------------------------------------------------------------------


def choose_devices(
    requested: str, parallel: bool, *, available: bool, count: int
) -> list[torch.device]:
    """The devices one model is analysed on: cuda:0..count-1 when `parallel`, cuda:0 alone
    when not, the CPU when asked for or when CUDA is not there (auto). Pure: the caller says
    what torch sees (tests give any count)."""
    if requested == "cuda" and not available:
        # The node's fault, not the command's: the same command runs where the GPU works.
        raise DeviceError("--device cuda asked for, but CUDA is not available (no GPU, a "
                          "driver mismatch, or a CPU-only torch)")
    if requested == "cpu" or not available or count < 1:
        return [torch.device("cpu")]
    return [torch.device(f"cuda:{i}") for i in range(count if parallel else 1)]


def select_devices(requested: str, parallel: bool) -> list[torch.device]:
    """choose_devices for what torch sees here, each device logged with its name."""
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    log.info(
        "CUDA_VISIBLE_DEVICES=%s cuda_available=%s devices=%d requested=%s parallel_gpu=%s",
        os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), available, count, requested, parallel,
    )
    devices = choose_devices(requested, parallel, available=available, count=count)
    if devices[0].type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the Gram path needs true float32
        for device in devices:
            log.info("device used: %s (%s)", device, torch.cuda.get_device_name(device))
    else:
        log.info("device used: cpu (%d threads)", torch.get_num_threads())
    return devices


# --- how much memory one layer needs --------------------------------------------------------

def layer_peak_bytes(
    shape: Sequence[int], layer_type: str, precision: str, stored: torch.dtype
) -> int:
    """Bytes of device memory one layer needs on the CUDA path, at its fullest moment.

    The path (esd_worker.analysis.modellayers.LayerAnalysis._weight,
    esd_worker.analysis.spectra.gram_matrices and solve_gram), in phases; W is the weight in
    the work dtype (float32, or float64 with --precision float64), n = min(M, N) per
    matrix, k matrices (Conv2d: kh·kw, else 1):
      load:  the stored tensor copied to the device, then converted: stored + W (the stored
             copy is freed once converted; no second copy when it already is the work dtype);
      check: W + a bool mask of W's size (torch.isfinite(W).all());
      conv:  Conv2d's permuted reshape and its scaled product: W + 2 W transiently;
      gram:  W (+ Conv2d's matrices, W) + the Gram matrices, k·n² in the work dtype;
      eig:   the Gram matrices are diagonalised in float64 (a converted copy, k·n² float64,
             when formed in float32); torch's eigvalsh (linalg_eigh without vectors) copies
             each into the buffer cuSOLVER's syevd overwrites (k·n² float64), writes k·n
             eigenvalues, and asks syevd_bufferSize for a workspace, allocated per matrix.
             cuSOLVER does not document its size; LAPACK's dsyevd needs 2n+1 without vectors
             and 1+6n+2n² with them; budgeted here as n² float64, and
             benchmarks/bench_multi_gpu.py measures the real peak at 16384² to check this
             bound. (A layer a host eigensolver takes leaves the device after the gram phase.)
    Not counted: a LoRA update (r·(M+N) values, or one W-sized delta for a Conv2d), cuBLAS's
    workspace (MiBs), the CUDA context: the safety margin of device_capacity covers them;
    the float64 SVD fallback (rare: eigvalsh did not converge) needs W in float64 more.
    """
    dtype = work_dtype(precision)
    work = dtype.itemsize
    numel = math.prod(shape)
    if layer_type == CONV2D and len(shape) == 4:
        k, m, n = shape[2] * shape[3], shape[0], shape[1]
    else:
        k, m, n = 1, shape[0], shape[1]
    small = min(m, n)
    weight = numel * work
    gram = k * small * small * work
    conv = 2 * weight if layer_type == CONV2D else 0
    load = weight + (0 if stored == dtype else numel * stored.itemsize)
    check = weight + numel
    held = weight + conv // 2  # what stays alive beside the Gram (Conv2d: its matrices)
    solved = k * small * small * 8  # float64, as eigvalsh is given them
    converted = solved if work != 8 else 0
    eig = held + gram + converted + solved + k * small * 8 + small * small * 8
    return max(load, check, weight + conv, held + gram, eig)


def device_capacity(device: torch.device) -> int | None:
    """Bytes one layer may use on `device`: its total memory less a margin for the CUDA
    context (~0.5 GiB), cuBLAS workspaces and the caching allocator's rounding (1 GiB plus
    5%); None for the CPU, where no bound is checked."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total - GIB - 0.05 * total)


def check_fits(
    layer: str, shape: Sequence[int], layer_type: str, precision: str, stored: torch.dtype,
    device: torch.device, capacity: int, *, model: str = "",
) -> None:
    """GpuOutOfMemoryError (exit 5) naming the layer when it needs more than `capacity`."""
    need = layer_peak_bytes(shape, layer_type, precision, stored)
    if need <= capacity:
        return
    of = f" of {model}" if model else ""
    hint = ", or with --precision float32" if precision == "float64" else ""
    raise GpuOutOfMemoryError(
        f"layer {layer}{of} ({'×'.join(map(str, shape))} {str(stored).removeprefix('torch.')}) "
        f"needs ~{need / GIB:.1f} GiB on {device}, which has {capacity / GIB:.1f} GiB usable: "
        f"analyse this model on a GPU with more memory or with --device cpu{hint}"
    )


# --- the streams ----------------------------------------------------------------------------


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """CUDA calls of this thread go to `device` (allocations, the cuSOLVER handle)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Streams(Generic[T]):
    """One analysis stream per device over `layers`: `run` returns `analyse`'s results in
    layer order.

    Each stream takes the next layer of the model from one shared counter (dynamic dealing:
    a stream slowed by big layers takes fewer), reads PREFETCH layers ahead with its own
    reader thread (`fetch`), and analyses on its own device. What was read ahead and never
    analysed (a stream stopping) goes to `discard` (a host buffer it holds is freed).
    Stream 0 runs in the calling thread, so one device adds no thread to today's reader.
    The first exception in any stream sets `stopping`: no stream starts another layer or
    read, reads not begun are cancelled, and `run` re-raises that exception once every
    stream has ended. A CUDA out-of-memory error becomes GpuOutOfMemoryError naming the
    layer, its shape and device.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        devices: Sequence[torch.device],
        *,
        fetch: Fetch,
        analyse: Callable[[LayerSpec, Any, torch.device], T],
        discard: Callable[[Any], None] | None = None,
        label: str = "",
        prefetch: int = PREFETCH,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("Streams needs at least one device")
        self._layers = list(layers)
        self._devices = list(devices)
        self._fetch = fetch
        self._analyse = analyse
        self._discard = discard
        self._label = label
        self._prefetch = max(1, prefetch)
        self._progress = progress  # told the layers done so far after each (a heartbeat)
        self._threads = torch.get_num_threads()
        self._lock = threading.Lock()
        self._next = 0
        self._done = 0
        self._results: list[T | None] = [None] * len(self._layers)
        self._error: BaseException | None = None
        self.stopping = threading.Event()
        # Summed over streams: the stream-seconds devices sat idle waiting for a read (with
        # one stream, the wall time lost to reading, as before).
        self.wait_s = 0.0
        self.layers_per_stream = [0] * len(self._devices)

    def run(self) -> list[T]:
        threads = [threading.Thread(target=self._guarded, args=(i, device),
                                    name=f"esd-stream-{i}")
                   for i, device in enumerate(self._devices) if i > 0]
        try:
            for thread in threads:
                thread.start()
            self._guarded(0, self._devices[0])
        except BaseException as e:  # a signal in the calling thread while starting threads
            self.fail(e)
        finally:
            try:
                for thread in threads:
                    if thread.ident is not None:
                        thread.join()  # each ends after its layer in progress once stopping
            except BaseException:  # a second signal while waiting: stop them all the same
                self.stopping.set()
                raise
        if self._error is not None:
            raise self._error
        missing = [spec.name for spec, r in zip(self._layers, self._results, strict=True)
                   if r is None]
        if missing:  # cannot happen without an error: every index is claimed and finished
            raise RuntimeError(f"layers not analysed: {', '.join(missing[:3])}")
        return [r for r in self._results if r is not None]

    @property
    def claimed(self) -> int:
        """Layers some stream has taken so far (the next one a stream takes is this index)."""
        with self._lock:
            return self._next

    def fail(self, error: BaseException) -> None:
        """Stop every stream; run() raises `error` (the first one given)."""
        with self._lock:
            if self._error is None:
                self._error = error
        self.stopping.set()

    def _guarded(self, index: int, device: torch.device) -> None:
        try:
            if index > 0:
                # As the calling thread: a GEMM split over another thread count can round
                # differently (a new thread starts with OpenMP's default).
                torch.set_num_threads(self._threads)
            with _on(device):
                self._stream(index, device)
        except BaseException as e:  # kept for run(), which re-raises the first
            self.fail(e)

    def _claim(self) -> int | None:
        with self._lock:
            if self.stopping.is_set() or self._next >= len(self._layers):
                return None
            self._next += 1
            return self._next - 1

    def _refill(self, pool: ThreadPoolExecutor, ahead: deque[tuple[int, Future[Any]]],
                device: torch.device) -> None:
        while len(ahead) < self._prefetch:
            claimed = self._claim()
            if claimed is None:
                return
            ahead.append((claimed, self._fetch(pool, self._layers[claimed], device)))

    def _drop(self, ahead: deque[tuple[int, Future[Any]]]) -> None:
        """Hand what was read ahead and will not be analysed to `discard`; reads not begun
        are cancelled, reads under way stay (see _stream)."""
        for item in list(ahead):
            future = item[1]
            if future.cancel() or future.done():
                ahead.remove(item)
                if (self._discard is not None and not future.cancelled()
                        and future.exception() is None):
                    self._discard(future.result())

    def _stream(self, index: int, device: torch.device) -> None:
        waited = 0.0
        ahead: deque[tuple[int, Future[Any]]] = deque()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"esd-read-{index}")
        try:
            self._refill(pool, ahead, device)
            while ahead and not self.stopping.is_set():
                i, future = ahead.popleft()
                self._refill(pool, ahead, device)  # PREFETCH ahead while this one is analysed
                t = time.perf_counter()
                tensor = future.result()
                waited += time.perf_counter() - t
                del future
                if self.stopping.is_set():
                    if self._discard is not None:
                        self._discard(tensor)
                    break
                result = self._one(self._layers[i], tensor, device)
                del tensor
                self._finish(index, i, result)
        except BaseException as e:  # stop the others before waiting for this stream's reader
            self.fail(e)
        finally:
            self._drop(ahead)  # first: a read waiting for a buffer these hold can end
            pool.shutdown(wait=True, cancel_futures=True)
            self._drop(ahead)
            with self._lock:
                self.wait_s += waited

    def _one(self, spec: LayerSpec, tensor: Any, device: torch.device) -> T:
        try:
            return self._analyse(spec, tensor, device)
        except torch.cuda.OutOfMemoryError as e:
            of = f" of {self._label}" if self._label else ""
            raise GpuOutOfMemoryError(
                f"out of GPU memory analysing layer {spec.name}{of} "
                f"({'×'.join(map(str, spec.shape))}) on {device}: {_first_line(e)}"
            ) from e

    def _finish(self, stream: int, i: int, result: T) -> None:
        total = len(self._layers)
        with self._lock:
            self._results[i] = result
            self._done += 1
            done = self._done
            self.layers_per_stream[stream] += 1
        if done % max(1, total // 10) == 0 or done == total:
            log.info("layers %d/%d analysed (%s)", done, total, self._layers[i].name)
        if self._progress is not None:
            self._progress(done)
