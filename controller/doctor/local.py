"""`esd-sweep doctor`'s checks of this machine: the GPUs NVML sees, and a worker on one.

Owns two checks, both read with the local sweep's own rules:

- gpus: every GPU NVML sees (name, memory, used, free under --gpu-mem-threshold) and the
  ones a sweep would use: an inherited CUDA_VISIBLE_DEVICES's, narrowed by --gpu-list
  (controller.gpu.gpus.inherited_allocation and GpuTracker decide, as for a sweep);
- worker: `esd-worker --self-check` (esd_worker.serve.selfcheck) started as the local backend
  starts a worker (the same command, the environment of controller.backends.local.process
  .worker_env: CUDA_VISIBLE_DEVICES = the GPU's NVML index, CUDA_DEVICE_ORDER=PCI_BUS_ID,
  and the same --device), on the GPU a sweep would hand out first, or on the CPU. With a GPU
  the worker must report cuda:0 and that GPU's name: a worker on the CPU is the old scripts'
  silent fallback (a CPU-only torch) and fails, with what to install.

No GPU is a failure only with --device cuda: --device auto runs sweeps on the CPU then.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.backends.local.process import die_with_parent, signal_group, worker_env
from controller.doctor.checks import FAIL, INFO, PASS, SKIP, Check
from controller.errors import SweepError
from controller.gpu.gpus import GpuSettings, GpuTracker, Nvml, NvmlUnavailable, inherited_allocation
from controller.settings import SweepSettings
from esd_worker.core.command.invocation import SELF_CHECK, WorkerInvocation
from esd_worker.core.redact import redact

WORKER_TIMEOUT_S = 120.0
_TAIL_LINES = 5
TORCH_CUDA_FIX = ("install the CUDA build of torch: pip install 'torch=={version}' "
                  "--index-url https://download.pytorch.org/whl/cuXYZ, XYZ a CUDA version "
                  "the NVIDIA driver supports (nvidia-smi shows the highest)")


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML read it once: index (NVML), name, UUID, memory in MiB (NaN when it
    could not be read), and whether it is free under the threshold."""

    index: int
    name: str
    uuid: str
    total_mib: float
    used_mib: float
    free: bool
    error: str = ""

    def describe(self, threshold_mib: float) -> str:
        if self.error:
            return f"{self.index} (unreadable, counted busy: {self.error})"
        state = "free" if self.free else f"busy, ≥ {threshold_mib:g} MiB"
        return (f"{self.index} {self.name} ({self.total_mib:.0f} MiB, {self.used_mib:.0f} MiB "
                f"used, {state})")


@dataclass(frozen=True)
class GpuView:
    """The GPUs a sweep would use, in its order (`gpus`), as read by the gpus check."""

    gpus: tuple[Gpu, ...]

    def pick(self) -> Gpu | None:
        """The GPU a sweep would hand out first: the first free one, else the first."""
        return next((g for g in self.gpus if g.free), self.gpus[0] if self.gpus else None)


# -- gpus ----------------------------------------------------------------------------------


def check_gpus(
    device: str, settings: GpuSettings, *, environ: Mapping[str, str],
    module: Any | None = None,
) -> tuple[Check, GpuView | None]:
    """The gpus check and the GPUs a sweep would use (None: it would use none).

    module: the pynvml module, or a fake with its functions (tests); None imports pynvml.
    """
    if device == "cpu":
        return Check("gpus", SKIP, "not used: --device cpu runs every worker on the CPU"), None
    try:
        nvml = Nvml(module)
    except NvmlUnavailable as e:
        return _no_gpu(device, str(e)), None
    try:
        return _read_gpus(nvml, device, settings, environ)
    finally:
        nvml.close()


