"""Tests of esd_worker.core.errors: what a worker exit status (or a signal) means to whoever ran
it."""

from __future__ import annotations

import pytest

from esd_worker.core.errors import (
    DeviceError,
    GpuOutOfMemoryError,
    PermanentModelError,
    StoreError,
    StorePermanentError,
    Terminated,
    UsageError,
    classify_exit,
    exit_code_for,
    failure_message,
    host_out_of_memory,
    signal_name,
)

# torch's host allocator's error, word for word (torch 2.13 on Linux; the number is the
# request): a RuntimeError, not a MemoryError, though the machine ran out of memory.
TORCH_HOST_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 4611686018427387904 bytes. Error "
                  "code 12 (Cannot allocate memory)")


def torch_host_allocation_error() -> RuntimeError:
    """The error torch itself raises when its host allocator is refused: 2**62 bytes is past
    any machine's address space, so the request fails at once and touches no memory."""
    import torch

    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**62, dtype=torch.uint8)
    return raised.value


@pytest.mark.parametrize(
    ("exit_code", "signal", "expected"),
    [
        pytest.param(0, None, ("", False), id="ok"),
        pytest.param(2, None, ("UsageError", False), id="usage"),
        pytest.param(3, None, ("PermanentModelError", False), id="permanent"),
        pytest.param(4, None, ("TransientError", True), id="transient"),
        pytest.param(5, None, ("GpuOutOfMemoryError", True), id="gpu-oom"),
        pytest.param(6, None, ("DeviceError", True), id="device-fault"),
        pytest.param(None, 9, ("KilledBySignal", True), id="sigkill"),
        pytest.param(None, 15, ("KilledBySignal", True), id="sigterm"),
        pytest.param(-9, None, ("KilledBySignal", True), id="popen-negative"),
        pytest.param(137, None, ("KilledBySignal", True), id="container-137"),
        pytest.param(143, None, ("KilledBySignal", True), id="container-143"),
        pytest.param(1, None, ("WorkerCrashed", False), id="uncaught-exception"),
        pytest.param(127, None, ("WorkerCrashed", False), id="command-not-found"),
        pytest.param(255, None, ("WorkerCrashed", False), id="255"),
        pytest.param(None, None, ("WorkerCrashed", False), id="unknown"),
        pytest.param(3, 9, ("KilledBySignal", True), id="signal-wins"),
    ],
)
def test_classify_exit(
    exit_code: int | None, signal: int | None, expected: tuple[str, bool]
) -> None:
    """Exit codes are the worker contract (docs/design.md); a signal kill is transient."""
    assert classify_exit(exit_code, signal) == expected


def test_signal_name() -> None:
    assert signal_name(9) == "SIGKILL"
    assert signal_name(999) == "signal 999"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        pytest.param(UsageError("bad flag"), 2, id="usage"),
        pytest.param(PermanentModelError("gated"), 3, id="permanent"),
        pytest.param(StoreError("throttled"), 4, id="store-transient"),
        pytest.param(StorePermanentError("no bucket"), 3, id="store-permanent"),
        pytest.param(GpuOutOfMemoryError("oom"), 5, id="gpu-oom"),
        pytest.param(KeyboardInterrupt(), 4, id="ctrl-c"),
        pytest.param(Terminated("SIGTERM"), 4, id="sigterm"),
        pytest.param(MemoryError(), 4, id="host-memory"),
        pytest.param(RuntimeError(TORCH_HOST_OOM), 4, id="torch-host-allocator"),
        pytest.param(DeviceError("CUDA asked for, none usable"), 6, id="device-error"),
        pytest.param(RuntimeError("CUDA error: an illegal memory access was encountered"), 6,
                     id="device-fault-text"),
        pytest.param(RuntimeError("bug"), 3, id="bug"),
        pytest.param(RuntimeError("can't allocate memory for the cache"), 3,
                     id="bug-not-torch-allocator"),
    ],
)
def test_exit_code_for(error: BaseException, code: int) -> None:
    """The worker's one table from the error that ended it to its exit code, and back:
    each code classifies as retryable exactly when the error was transient or the device's
    (docs/design.md, "Exit codes": 4, 5 and 6 are retried, elsewhere for a 6)."""
    assert exit_code_for(error) == code
    assert classify_exit(code, None)[1] is (code in (4, 5, 6))


def test_torchs_own_host_allocation_error_is_out_of_host_memory_not_a_bug() -> None:
    """The error torch raises (not a copy of its text) is the retryable host-memory class:
    exit 4, retryable, the host-memory line without a traceback's "a bug"; and its text is
    still the one TORCH_HOST_OOM pins, so the table above tests what torch says."""
    error = torch_host_allocation_error()
    assert str(error) == TORCH_HOST_OOM
    assert host_out_of_memory(error)
    assert exit_code_for(error) == 4
    assert classify_exit(exit_code_for(error), None) == ("TransientError", True)
    assert failure_message(error, "org/m") == "out of host memory; retry on a larger machine"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(PermanentModelError("model not found:\n  x"), "model not found: x",
                     id="worker-error-one-line"),
        pytest.param(Terminated("terminated by signal 15"), "terminated by signal 15",
                     id="terminated"),
        pytest.param(KeyboardInterrupt(), "interrupted; no result written", id="ctrl-c"),
        pytest.param(MemoryError(), "out of host memory; retry on a larger machine",
                     id="host-oom"),
        pytest.param(RuntimeError(TORCH_HOST_OOM), "out of host memory; retry on a larger "
                     "machine", id="torch-host-allocator"),
        pytest.param(DeviceError("the GPU fell off the bus"), "the GPU fell off the bus",
                     id="device-error"),
        pytest.param(RuntimeError("CUDA error: unspecified launch failure"), "the GPU failed "
                     "analysing org/m (not the model's fault): CUDA error: unspecified launch "
                     "failure", id="device-fault-text"),
        pytest.param(ZeroDivisionError("boom"), "internal error analysing org/m: "
                     "ZeroDivisionError: boom (a bug: see the traceback above)", id="a-bug"),
    ],
)
def test_failure_message_is_one_line_for_every_ending(error: BaseException, expected: str) -> None:
    assert failure_message(error, "org/m") == expected
