"""Which GPUs are free, read from NVML (nvidia-ml-py), among those an inherited
CUDA_VISIBLE_DEVICES allows (parsed in controller.gpu.allocation); it does not start or watch
workers."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.errors import InfrastructureError, SweepError
from controller.gpu.allocation import VARIABLE, Allocation, needs_uuids, parse_visible_devices
from esd_worker.core.command.flags import MAX_GPUS, float_in, int_in

log = logging.getLogger(__name__)

_MIB = float(2**20)
MAX_CHECKS = 10**6  # --max-checks: at a poll a second, eleven days of waiting
# The flags' types (run and doctor): a threshold above 10 TiB, or a GPU index past 1023,
# is no GPU's.
GPU_MEM_THRESHOLD_MIB = float_in(0, 10**7, above=True, unit="MiB")
GPU_INDEX = int_in(0, MAX_GPUS - 1)


class NvmlUnavailable(Exception):
    """NVML cannot be used: bindings missing, no driver, or a device could not be read."""


class Nvml:
    """Thin adapter over pynvml: device count, and per device used and total memory, UUID and
    name; errors wrapped.

    `module` is the pynvml module (imported lazily when None); tests pass a fake with the same
    functions. Raises NvmlUnavailable when the bindings or the driver are missing.
    """

    def __init__(self, module: Any | None = None) -> None:
        if module is None:
            module = _import_pynvml()
        self._nvml: Any = module
        try:
            module.nvmlInit()
        except (module.NVMLError, OSError) as e:
            raise NvmlUnavailable(f"NVML could not start (no NVIDIA driver?): {e}") from e
        self._handles: dict[int, Any] = {}
        # The v2 struct leaves out memory the driver reserves for itself (hundreds of MiB on
        # recent drivers), which v1 counts as used and which would make idle GPUs look busy.
        self._v2: int | None = getattr(module, "nvmlMemory_v2", None)
        self._closed = False

    def device_count(self) -> int:
        """Number of GPUs NVML sees (NVML indices, i.e. PCI bus order)."""
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except self._nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not count the GPUs: {e}") from e

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            handle = self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return handle

    def _memory(self, index: int) -> Any:
        nvml = self._nvml
        try:
            handle = self._handle(index)
            if self._v2 is not None:
                try:
                    return nvml.nvmlDeviceGetMemoryInfo(handle, version=self._v2)
                except (nvml.NVMLError, TypeError):
                    # An older driver (no _v2 entry point) or bindings without `version`.
                    self._v2 = None
            return nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not read GPU {index}: {e}") from e

    def used_mib(self, index: int) -> float:
        """Memory in use on GPU `index`, MiB (all processes, ours and other users')."""
        return float(self._memory(index).used) / _MIB

    def total_mib(self, index: int) -> float:
        """GPU `index`'s memory, MiB (from the same call as used_mib)."""
        return float(self._memory(index).total) / _MIB

    def uuid(self, index: int) -> str:
        """GPU `index`'s UUID as nvidia-smi prints it ("GPU-8932f937-d72c-…")."""
        return self._text(index, "nvmlDeviceGetUUID", "UUID")

    def name(self, index: int) -> str:
        """GPU `index`'s product name ("NVIDIA H100 80GB HBM3")."""
        return self._text(index, "nvmlDeviceGetName", "name")

    def _text(self, index: int, function: str, what: str) -> str:
        try:
            text = getattr(self._nvml, function)(self._handle(index))
        except self._nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not read GPU {index}'s {what}: {e}") from e
        # Current bindings return str, older ones bytes.
        return text.decode() if isinstance(text, bytes) else str(text)

    def close(self) -> None:
        """Shut NVML down (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as e:
            log.debug("nvmlShutdown failed: %s", e)


def _import_pynvml() -> Any:
    try:
        import pynvml  # lazily: the controller imports without the bindings
    except ImportError as e:
        raise NvmlUnavailable(
            "the NVML bindings are not installed (pip install nvidia-ml-py)"
        ) from e
    return pynvml


def open_nvml(module: Any | None = None) -> Nvml | None:
    """NVML when a driver and at least one GPU are there; None (with one INFO line) otherwise."""
    try:
        nvml = Nvml(module)
    except NvmlUnavailable as e:
        log.info("no GPU: %s", e)
        return None
    try:
        count = nvml.device_count()
    except NvmlUnavailable as e:
        nvml.close()
        log.info("no GPU: %s", e)
        return None
    if count < 1:
        nvml.close()
        log.info("no GPU: NVML runs but sees no device")
        return None
    return nvml


def inherited_allocation(
    nvml: Nvml, environ: Mapping[str, str] | None = None
) -> Allocation | None:
    """The GPUs an inherited CUDA_VISIBLE_DEVICES allows, as NVML indices; None when unset.

    `environ` defaults to os.environ. Decimal entries are NVML indices (PCI bus order, as
    SLURM and nvidia-smi number GPUs); UUIDs and unique UUID prefixes are matched against
    NVML's, read only when the value has one. See controller.gpu.allocation for CUDA's rules.
    Raises SweepError for MIG entries, NvmlUnavailable when a needed UUID cannot be read.
    """
    value = (os.environ if environ is None else environ).get(VARIABLE)
    if value is None:
        return None
    count = nvml.device_count()
    with_uuids = needs_uuids(value)
    gpus = [(i, nvml.uuid(i) if with_uuids else "") for i in range(count)]
    return parse_visible_devices(value, gpus)


@dataclass(frozen=True)
class GpuSettings:
    """When a GPU counts as free and how many a job takes (the old gputracker's flags).

    threshold_mib: a GPU is free while its used memory is below this, MiB (default 500).
    max_checks: consecutive polls under the threshold before a GPU is handed out (default 10).
    poll_interval_s: seconds between polls while work waits for a GPU (default 1.0).
    gpu_list: GPUs to use, in order of preference (default: all GPUs this job may use).
        NVML indices, as nvidia-smi prints them, whatever CUDA_VISIBLE_DEVICES says; with an
        inherited CUDA_VISIBLE_DEVICES they select within the GPUs it allows, and a GPU
        outside them is an error.
    max_gpus: at most this many GPUs in use by this sweep at the same time (default: no cap).
        Any of the managed GPUs may be among them, so GPUs busy with other users' jobs
        do not count against the cap.
    gpus_per_job: GPUs each worker gets, all free at the same time (default 1).
    """

    threshold_mib: float = 500
    max_checks: int = 10
    poll_interval_s: float = 1.0
    gpu_list: tuple[int, ...] | None = None
    max_gpus: int | None = None
    gpus_per_job: int = 1

    def validate(self) -> None:
        """Raise one ValueError that names every bad field."""
        problems: list[str] = []
        if not (self.threshold_mib > 0 and math.isfinite(self.threshold_mib)):
            problems.append(f"threshold_mib: must be > 0 MiB, got {self.threshold_mib}")
        if self.max_checks < 1:
            problems.append(f"max_checks: must be >= 1, got {self.max_checks}")
        if not (self.poll_interval_s > 0 and math.isfinite(self.poll_interval_s)):
            problems.append(f"poll_interval_s: must be > 0 s, got {self.poll_interval_s}")
        if self.gpu_list is not None:
            if not self.gpu_list:
                problems.append("gpu_list: must name at least one GPU (or be left out for all)")
            negative = [i for i in self.gpu_list if i < 0]
            if negative:
                problems.append(f"gpu_list: GPU indices must be >= 0, got {negative}")
            repeated = sorted({i for i in self.gpu_list if self.gpu_list.count(i) > 1})
            if repeated:
                problems.append(f"gpu_list: GPU(s) named more than once: {repeated}")
        if self.max_gpus is not None and self.max_gpus < 1:
            problems.append(f"max_gpus: must be >= 1, got {self.max_gpus}")
        if self.gpus_per_job < 1:
            problems.append(f"gpus_per_job: must be >= 1, got {self.gpus_per_job}")
        else:
            if self.max_gpus is not None and 1 <= self.max_gpus < self.gpus_per_job:
                problems.append(
                    f"gpus_per_job: {self.gpus_per_job} is more than max_gpus {self.max_gpus}"
                )
            if self.gpu_list and self.gpus_per_job > len(set(self.gpu_list)):
                problems.append(
                    f"gpus_per_job: {self.gpus_per_job} is more than the "
                    f"{len(set(self.gpu_list))} GPU(s) in gpu_list"
                )
        if problems:
            raise ValueError("invalid GPU settings: " + "; ".join(problems))


@dataclass(frozen=True)
class GpuState:
    """One managed GPU as last polled: used memory (MiB), consecutive free polls, ours or not."""

    index: int
    used_mib: float
    free_checks: int
    taken: bool


@dataclass
class _Gpu:
    index: int
    used_mib: float = math.nan
    free_checks: int = 0
    taken: bool = False
    # Free polls needed before handing this GPU out: max_checks, or 1 right after our own
    # worker released it.
    needed: int = 1
    # Polls over the threshold still tolerated after a release before the fast path ends.
    settle_left: int = 0
    # When our worker released it (monotonic s): the fast path lasts max_checks polls' time.
    released_at: float = -math.inf
    read_error: bool = False


class GpuTracker:
    """Hands out GPUs that have stayed free, and keeps the ones our workers hold.

    Rules (the old gputracker's, kept):
    - A GPU counts as free when its used memory stays under `threshold_mib` for
      `max_checks` consecutive polls; one reading at or over the threshold (another user's
      process) sets its count back to 0.
    - `acquire` hands out GPUs that are not taken and free long enough, in `gpu_list` order,
      all `n` at once or none. A taken GPU stays taken until `release`, whatever its memory
      says: our own worker's memory neither makes it look busy forever nor lets a second
      job onto it.
    - After `release` the count restarts at 0, but the GPU needs only ONE fresh poll under
      the threshold: we know it was busy because of our own worker, and waiting `max_checks`
      polls per model would be pure dispatch overhead. Readings over the threshold during
      the next `max_checks` polls are taken as the exited worker's memory still being freed;
      if the GPU stays over the threshold that long, or goes over it after having been seen
      free again, it is busy for other reasons and needs `max_checks` polls again.
    - A GPU NVML cannot read counts as busy (with one warning) until it can be read again.
    - `max_gpus` caps how many GPUs are taken at the same time, not which ones.
    - Only the managed GPUs (`gpus`) are ever read or handed out: `allocation`'s (an
      inherited CUDA_VISIBLE_DEVICES, in its order) or else all NVML sees, narrowed to
      `gpu_list` (its order) when one is given; a `gpu_list` GPU outside them is an error.
    """

    def __init__(
        self, nvml: Nvml, settings: GpuSettings, allocation: Allocation | None = None
    ) -> None:
        settings.validate()
        count = nvml.device_count()
        if allocation is not None:
            allowed = allocation.indices
            if not allowed:
                raise ValueError(f"{allocation.describe()} leaves no GPU to use")
        else:
            allowed = tuple(range(count))
        if settings.gpu_list is not None:
            outside = [i for i in settings.gpu_list if i not in allowed]
            if outside and allocation is not None:
                raise ValueError(
                    f"gpu_list: GPU(s) {outside} are outside this job's GPUs: "
                    f"{allocation.describe()} allows NVML indices "
                    f"{','.join(map(str, allowed))}"
                )
            if outside:
                raise ValueError(
                    f"gpu_list: GPU(s) {outside} do not exist; NVML sees {count} GPU(s) "
                    f"(indices 0..{count - 1})"
                )
            indices = tuple(settings.gpu_list)
        else:
            indices = allowed
        self.nvml = nvml
        self.settings = settings
        self.allocation = allocation
        self.gpus: tuple[int, ...] = indices
        self._state = {i: _Gpu(i, needed=settings.max_checks) for i in indices}

    @property
    def capacity(self) -> int:
        """Most GPUs this sweep may hold at once (managed GPUs, capped at max_gpus)."""
        cap = self.settings.max_gpus
        return len(self.gpus) if cap is None else min(cap, len(self.gpus))

    def poll(self) -> None:
        """Read every managed GPU once and update its consecutive-free count."""
        threshold = self.settings.threshold_mib
        now = time.monotonic()
        window = self.settings.max_checks * self.settings.poll_interval_s
        for gpu in self._state.values():
            try:
                used = self.nvml.used_mib(gpu.index)
            except NvmlUnavailable as e:
                if not gpu.read_error:
                    log.warning("gpu=%d cannot be read, treated as busy: %s", gpu.index, e)
                gpu.read_error = True
                gpu.used_mib = math.nan
                gpu.free_checks = 0
                gpu.needed = self.settings.max_checks
                continue
            if gpu.read_error:
                log.info("gpu=%d can be read again", gpu.index)
                gpu.read_error = False
            gpu.used_mib = used
            if gpu.taken:
                continue
            if gpu.needed < self.settings.max_checks and now - gpu.released_at > window:
                # Released long ago: whatever uses it now is not our exited worker.
                gpu.needed = self.settings.max_checks
            if used < threshold:
                gpu.free_checks += 1
                continue
            if gpu.needed < self.settings.max_checks:
                gpu.settle_left -= 1
                if gpu.free_checks > 0 or gpu.settle_left <= 0:
                    gpu.needed = self.settings.max_checks
            gpu.free_checks = 0

    def acquire(self, n: int) -> tuple[int, ...] | None:
        """Take `n` GPUs that are free long enough (gpu_list order); None if not enough now."""
        if n < 1:
            raise ValueError(f"acquire: n must be >= 1, got {n}")
        if n > self.capacity:
            raise ValueError(
                f"acquire: {n} GPU(s) per job can never be free at once: "
                f"{self.capacity} GPU(s) usable ({len(self.gpus)} managed, "
                f"max_gpus={self.settings.max_gpus})"
            )
        held = sum(1 for g in self._state.values() if g.taken)
        if held + n > self.capacity:
            return None
        ready = [
            g for g in self._state.values()
            if not g.taken and not g.read_error and g.free_checks >= g.needed
        ]
        if len(ready) < n:
            return None
        chosen = ready[:n]
        for gpu in chosen:
            gpu.taken = True
            gpu.free_checks = 0
        return tuple(g.index for g in chosen)

    def release(self, gpus: Sequence[int]) -> None:
        """Give back GPUs whose worker has exited; each needs one fresh free poll."""
        for index in gpus:
            gpu = self._state.get(index)
            if gpu is None or not gpu.taken:
                raise ValueError(f"release: GPU {index} is not held by this tracker")
            gpu.taken = False
            gpu.free_checks = 0
            gpu.needed = 1
            gpu.settle_left = self.settings.max_checks
            gpu.released_at = time.monotonic()

    def snapshot(self) -> tuple[GpuState, ...]:
        """Every managed GPU as last polled, in gpu_list order."""
        return tuple(
            GpuState(index=g.index, used_mib=g.used_mib, free_checks=g.free_checks, taken=g.taken)
            for g in self._state.values()
        )


def open_tracker(
    device: str,
    settings: GpuSettings,
    cpu_workers: int,
    *,
    environ: Mapping[str, str] | None = None,
    module: Any | None = None,
) -> GpuTracker | None:
    """A GPU tracker, or None for CPU mode (device "cpu", or "auto" and no GPU visible).

    The tracker manages only the GPUs an inherited CUDA_VISIBLE_DEVICES allows (environ:
    default os.environ; module: pynvml or a fake). device "cuda" without a GPU (none found, or
    none allowed) is an InfrastructureError; settings that cannot be satisfied (a GPU that
    does not exist or is outside the allocation, a MIG allocation) a SweepError.
    """
    if device == "cpu":
        log.info("device=cpu: running %d CPU worker(s) at a time", cpu_workers)
        return None
    nvml = open_nvml(module)
    if nvml is None:
        if device == "cuda":
            raise InfrastructureError(
                "--device cuda asked for, but NVML finds no GPU (driver missing?): "
                "use --device cpu to run on the CPU"
            )
        log.info("no GPU found: running on the CPU with %d worker(s) at a time "
                 "(--cpu-workers)", cpu_workers)
        return None
    try:
        tracker = _tracker_in_allocation(nvml, device, settings, cpu_workers, environ)
    except BaseException:
        nvml.close()
        raise
    if tracker is None:
        nvml.close()
        return None
    where = f" ({tracker.allocation.describe(short=True)})" if tracker.allocation else ""
    # How many GPUs each model gets is the backend's (controller.gpu.gpurule), not the tracker's.
    log.info("GPUs %s managed%s: free after %d checks under %g MiB",
             ",".join(map(str, tracker.gpus)), where, settings.max_checks,
             settings.threshold_mib)
    return tracker


def _tracker_in_allocation(
    nvml: Nvml, device: str, settings: GpuSettings, cpu_workers: int,
    environ: Mapping[str, str] | None,
) -> GpuTracker | None:
    try:
        allocation = inherited_allocation(nvml, environ)
    except NvmlUnavailable as e:
        raise InfrastructureError(
            f"cannot match {VARIABLE} to the GPUs NVML sees: {e}"
        ) from e
    if allocation is not None:
        for line in allocation.warnings():
            log.warning("%s", line)
        if not allocation.indices:
            if device == "cuda":
                raise InfrastructureError(
                    f"--device cuda asked for, but {allocation.describe()} leaves no GPU "
                    f"visible: run inside a GPU allocation, or use --device cpu"
                )
            log.info("%s leaves no GPU visible: running on the CPU with %d worker(s) at a "
                     "time (--cpu-workers)", allocation.describe(), cpu_workers)
            return None
    try:
        return GpuTracker(nvml, settings, allocation)
    except ValueError as e:
        raise SweepError(str(e)) from e