def _read_gpus(nvml: Nvml, device: str, settings: GpuSettings,
               environ: Mapping[str, str]) -> tuple[Check, GpuView | None]:
    try:
        count = nvml.device_count()
    except NvmlUnavailable as e:
        return _no_gpu(device, str(e)), None
    if count < 1:
        return _no_gpu(device, "NVML runs but sees no GPU"), None
    seen = [_read_gpu(nvml, i, settings.threshold_mib) for i in range(count)]
    listing = (f"NVML sees {count} GPU(s): "
               + ", ".join(g.describe(settings.threshold_mib) for g in seen))
    try:
        allocation = inherited_allocation(nvml, environ)
    except (SweepError, NvmlUnavailable) as e:
        return Check("gpus", FAIL, f"{listing}; {e}",
                     "give whole GPUs (indices or GPU- UUIDs) in CUDA_VISIBLE_DEVICES, or "
                     "unset it"), None
    if allocation is not None:
        listing = "; ".join([
            listing, f"{allocation.describe()} allows "
            + (",".join(map(str, allocation.indices)) or "none"), *allocation.warnings()])
        if not allocation.indices:
            return _no_gpu(device, listing), None
    try:
        managed = GpuTracker(nvml, settings, allocation).gpus
    except ValueError as e:
        return Check("gpus", FAIL, f"{listing}; {e}",
                     "give --gpu-list GPUs from the ones listed (NVML indices)"), None
    view = GpuView(tuple(seen[i] for i in managed))
    free = [g.index for g in view.gpus if g.free]
    summary = (f"a sweep uses GPU(s) {','.join(map(str, managed))}: "
               + (f"{len(free)} free now" if free else
                  f"none free now (a sweep waits until one stays under "
                  f"{settings.threshold_mib:g} MiB)"))
    return Check("gpus", PASS, f"{listing}; {summary}"), view


def _read_gpu(nvml: Nvml, index: int, threshold_mib: float) -> Gpu:
    try:
        used = nvml.used_mib(index)
        return Gpu(index, nvml.name(index), nvml.uuid(index), nvml.total_mib(index), used,
                   used < threshold_mib)
    except NvmlUnavailable as e:
        return Gpu(index, "?", "", math.nan, math.nan, False, str(e))


def _no_gpu(device: str, why: str) -> Check:
    """No GPU for the sweep: a failure with --device cuda, else sweeps run on the CPU."""
    if device != "cuda":
        return Check("gpus", INFO, f"no GPU ({why}): sweeps run on the CPU (--device auto)")
    if "not installed" in why:
        fix = "pip install nvidia-ml-py (the NVML bindings), or use --device cpu"
    elif "could not start" in why:
        fix = ("install or load the NVIDIA driver (nvidia-smi must list the GPUs), or use "
               "--device cpu")
    else:
        fix = "run where GPUs are visible (nvidia-smi lists them), or use --device cpu"
    return Check("gpus", FAIL, f"--device cuda needs a GPU: {why}", fix)


# -- worker --------------------------------------------------------------------------------


def check_worker(
    device: str, view: GpuView | None, *, timeout_s: float = WORKER_TIMEOUT_S,
    worker_cmd: Sequence[str] | None = None,
) -> Check:
    """Start `esd-worker --self-check` as a sweep starts a worker and judge its report."""
    gpu = view.pick() if view is not None else None
    if gpu is None and device == "cuda":
        return Check("worker", SKIP, "not started: with --device cuda a sweep starts no "
                     "worker without a GPU (see gpus)")
    command = tuple(worker_cmd or SweepSettings(output="").worker_cmd)
    # What the local backend passes: cuda when it hands out GPUs, cpu otherwise.
    argv = WorkerInvocation(SELF_CHECK, device="cuda" if gpu else "cpu",
                            log_format="text").command(command)
    gpus = (gpu.index,) if gpu else ()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=worker_env(gpus, None, {}), start_new_session=True,
            preexec_fn=die_with_parent(), text=True, errors="replace")
    except OSError as e:
        return Check("worker", FAIL, f"cannot start the worker ({argv[0]}): {e}",
                     "install the worker: pip install 'esd-sweep[worker]'")
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.communicate()
        where = f"CUDA_VISIBLE_DEVICES={gpu.index} " if gpu else ""
        return Check("worker", FAIL, f"the worker's self-check did not finish in "
                     f"{timeout_s:g} s (killed)", f"run `{where}esd-worker --self-check "
                     f"--device {'cuda' if gpu else 'cpu'} -v` to see where it hangs")
    return judge_worker(_report(stdout), proc.returncode, _tail(stderr), gpu)


