"""The worker's exception family and the exit code each one maps to (DESIGN.md contract)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PERMANENT = 3
EXIT_TRANSIENT = 4
EXIT_GPU_OOM = 5


class WorkerError(Exception):
    """Base of every error the worker expects; `exit_code` tells the controller what to do."""

    exit_code = EXIT_PERMANENT


class UsageError(WorkerError):
    """Bad flags or settings: fix the command line."""

    exit_code = EXIT_USAGE


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


class GpuOutOfMemoryError(WorkerError):
    """The GPU ran out of memory: retry with more GPU memory or on CPU."""

    exit_code = EXIT_GPU_OOM
