"""A broken device is never a model's failure: a long-lived worker that finds its GPU unusable
(at start, or mid-run after an error that poisons the CUDA context) records nothing against
any model and exits EXIT_DEVICE (6), so that whoever runs it tries the work on another node.

The start check is measured on this machine for real: it has no GPU, so `--device cuda` is a
node whose GPU is gone. The mid-run fault is an analysis step that raises what torch raises
(the step is Batch's own parameter), into a real local store."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.errors import (
    EXIT_DEVICE,
    EXIT_GPU_OOM,
    EXIT_OK,
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    DeviceError,
    GpuOutOfMemoryError,
    PermanentModelError,
    UsageError,
    device_fault,
    exit_code_for,
)
from esd_worker.core.protocol import Request, parse_event, result_from
from esd_worker.core.store.layout import attempt_key, failure_key
from esd_worker.core.store.stores import LocalStore, Store
from esd_worker.serve.batch import Batch, BatchSettings, ProcessPoisoned
from esd_worker.serve.runner import batch_exit_code
from tests.support import REPO_ROOT
from tests.support.builders import worker_command

TEMPLATE = WorkerSettings(model="(batch)", output="unused")


# -- which errors are the device's -------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "is_device"),
    [
        pytest.param(DeviceError("self-check failed"), True, id="device-error"),
        pytest.param(RuntimeError("CUDA error: an illegal memory access was encountered"), True,
                     id="illegal-access"),
        pytest.param(RuntimeError("CUDA error: device-side assert triggered"), True,
                     id="device-assert"),
        pytest.param(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"),
                     True, id="cublas-execution"),
        pytest.param(RuntimeError("cuda runtime error (999) : unknown error"), True,
                     id="runtime-999"),
        pytest.param(RuntimeError("CUDA error: uncorrectable ECC error encountered"), True,
                     id="ecc"),
        pytest.param(RuntimeError("CUDA error: unspecified launch failure"), True,
                     id="launch-failure"),
        pytest.param(RuntimeError("CUDA error: GPU is lost"), True, id="gpu-lost"),
        pytest.param(RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or "
                                  "unavailable"), True, id="busy-or-unavailable"),
        pytest.param(RuntimeError("No CUDA GPUs are available"), True, id="no-gpus"),
        pytest.param(RuntimeError("NVML_SUCCESS == r INTERNAL ASSERT FAILED at "
                                  "CUDACachingAllocator.cpp"), True, id="nvml-assert"),
        pytest.param(RuntimeError("Found no NVIDIA driver on your system"), True,
                     id="no-driver"),
        pytest.param(GpuOutOfMemoryError("out of GPU memory analysing layer l0: CUDA out of "
                                          "memory. Tried to allocate 2.00 GiB"), False,
                     id="plain-cuda-oom"),
        pytest.param(RuntimeError("CUDA error: out of memory"), False, id="cuda-error-oom"),
        pytest.param(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
                     False, id="cublas-alloc"),
        pytest.param(RuntimeError("shape mismatch"), False, id="a-bug"),
        pytest.param(ValueError("CUDA error: illegal memory access"), False, id="not-runtime"),
        pytest.param(PermanentModelError("weights mention a CUDA error: x"), False,
                     id="model-error-text"),
    ],
)
def test_which_errors_are_the_devices(error: BaseException, is_device: bool) -> None:
    """The texts torch and the driver give for a context that is poisoned or a GPU that is
    gone (Xid-class faults, NVML) are the device's; an out-of-memory is the model's size
    (exit 5, retried with more memory), and the worker's own errors are what they say."""
    assert device_fault(error) is is_device
    if is_device:
        assert exit_code_for(error) == EXIT_DEVICE
    elif isinstance(error, GpuOutOfMemoryError):
        assert exit_code_for(error) == EXIT_GPU_OOM


# -- mid-run: the model in progress is not charged ------------------------------------------


class Analyses:
    """The analysis step: raises what `faults` names for a model, else writes nothing."""

    def __init__(self, faults: dict[str, BaseException]) -> None:
        self.faults = faults
        self.calls: list[str] = []

    def __call__(self, settings: WorkerSettings, store: Store, key: str) -> None:
        self.calls.append(settings.model)
        if settings.model in self.faults:
            raise self.faults[settings.model]


@pytest.mark.parametrize("error", [
    pytest.param(RuntimeError("CUDA error: an illegal memory access was encountered"),
                 id="poisoned-context"),
    pytest.param(RuntimeError("CUDA error: uncorrectable ECC error encountered"), id="xid-ecc"),
    pytest.param(DeviceError("--device cuda asked for, but CUDA is not available"),
                 id="cuda-gone"),
])
def test_a_device_fault_mid_shard_charges_no_model_and_exits_6(
    tmp_path: Path, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model b of a, b, c meets the fault: a is done, b gets no failure record and no
    attempt note (it did not crash anything: the node did), c is not started; b's result
    is retryable with exit code 6, and the batch's exit (a shard's too) is 6."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    store = LocalStore(tmp_path)
    analyses = Analyses({"b": error})
    events: list[dict[str, Any]] = []
    stderr = io.StringIO()
    batch = Batch(BatchSettings(template=TEMPLATE, run_id="run-7"), store, analyses,
                  lambda line: events.append(parse_event(line)), stderr=stderr)
    batch.run(iter([Request(f"key-{m}", m) for m in "abc"]))
    assert analyses.calls == ["a", "b"]
    results = {e["key"]: result_from(e) for e in events if e["event"] == "result"}
    assert list(results) == ["key-a", "key-b"]
    broken = results["key-b"]
    assert (broken.status, broken.exit_code, broken.retryable) == ("failed", EXIT_DEVICE, True)
    assert broken.error.startswith("DeviceError: ") and "gpu-node-7" in broken.error
    assert not store.exists(failure_key("key-b")) and not store.exists(attempt_key("key-b"))
    assert "gpu-node-7" in stderr.getvalue()
    assert batch.exit_code == EXIT_DEVICE
    assert batch_exit_code(batch.exit_code, sharded=True) == EXIT_DEVICE


