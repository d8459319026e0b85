"""The worker's exit-code contract: its exception family, the code each maps to, what a code means.

The one owner of worker exit codes (docs/design.md, "Exit codes"): the worker maps its
errors to codes here, and whoever ran a worker (a local subprocess, a Kubernetes pod) reads
back what a code or a signal means with `classify_exit`. The controller's own exit statuses
are controller.errors'.
"""

from __future__ import annotations

import signal as _signal

from esd_worker.core.echo import echo

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PERMANENT = 3
EXIT_TRANSIENT = 4
EXIT_GPU_OOM = 5
EXIT_DEVICE = 6  # the device or node is broken: no model is charged; run elsewhere
FAILURE_CHARS = 2000  # a failure line at most (echo adds the count of what was cut)


class WorkerError(Exception):
    """Base of every error the worker expects; `exit_code` tells the controller what to do."""

    exit_code = EXIT_PERMANENT


class UsageError(WorkerError):
    """Bad flags or settings: fix the command line."""

    exit_code = EXIT_USAGE


class ModelListError(UsageError):
    """A model list as a whole is unusable: missing, unreadable, no header or id column, empty."""


class PermanentModelError(WorkerError):
    """Retrying cannot help: not found, gated without a token, corrupt or unsupported weights."""

    exit_code = EXIT_PERMANENT


class UnsupportedAdapterError(PermanentModelError):
    """An adapter type the streamed merge does not cover."""


class TransientError(WorkerError):
    """Network, storage or preemption trouble: a retry may succeed."""

    exit_code = EXIT_TRANSIENT


class StoreError(TransientError):
    """The result store could not be read or written just now (network, throttling, disk)."""


class StorePermanentError(WorkerError):
    """The result store cannot be used as configured: no such bucket, access denied, bad or
    missing credentials. Retrying cannot help; fix the URL, the credentials or the policy."""

    exit_code = EXIT_PERMANENT


class StorePathError(StorePermanentError):
    """A local output folder that cannot be used as it is: a file where a folder should be,
    no permission, a read-only filesystem. Every retry fails the same way until someone
    fixes the path or its permissions (the controller checks for it before any worker)."""


class GpuOutOfMemoryError(WorkerError):
    """The GPU ran out of memory: retry with more GPU memory or on CPU."""

    exit_code = EXIT_GPU_OOM


class DeviceError(WorkerError):
    """The GPU (or the node under it) cannot be used: CUDA unavailable although asked for,
    a self-check that fails, an error that poisons the CUDA context, an Xid-class fault.
    Never a model's failure: the worker records nothing against the model in progress and
    exits EXIT_DEVICE so that its work runs elsewhere."""

    exit_code = EXIT_DEVICE


class Terminated(BaseException):
    """SIGTERM (eviction, preemption, the controller stopping or dying): exit 4, no result.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (a
    fallback in layer discovery, say) can swallow it and let a stopped worker carry on
    and write a degraded result.
    """


# What torch, the CUDA runtime and the driver say when the GPU, not the model, failed: the
# context is poisoned (every later CUDA call fails) or the GPU is gone (Xid-class faults:
# ECC, fallen off the bus; NVML). Matched in RuntimeError texts, since torch raises these as
# plain RuntimeError.
DEVICE_FAULT_TEXTS = (
    "cuda error", "cublas_status", "cusolver_status", "cuda runtime error",
    "uncorrectable ecc error", "unspecified launch failure", "illegal memory access",
    "gpu is lost", "busy or unavailable", "no cuda gpus are available",
    "no cuda-capable device", "found no nvidia driver", "nvml",
)
# ... unless the text says the GPU was full: that is the model's size (GpuOutOfMemoryError).
OUT_OF_MEMORY_TEXTS = ("out of memory", "alloc_failed")


def device_fault(error: BaseException) -> bool:
    """Whether `error` is the device's (or its node's) fault, never the model's: a
    DeviceError, or a RuntimeError from torch whose text is one of DEVICE_FAULT_TEXTS and
    not an out-of-memory. The one classification: the batch (no record against the model,
    exit EXIT_DEVICE) and exit_code_for use it."""
    if isinstance(error, DeviceError):
        return True
    if isinstance(error, WorkerError) or not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return (any(t in text for t in DEVICE_FAULT_TEXTS)
            and not any(t in text for t in OUT_OF_MEMORY_TEXTS))


# What torch's host (CPU) allocator says when a tensor cannot be allocated: a RuntimeError
# ("[enforce fail at alloc_cpu.cpp:...] . DefaultCPUAllocator: can't allocate memory: you
# tried to allocate N bytes. Error code 12 (Cannot allocate memory)"), not Python's
# MemoryError, though it is the same trouble: the machine's memory, not the model or a bug.
HOST_ALLOCATOR_TEXTS = ("defaultcpuallocator: can't allocate memory",)


