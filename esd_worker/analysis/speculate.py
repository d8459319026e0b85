"""Speculative spectra: eigenvalues of likely layers computed while the layer map is discovered.

Discovery (esd_worker.analysis.layers.discover_layers) imports transformers and builds a meta model:
seconds of Python that leave the device idle. Meanwhile the safetensors headers already say
which tensors can be layers: floating-point 2-D tensors (Linear, Conv1D, …) and 4-D ones
(Conv2d) whose smaller side is at least --min-evals. A `Speculation` computes their spectra
in a background thread, in checkpoint order, until discovery ends; torch's kernels release
the GIL, so the two overlap. The analysis then takes a speculative spectrum for a layer only
where it is the spectrum the normal path would compute, bit for bit (`Speculation.usable`):
same key, no LoRA update merged into it, not replaced by the adapter, a rank matching the
layer type, same precision and conv_norm. A 2-D tensor is computed as a Linear layer: a
Conv1D (stored in x out) or an Embedding gives the very same bits (spectra.compute_spectrum
diagonalises the stored layout), only its M/N labels differ, and those come from the row.

Memory: one tensor at a time, dropped after its spectrum; only eigenvalue arrays are kept.
A non-finite tensor is skipped (the normal path reports it as nonfinite_weights), and so is
any tensor whose speculation fails: the normal path redoes it and reports what happens.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from esd_worker.analysis.adapters import AdapterMatch
from esd_worker.analysis.layers import CONV2D, LINEAR, LayerSpec
from esd_worker.analysis.spectra import Spectrum, compute_spectrum, work_dtype
from esd_worker.analysis.weights import Tensors, float_dtype
from esd_worker.core.command.settings import AnalysisSettings

log = logging.getLogger(__name__)

# Analysed only with --include-embeddings; the largest matrices of a language model, so not
# worth guessing at otherwise. (A tied lm_head is read from the embedding: normal path.)
_EMBEDDING_NAME = re.compile(r"(embed|wte|wpe)", re.IGNORECASE)


SPECULATE_MODES = ("auto", "off", "on", "complete")


def speculation_mode(requested: str, device: torch.device) -> str:
    """off, on or complete (see Speculation) for a requested mode.

    auto: on with a GPU (the kernels run there, the host thread mostly waits). On a CPU only
    when a core is left over beside torch's threads for discovery's Python: measured on
    the 2-core development machine with all-MiniLM-L6-v2, 2 torch threads made the run
    slower (discovery starved of its core: 3.0 s -> 3.3 s), 1 thread faster (3.4 s -> 3.0 s).
    """
    if requested not in SPECULATE_MODES:
        raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}: {requested!r}")
    if requested != "auto":
        return requested
    if device.type != "cpu":
        return "on"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return "on" if cores > torch.get_num_threads() else "off"


def candidate_keys(ckpt: Tensors, analysis: AnalysisSettings) -> list[str]:
    """Checkpoint keys, in checkpoint order, that discovery will likely map to analysable
    layers, judged from the headers alone (no model, no tensor read)."""
    keys = []
    for key in ckpt.keys():  # noqa: SIM118 - Checkpoint is not a Mapping
        shape = ckpt.shape(key)
        if len(shape) not in (2, 4) or float_dtype(ckpt.dtype(key)) is None:
            continue
        if min(shape[0], shape[1]) < analysis.min_evals:
            continue  # too_small: the normal path reports it without any linear algebra
        if not analysis.include_embeddings and _EMBEDDING_NAME.search(key):
            continue
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Speculated:
    """A tensor's speculative spectrum, with what it was computed from."""

    spectrum: Spectrum
    rank: int
    dtype: torch.dtype
    precision: str
    conv_norm: float


class Speculation:
    """Spectra of `keys` computed in a background thread from `start()` until `stop()`.

    Use as a context manager around discovery; leaving it stops the speculation: the
    tensor in progress finishes and everything computed is kept. complete=True waits for
    every candidate instead (tests: every candidate layer then takes its speculative
    spectrum, whatever the timing).
    """

    def __init__(
        self,
        read: Callable[[str], torch.Tensor],
        keys: list[str],
        analysis: AnalysisSettings,
        device: torch.device,
        *,
        complete: bool = False,
    ) -> None:
        self._read = read
        self._complete = complete
        self._keys = keys
        self._precision = analysis.precision
        self._conv_norm = analysis.conv_norm
        self._device = device
        self._dtype = work_dtype(analysis.precision)
        # The kernels must run as the normal path's do (same thread count: a GEMM split
        # differently over threads can round differently), whatever this thread inherits.
        self._threads = torch.get_num_threads()
        self._stopping = threading.Event()
        # Not a daemon: a signal's exception (cli: SIGTERM raises Terminated) can interrupt
        # the join in stop(), and a daemon thread still inside torch when the interpreter
        # exits aborts the process; a normal thread is joined at exit, and having been told
        # to stop it ends after the tensor in progress.
        self._thread = threading.Thread(target=self._run, name="esd-speculate")
        self.done: dict[str, Speculated] = {}
        self.busy_s = 0.0

    def __enter__(self) -> Speculation:
        try:
            self._thread.start()
        except BaseException:  # interrupted (a signal) after the thread may have started
            self._stopping.set()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._complete:
            self._stopping.set()
        try:
            if self._thread.is_alive():
                self._thread.join()
        except BaseException:  # a signal while waiting: do not leave it running on
            self._stopping.set()
            raise

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        t0 = time.perf_counter()
        for key in self._keys:
            if self._stopping.is_set():
                break
            try:
                found = self._one(key)
            except Exception as e:  # any failure: the normal path redoes the tensor and reports
                log.debug("speculation stopped at %s: %s", key, e)
                break
            if found is not None:
                self.done[key] = found
        self.busy_s = time.perf_counter() - t0
        log.info("speculation: %d of %d candidate tensors in %.2fs",
                 len(self.done), len(self._keys), self.busy_s)

    def _one(self, key: str) -> Speculated | None:
        tensor = self._read(key)
        # As _Analysis._weight converts it (no LoRA update: usable() refuses merged keys).
        weight = tensor.to(self._device, non_blocking=True).to(self._dtype)
        if not bool(torch.isfinite(weight).all()):
            return None  # the normal path writes the nonfinite_weights row
        layer_type = CONV2D if weight.dim() == 4 else LINEAR
        spectrum = compute_spectrum(
            weight, layer_type, precision=self._precision, conv_norm=self._conv_norm
        )
        return Speculated(spectrum, tensor.dim(), tensor.dtype, self._precision, self._conv_norm)

    def usable(
        self, spec: LayerSpec, adapter: AdapterMatch, analysis: AnalysisSettings
    ) -> Speculated | None:
        """The speculative spectrum of `spec` when it is exactly what the normal path would
        compute, else None."""
        found = self.done.get(spec.key)
        if found is None or spec.key in adapter.merges or spec.name in adapter.replaced:
            return None
        if found.rank != (4 if spec.layer_type == CONV2D else 2):
            return None
        if (found.precision, found.conv_norm) != (analysis.precision, analysis.conv_norm):
            return None
        return found
