"""One model's layers, computed: each layer's row, its LoRA merge on the device, its spectrum
(the Gram matrices on the device, diagonalised there or by a host eigensolver) and its fit
(on the host, while the device works on the next layer).

Owns what is computed for one layer and gathering the model's rows and eigenvalues in layer
order. The spreading of layers over devices, one stream each, and the memory bound per layer
are esd_worker.analysis.streams'; the host's threads and which side solves a layer are
esd_worker.analysis.hostsolve's; reading weights into host buffers and copying them is
esd_worker.analysis.staging's; resolving, discovering and writing a model is
esd_worker.analysis.analyze's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, TypeVar

import numpy as np
import torch

from esd_worker.analysis.adapters import AdapterMatch, add_lora_
from esd_worker.analysis.hostsolve import HostSolvers, solve_units
from esd_worker.analysis.layers import CONV2D, LayerMap, LayerSpec
from esd_worker.analysis.spectra import (
    Spectrum,
    gram_matrices,
    solve_gram,
    sorted_evals,
    work_dtype,
)
from esd_worker.analysis.speculate import Speculated, Speculation
from esd_worker.analysis.staging import BufferPool, Reader, Staged, stage, take
from esd_worker.analysis.streams import PREFETCH, Capacity, Streams, check_fits, device_capacity
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.powerlaw import METRIC_COLUMNS, layer_metrics
from esd_worker.fetch.resolve import ResolvedModel

T = TypeVar("T")
# (scheme, refusal) of a layer key: the quantization its weight was dequantized from, and why
# it cannot be read as floats (esd_worker.analysis.quantized; None, None: stored as is).
Quantization = Callable[[str], "tuple[str | None, str | None]"]


def _stored(key: str) -> tuple[str | None, str | None]:
    return None, None


def _nan_metrics() -> dict[str, Any]:
    return {col: float("nan") for col in METRIC_COLUMNS} | {"num_evals": 0, "num_pl_spikes": 0,
                                                            "matrix_rank": 0}


@dataclass(frozen=True)
class LayerResult:
    """What one layer gives the results: its row, its eigenvalues (None for a status row
    without a spectrum) and whether the spectrum came from the speculation."""

    row: dict[str, Any]
    evals: np.ndarray | None = None
    speculated: bool = False


class LayerAnalysis:
    """State of one model's analysis; `run` fills `rows` and `eigs` in layer order.

    devices: one analysis stream each (esd_worker.analysis.streams.Streams); read: the checkpoint's
    tensor reader, shared by the streams (it must be thread-safe, as Checkpoint.read is);
    reader: the checkpoint itself, to read into the reusable (on a GPU page-locked) host
    buffers of esd_worker.analysis.staging and copy on a stream of their own (None: `read`,
    each tensor a buffer of its own, copied by the compute stream); capacity: usable bytes
    of a device for one layer (None: no bound checked); host_solvers: host threads that
    diagonalise layers beside the devices (esd_worker.analysis.hostsolve; 0: none).
    """

    def __init__(
        self,
        model: ResolvedModel,
        layer_map: LayerMap,
        read: Callable[[str], torch.Tensor],
        analysis: AnalysisSettings,
        devices: Sequence[torch.device],
        adapter: AdapterMatch | None,
        fan_in_fan_out: bool,
        speculation: Speculation | None = None,
        *,
        capacity: Capacity = device_capacity,
        stored_dtype: Callable[[str], torch.dtype | None] | None = None,
        reader: Reader | None = None,
        host_solvers: int = 0,
        quantization: Quantization | None = None,
    ) -> None:
        self.model = model
        self.layer_map = layer_map
        self.read = read
        self.analysis = analysis
        self.devices = list(devices)
        self.adapter = adapter or AdapterMatch({}, {}, [])
        self.fan_in_fan_out = fan_in_fan_out
        self.work_dtype = work_dtype(analysis.precision)
        self.capacity = capacity
        self.stored_dtype = stored_dtype
        self.rows: list[dict[str, Any]] = []
        self.eigs: dict[str, np.ndarray] = {}
        self.wait_s = 0.0
        self.speculation = speculation
        self.speculated_layers = 0  # layers whose spectrum came from the speculation
        self.streams: Streams[Future[LayerResult]] | None = None
        self.reader = reader
        self._cuda = any(d.type == "cuda" for d in self.devices)  # host buffers page-locked
        # Each stream holds the layer it analyses and PREFETCH read ahead.
        self.buffers = None if reader is None else BufferPool(
            (PREFETCH + 1) * len(self.devices), pinned=self._cuda)
        self.copy_streams = {} if reader is None else {
            d: torch.cuda.Stream(d) for d in self.devices if d.type == "cuda"}
        self.host_solvers = host_solvers
        self.quantization = quantization or _stored
        self.host: HostSolvers | None = None
        self._remaining: list[float] = []  # solve units of layers from index i on

    def _speculated(self, spec: LayerSpec) -> Speculated | None:
        if self.speculation is None:
            return None
        return self.speculation.usable(spec, self.adapter, self.analysis)

    def _fetch(self, pool: ThreadPoolExecutor, spec: LayerSpec, device: torch.device
               ) -> Future[Staged]:
        """The layer's tensor, read ahead by `pool` and copied to `device` (staging); for a
        layer with a usable speculative spectrum a meta tensor of its shape and dtype (all
        the row needs): no read."""
        found, reader = self._speculated(spec), self.reader
        if self.quantization(spec.key)[1] is not None:  # refused: nothing to read
            return _ready(Staged(torch.empty(spec.shape, device="meta")))
        if found is None:
            if reader is None:
                return pool.submit(lambda: Staged(self.read(spec.key)))
            return pool.submit(stage, reader, spec.key, device, self.buffers,
                               self.copy_streams.get(device))
        return _ready(Staged(torch.empty(spec.shape, dtype=found.dtype, device="meta")))

    def _discard(self, staged: Staged) -> None:
        """A layer read ahead and never analysed (a stream stopped): free its host buffer."""
        if staged.buffer is not None and self.buffers is not None:
            self.buffers.release(staged.buffer)

    def _weight(self, spec: LayerSpec, tensor: torch.Tensor, device: torch.device, *,
                merge: bool) -> torch.Tensor:
        """The layer's weight on `device` in the work dtype, with its LoRA updates added
        there.

        Never modifies `tensor` in place: a .bin checkpoint hands out its (mapped) tensors,
        and a tied weight is read again for the next layer.
        """
        w = tensor.to(device, non_blocking=True).to(self.work_dtype)
        modules = self.adapter.merges.get(spec.key, ()) if merge else ()
        if modules and w.data_ptr() == tensor.data_ptr():
            w = w.clone()  # same device and dtype: .to() returned the checkpoint's tensor
        for module in modules:
            add_lora_(w, module, fan_in_fan_out=self.fan_in_fan_out)
        return w

    def _status(self, spec: LayerSpec, tensor: torch.Tensor, M: int, N: int) -> str | None:
        """Why the layer cannot be analysed, or None when it can."""
        if self.quantization(spec.key)[1] is not None:
            return "unsupported_quantization"
        # float8 is floating point to torch, but quantized values without their scales:
        # never analysed raw (esd_worker.analysis.quantized applies the scales).
        if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            return "unsupported_dtype"
        if tensor.dim() != (4 if spec.layer_type == CONV2D else 2):
            return "unsupported_shape"
        if min(M, N) < self.analysis.min_evals:
            return "too_small"
        return None

    def _check_fits(self, name: str, shape: Sequence[int], layer_type: str,
                    stored: torch.dtype, device: torch.device) -> None:
        capacity = self.capacity(device)
        if capacity is not None:
            check_fits(name, shape, layer_type, self.analysis.precision, stored, device,
                       capacity, model=self.model.ref)

    def analyse_layer(self, spec: LayerSpec, staged: Staged, device: torch.device
                      ) -> Future[LayerResult]:
        """The layer's row and spectrum: its device work done on `device` when this returns
        (thread-safe: one call per stream at a time, nothing shared is written), its host
        work (the fit; with host solvers perhaps the eigensolver) maybe still under way.
        Its host buffer is free again after; a host failure stops every stream."""
        try:
            result = self._layer(spec, take(staged), device)
        finally:
            self._discard(staged)
        result.add_done_callback(self._failed)
        return result

    def _failed(self, result: Future[LayerResult]) -> None:
        error = result.exception()
        if error is not None and self.streams is not None:
            self.streams.fail(error)

    def _layer(self, spec: LayerSpec, tensor: torch.Tensor, device: torch.device
               ) -> Future[LayerResult]:
        a = self.analysis
        # modules_to_save: the adapter's own full copy, which peft's merge leaves as saved.
        replaced = self.adapter.replaced.get(spec.name)
        tensor = tensor if replaced is None else replaced
        shape = tuple(tensor.shape)
        if len(shape) < 2:
            M, N = 0, 0
        elif spec.layer_type == "Conv1D":
            M, N = shape[1], shape[0]  # stored in x out
        else:
            M, N = shape[0], shape[1]
        row: dict[str, Any] = {
            "model_id": self.model.model_id,
            "revision": self.model.resolved_revision or self.model.revision or "",
            "layer": spec.name,
            "layer_type": spec.layer_type,
            "M": M,
            "N": N,
            "num_params": int(tensor.numel()),
            "fix_fingers": a.fix_fingers,
            "quantization": self.quantization(spec.key)[0],
        }
        status = self._status(spec, tensor, M, N)
        if status is not None:
            return _ready(LayerResult(row | _nan_metrics() | {"status": status}))
        host = self.host
        assert host is not None, "run() starts the host threads"
        found = self._speculated(spec)
        if found is not None:  # finite: the speculation skips non-finite tensors
            return host.finish(self._fitted, row, found.spectrum, True)
        self._check_fits(spec.name, shape, spec.layer_type, tensor.dtype, device)
        weight = self._weight(spec, tensor, device, merge=replaced is None)
        if not bool(torch.isfinite(weight).all()):
            return _ready(LayerResult(row | _nan_metrics() | {"status": "nonfinite_weights"}))
        g = gram_matrices(weight, spec.layer_type, precision=a.precision, conv_norm=a.conv_norm)
        del weight
        units = solve_units(shape, spec.layer_type == CONV2D)
        on_host = host.offer(g, units, self._left(), len(self.devices),
                             partial(self._host_fitted, row, g.M, g.N, g.max_dim))
        if on_host is not None:
            return on_host
        t = time.perf_counter()
        evals = sorted_evals(solve_gram(g.gram, fallback=g.mats))
        host.device_solved(units, time.perf_counter() - t)
        return host.finish(self._fitted, row, Spectrum(evals, g.M, g.N, g.max_dim), False)

    def _left(self) -> float:
        """Solve units of the layers no stream has taken yet."""
        taken = self.streams.claimed if self.streams is not None else 0
        return self._remaining[taken] if taken < len(self._remaining) else 0.0

    def _host_fitted(self, row: dict[str, Any], M: int, N: int, max_dim: int,
                     evals: np.ndarray) -> LayerResult:
        return self._fitted(row, Spectrum(evals, M, N, max_dim), False)

    def _fitted(self, row: dict[str, Any], spectrum: Spectrum, speculated: bool) -> LayerResult:
        """The layer's row with its fit (a host thread: the device is on the next layer)."""
        a = self.analysis
        metrics = layer_metrics(spectrum.evals, max_dim=spectrum.max_dim,
                                fix_fingers=a.fix_fingers, evals_thresh=a.evals_thresh,
                                bins=a.bins)
        return LayerResult(row | metrics, spectrum.evals, speculated=speculated)

    def check_memory(self) -> None:
        """Before any layer: every layer the devices will compute must fit the smallest of
        them (streams take any layer), so a model too big for its GPUs fails in a second,
        not after hours of analysis with its lm_head last. Each layer is checked again
        with its real tensor before it is computed (analyse_layer)."""
        bounded = [(c, d) for d in self.devices if (c := self.capacity(d)) is not None]
        if not bounded or self.stored_dtype is None:
            return
        _, device = min(bounded, key=lambda cd: cd[0])
        rank = {CONV2D: 4}
        for spec in self.layer_map.layers:
            stored = self.stored_dtype(spec.key)
            if (stored is None or len(spec.shape) != rank.get(spec.layer_type, 2)
                    or self.quantization(spec.key)[1] is not None
                    or min(spec.shape[:2]) < self.analysis.min_evals
                    or spec.name in self.adapter.replaced or self._speculated(spec)):
                continue  # a status row, the adapter's own copy, or no device work
            self._check_fits(spec.name, spec.shape, spec.layer_type, stored, device)

    def run(self, progress: Callable[[int], None] | None = None) -> None:
        self.check_memory()
        units = [0.0 if self._speculated(spec) else solve_units(spec.shape,
                                                                spec.layer_type == CONV2D)
                 for spec in self.layer_map.layers]
        self._remaining = list(accumulate(reversed(units)))[::-1]
        self.host = HostSolvers(self.host_solvers, pinned=self._cuda)
        self.streams = Streams(self.layer_map.layers, self.devices, fetch=self._fetch,
                               analyse=self.analyse_layer, discard=self._discard,
                               label=self.model.ref, progress=progress)
        try:
            pending = self.streams.run()
            results = [future.result() for future in pending]
        finally:
            self.host.close()
        self.wait_s = self.streams.wait_s
        for spec, result in zip(self.layer_map.layers, results, strict=True):
            self.rows.append(result.row)
            if result.evals is not None:
                self.eigs[spec.name] = result.evals
            self.speculated_layers += result.speculated


def _ready(value: T) -> Future[T]:
    """A future that has `value` already (work that needed no thread)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future