def _report(stdout: str) -> dict[str, Any] | None:
    """The self-check's JSON line: the last stdout line that is one."""
    for line in reversed(stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("selfcheck"):
            return doc
    return None


def _tail(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return redact(" | ".join(lines[-_TAIL_LINES:]))


def judge_worker(report: dict[str, Any] | None, returncode: int, stderr_tail: str,
                 gpu: Gpu | None) -> Check:
    """The worker check from the self-check's report (None: it printed none), its exit
    status, its last stderr lines and the GPU it was given (None: the CPU)."""
    if report is None:
        return Check("worker", FAIL, f"the worker exited {returncode} without a self-check "
                     f"report: {stderr_tail or 'no output'}",
                     "install the worker's dependencies: pip install 'esd-sweep[worker]'")
    facts = _facts(report)
    used = report.get("device")
    if gpu is None:
        if used == "cpu" and report.get("ok"):
            return Check("worker", PASS, f"cpu ({report.get('device_name')}, "
                         f"{report.get('threads')} threads): {_numbers(report)}; {facts}")
        return Check("worker", FAIL, f"the self-check failed on the CPU: "
                     f"{report.get('error') or stderr_tail}; {facts}",
                     "reinstall the worker's dependencies: pip install 'esd-sweep[worker]'")
    given = f"GPU {gpu.index} ({gpu.name}{', free' if gpu.free else ''})"
    if used != "cuda:0":
        return _cpu_fallback(report, given, facts)
    if not report.get("ok"):
        return Check("worker", FAIL, f"on cuda:0 = {given}: {report.get('error')}; {facts}",
                     "update the NVIDIA driver and torch, then check the GPU (nvidia-smi -q)")
    if not _same_gpu(report, gpu):
        return Check("worker", FAIL, f"the worker's cuda:0 is {report.get('device_name')} "
                     f"({report.get('device_uuid')}), not {given} ({gpu.uuid}); {facts}",
                     "keep CUDA_DEVICE_ORDER=PCI_BUS_ID (the sweep sets it) and check that "
                     "nothing in the worker's environment renumbers the GPUs")
    return Check("worker", PASS, f"cuda:0 = {given}, CUDA_VISIBLE_DEVICES={gpu.index}: "
                 f"{_numbers(report)}; {facts}")


def _cpu_fallback(report: dict[str, Any], given: str, facts: str) -> Check:
    """The worker did not use the GPU it was given: say why, from what torch reported."""
    base = str(report.get("torch") or "").split("+")[0] or "<version>"
    what = f"the worker ran on the CPU although it was given {given}"
    if report.get("device") is None:
        what = f"the worker could not use {given}"
    if report.get("torch_cuda") is None:
        return Check("worker", FAIL, f"{what}: torch {report.get('torch')} is a CPU-only "
                     f"build (torch.version.cuda is None); {facts}",
                     TORCH_CUDA_FIX.format(version=base))
    if not report.get("cuda_available"):
        cuda = report.get("torch_cuda")
        return Check("worker", FAIL, f"{what}: torch {report.get('torch')} is built for "
                     f"CUDA {cuda} but torch.cuda.is_available() is False; {facts}",
                     f"install an NVIDIA driver that supports CUDA {cuda} (nvidia-smi shows "
                     "the highest it supports), or a torch build for the driver's CUDA")
    return Check("worker", FAIL, f"{what}: {report.get('error') or 'it chose the CPU'}; "
                 f"{facts}", "run `esd-worker --self-check --device cuda -v` on that GPU "
                 "and read its log")


def _same_gpu(report: dict[str, Any], gpu: Gpu) -> bool:
    """Whether the worker's cuda:0 is `gpu`: by UUID when both are known, else by name."""
    seen = str(report.get("device_uuid") or "").lower().removeprefix("gpu-")
    if seen and gpu.uuid:
        return seen == gpu.uuid.lower().removeprefix("gpu-")
    return not gpu.name or report.get("device_name") == gpu.name


def _numbers(report: dict[str, Any]) -> str:
    rows, cols = report.get("shape") or ("?", "?")
    return (f"Gram + eigvalsh of a {rows}x{cols} matrix within "
            f"{float(report.get('max_rel_error') or 0):.1e} of float64 in "
            f"{float(report.get('seconds') or 0):.3f} s")


def _facts(report: dict[str, Any]) -> str:
    visible = report.get("cuda_visible_devices")
    return (f"torch {report.get('torch')}, CUDA {report.get('torch_cuda') or 'none'}, "
            f"cuda available {str(bool(report.get('cuda_available'))).lower()} "
            f"({report.get('device_count', 0)} device(s), CUDA_VISIBLE_DEVICES="
            f"{'unset' if visible is None else repr(visible)})")