@pytest.mark.parametrize(
    ("code", "sharded", "exit_code"),
    [
        pytest.param(EXIT_PERMANENT, True, EXIT_OK, id="shard-permanent-is-complete"),
        pytest.param(EXIT_PERMANENT, False, EXIT_PERMANENT, id="models-permanent"),
        pytest.param(EXIT_TRANSIENT, True, EXIT_TRANSIENT, id="shard-transient"),
        pytest.param(EXIT_DEVICE, True, EXIT_DEVICE, id="shard-device"),
        pytest.param(EXIT_DEVICE, False, EXIT_DEVICE, id="models-device"),
        pytest.param(EXIT_OK, True, EXIT_OK, id="shard-ok"),
    ],
)
def test_the_process_exit_of_a_batch(code: int, sharded: bool, exit_code: int) -> None:
    """A shard maps only "every model has its permanent outcome" (3) to complete (0): a
    device fault (6) stays 6, so that the index runs again on another node."""
    assert batch_exit_code(code, sharded=sharded) == exit_code


def test_a_cuda_out_of_memory_error_text_is_still_the_models(tmp_path: Path) -> None:
    """"CUDA error: out of memory" is the GPU being full, not broken: the model gets its
    retryable record with exit 5, and the worker exits after it (its caching allocator may
    be in a bad state), as before; the batch's exit is 4 (a retry may fix it)."""
    store = LocalStore(tmp_path)
    batch = Batch(BatchSettings(template=TEMPLATE), store,
                  Analyses({"a": RuntimeError("CUDA error: out of memory")}), lambda line: None,
                  stderr=io.StringIO())
    tally = batch.run(iter([Request("key-a", "a"), Request("key-b", "b")]))
    assert batch.fatal and tally.failed == 1 and store.exists(failure_key("key-a"))
    assert batch.exit_code == EXIT_TRANSIENT


def test_in_a_supervised_child_a_cuda_out_of_memory_ends_it_as_the_models_crash(
    tmp_path: Path,
) -> None:
    """The same error in a supervised child: no record and no result, the model's attempt
    note kept (it charges the model, the supervisor starts a fresh child), so the model cannot
    stop its shard at itself round after round; the models after it are not started here."""
    store = LocalStore(tmp_path)
    lines: list[str] = []
    analyses = Analyses({"a": RuntimeError("CUDA error: out of memory")})
    batch = Batch(BatchSettings(template=TEMPLATE, fatal_is_crash=True), store, analyses,
                  lines.append, stderr=io.StringIO())
    with pytest.raises(ProcessPoisoned) as raised:
        batch.run(iter([Request("key-a", "a"), Request("key-b", "b")]))
    assert raised.value.exit_code == EXIT_GPU_OOM
    assert not store.exists(failure_key("key-a")) and store.exists(attempt_key("key-a"))
    assert [parse_event(line)["event"] for line in lines] == ["start"]
    assert analyses.calls == ["a"]


def test_cuda_asked_for_without_cuda_is_a_device_error() -> None:
    """Where the device is chosen, not a usage error: the same command works on a node whose
    GPU is there."""
    from esd_worker.analysis.streams import choose_devices

    with pytest.raises(DeviceError, match="CUDA is not available"):
        choose_devices("cuda", True, available=False, count=0)
    assert not issubclass(DeviceError, UsageError)


# -- at start: the real worker on a node without its GPU -------------------------------------


def write_shard(folder: Path, *refs: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "0.csv").write_text("model_id\n" + "".join(f"{r}\n" for r in refs))
    return folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("mode", ["shards", "models", "serve"])
def test_a_node_without_its_gpu_exits_6_and_records_nothing(
    llama_dir: Path, gpt2_dir: Path, tmp_path: Path, mode: str
) -> None:
    """This machine has no GPU: with --device cuda every model used to get a permanent
    failure record and the shard exited 0 (done). Now the device check before the first
    model fails: one error line naming the node and the reason, nothing in the store (no
    failure record, no attempt note, no marker), no model result on stdout, exit 6."""
    folder = write_shard(tmp_path / "_shards" / "run-k" / "gpu-small", str(llama_dir),
                         str(gpt2_dir))
    out = tmp_path / "out"
    target = {"shards": ["--shards", str(folder), "--shard-index", "0"],
              "models": ["--models", str(folder / "0.csv")], "serve": ["--serve"]}[mode]
    requests = "".join(Request(f"key-{i}", str(m)).to_line()
                       for i, m in enumerate((llama_dir, gpt2_dir)))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), NODE_NAME="gpu-node-3")
    started = time.monotonic()
    run = subprocess.run([*worker_command(), *target, "--output", str(out), "--device", "cuda",
                          "--run-id", "run-k"], input=requests if mode == "serve" else "",
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == EXIT_DEVICE, run.stderr
    assert time.monotonic() - started < 60
    errors = [line for line in run.stderr.splitlines() if "gpu-node-3" in line]
    assert errors and "CUDA is not available" in errors[0], run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert not [e for e in events if e["event"] in ("start", "result")]
    stored = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [p for p in stored if "_failures" in p.parts or "_attempts" in p.parts
                or p.name == "result.json"], stored