def host_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says host memory ran out: Python's MemoryError, or torch's host
    allocator's RuntimeError (HOST_ALLOCATOR_TEXTS). Transient (another attempt, maybe on a
    larger machine, may succeed), never a bug: the one classification exit_code_for,
    failure_message and the batch use."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, WorkerError) or not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return any(t in text for t in HOST_ALLOCATOR_TEXTS)


def exit_code_for(error: BaseException) -> int:
    """The worker's exit code for the error that ended it: the one table on this side.

    Its own errors carry theirs; a device fault (device_fault) is EXIT_DEVICE. An interrupt
    (Ctrl+C; SIGTERM as Terminated) or host memory running out (host_out_of_memory) is
    transient (4): another attempt, maybe elsewhere, may succeed.
    Anything else is a bug in the worker: 3, not retried (it would fail the same way).
    """
    if isinstance(error, WorkerError):
        return error.exit_code
    if device_fault(error):
        return EXIT_DEVICE
    if isinstance(error, KeyboardInterrupt | Terminated) or host_out_of_memory(error):
        return EXIT_TRANSIENT
    return WorkerError.exit_code


# What each exit status means to whoever ran the worker: (error class, retryable).
EXIT_CLASSES: dict[int, tuple[str, bool]] = {
    EXIT_OK: ("", False),
    EXIT_USAGE: (UsageError.__name__, False),
    EXIT_PERMANENT: (PermanentModelError.__name__, False),
    EXIT_TRANSIENT: (TransientError.__name__, True),
    EXIT_GPU_OOM: (GpuOutOfMemoryError.__name__, True),
    EXIT_DEVICE: (DeviceError.__name__, True),
}
KILLED_BY_SIGNAL = ("KilledBySignal", True)
WORKER_CRASHED = ("WorkerCrashed", False)

# For people: what each class means, after "Class: ".
EXIT_MEANINGS = {
    UsageError.__name__: "the worker rejected its command line",
    PermanentModelError.__name__: "retrying cannot help",
    TransientError.__name__: "network, storage or preemption trouble",
    GpuOutOfMemoryError.__name__: "the GPU ran out of memory",
    DeviceError.__name__: "the GPU or its node is broken (not the model's fault)",
    WORKER_CRASHED[0]: "the worker failed outside its own error handling",
}


def classify_exit(exit_code: int | None, signal: int | None) -> tuple[str, bool]:
    """(error class name, retryable) for how a worker ended.

    0 → ("", False); 2 usage, 3 permanent: not retryable; 4 transient, 5 GPU OOM, 6 device
    fault: retryable.
    A signal kill counts as transient (preemption, OOM killer, Ctrl+C): that includes a
    negative exit code (subprocess's -N for signal N) and 129..192 (128+N, what shells and
    container runtimes report, e.g. 137 for SIGKILL). Any other code: WorkerCrashed, not
    retryable (an uncaught bug, exit 1, fails the same way again).
    """
    if signal is not None and signal != 0:
        return KILLED_BY_SIGNAL
    if exit_code is None:
        return WORKER_CRASHED
    if exit_code in EXIT_CLASSES:
        return EXIT_CLASSES[exit_code]
    if exit_code < 0 or 128 < exit_code <= 128 + 64:
        return KILLED_BY_SIGNAL
    return WORKER_CRASHED


def signal_name(signum: int) -> str:
    """SIGKILL for 9; 'signal 99' for numbers the platform does not name."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


ERROR_PREFIX = "esd-worker: error: "  # what the controller's tail and people look for


def failure_message(error: BaseException, model: str) -> str:
    """The one line that says why analysing `model` ended without a result, on one line,
    for `esd-worker --model` and for each model of a batch alike."""
    if isinstance(error, (WorkerError, Terminated)):
        text = str(error)
    elif isinstance(error, KeyboardInterrupt):
        text = "interrupted; no result written"
    elif host_out_of_memory(error):
        text = "out of host memory; retry on a larger machine"
    elif device_fault(error):
        text = f"the GPU failed analysing {model} (not the model's fault): {error}"
    else:  # a bug in the worker, not a model problem (the caller logs the traceback)
        text = (f"internal error analysing {model}: {type(error).__name__}: {error} "
                "(a bug: see the traceback above)")
    # One line, bounded, with no control character, whatever the error names (a model's
    # config values, a path): the controller's log and the failure record show it as is.
    return echo(" ".join(text.split()), limit=FAILURE_CHARS)
