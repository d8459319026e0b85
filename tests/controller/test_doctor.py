"""`esd-sweep doctor` on this machine: no GPU, no NVML and a CPU-only torch, so the worker
check really starts `esd-worker --self-check` and sees what a sweep's worker would see. GPUs
come from FakePynvml handed to the gpus check (the bindings' boundary, no patching); stores
are a local folder and moto's S3 over HTTP; the HF token is asked of the hub double over
HTTP. The cluster's checks are tests/controller/backends/kubernetes/test_doctor.py's."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.cli import build_parser, main
from controller.doctor.checks import FAIL, INFO, PASS, SKIP, Check, exit_status
from controller.doctor.doctor import PROBE_KEY, check_hf_token, check_store, diagnose
from controller.doctor.local import Gpu, check_gpus, check_worker, judge_worker
from controller.gpu.gpus import GpuSettings, Nvml, NvmlUnavailable
from tests.support.hubserver import HubServer
from tests.support.nvml import FakePynvml, fake_uuid
from tests.support.s3server import S3Server, serve_s3

pytestmark = pytest.mark.usefixtures("restore_logging")

# Not hf_-shaped, so that no redaction pattern hides it: only the code keeps it out.
TOKEN = "doctor-test-token-0123456789"


def _nvml_here() -> bool:
    try:
        Nvml().close()
    except NvmlUnavailable:
        return False
    return True


NO_GPU_HERE = pytest.mark.skipif(_nvml_here() or torch.cuda.is_available(),
                                 reason="this machine has a GPU")


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def doctor(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    """Exit status and each check's line by name, from `esd-sweep doctor ARGV` in-process."""
    code = main(["doctor", *argv])
    lines = capsys.readouterr().out.splitlines()
    return code, {line.split(":", 1)[0].split(" ", 1)[1]: line for line in lines}


# -- the exit rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statuses", "code"),
    [
        pytest.param([PASS, PASS], 0, id="all-pass"),
        pytest.param([PASS, SKIP, INFO], 0, id="skips-and-infos-do-not-fail"),
        pytest.param([PASS, FAIL, SKIP], 1, id="one-failure"),
        pytest.param([], 0, id="nothing-applies"),
    ],
)
def test_exit_status(statuses: list[str], code: int) -> None:
    assert exit_status(Check("c", s, "d") for s in statuses) == code


def test_a_line_says_what_to_do_after_a_failure() -> None:
    assert Check("store", FAIL, "x is read-only", "pick another").line() == \
        "✗ store: x is read-only — fix: pick another"
    assert Check("gpus", SKIP, "not used").line() == "– gpus: not used"


# -- this machine, through the CLI ---------------------------------------------------------


@NO_GPU_HERE
@pytest.mark.parametrize(
    ("device", "code", "gpus", "worker"),
    [
        pytest.param("cpu", 0, "– gpus: not used: --device cpu", "✓ worker: cpu (",
                     id="cpu-no-gpu-needed"),
        pytest.param("auto", 0, "• gpus: no GPU (NVML", "✓ worker: cpu (",
                     id="auto-runs-on-the-cpu"),
        pytest.param("cuda", 1, "✗ gpus: --device cuda needs a GPU: NVML",
                     "– worker: not started", id="cuda-needs-a-gpu"),
    ],
)
def test_this_machine(device: str, code: int, gpus: str, worker: str,
                      capsys: pytest.CaptureFixture[str]) -> None:
    """No GPU is a failure only when --device cuda asks for one; the CPU worker really ran
    the self-check (its numbers and torch's version are in its line)."""
    got, lines = doctor(["--device", device], capsys)
    assert got == code
    assert list(lines) == ["gpus", "worker", "store", "hf-token"]
    assert lines["gpus"].startswith(gpus)
    assert lines["worker"].startswith(worker)
    if worker.startswith("✓"):
        assert f"torch {torch.__version__}" in lines["worker"]
        assert "CUDA_VISIBLE_DEVICES=''" in lines["worker"]  # as a sweep's CPU worker
    assert lines["store"].startswith("– store: not checked")
    assert lines["hf-token"].startswith("– hf-token: no HF_TOKEN set")


@NO_GPU_HERE
def test_json_for_ci(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--device", "cuda", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [
        ("gpus", FAIL), ("worker", SKIP), ("store", SKIP), ("hf-token", SKIP)]
    assert doc["checks"][0]["fix"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--gpu-mem-threshold", "0"], "argument --gpu-mem-threshold",
                     id="threshold"),
        pytest.param(["--gpu-list", "0", "0"], "named more than once", id="gpu-list-repeated"),
        pytest.param(["--worker-timeout", "0"], "argument --worker-timeout", id="timeout"),
        pytest.param(["--backend", "kubernetes", "--telemetry-port", "0"],
                     "argument --telemetry-port", id="kube-flags"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no check ran
    assert message in captured.err


# -- GPUs, NVML faked ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "environ", "gpu_list", "status", "fragments"),
    [
        pytest.param([3.0, 40123.0], {}, None, PASS, [
            "NVML sees 2 GPU(s): 0 NVIDIA H100 80GB HBM3 (81559 MiB, 3 MiB used, free)",
            "1 NVIDIA H100 80GB HBM3 (81559 MiB, 40123 MiB used, busy, ≥ 500 MiB)",
            "a sweep uses GPU(s) 0,1: 1 free now"], id="free-and-busy"),
        pytest.param([3.0, 40123.0], {"CUDA_VISIBLE_DEVICES": "1"}, None, PASS, [
            "CUDA_VISIBLE_DEVICES=1 allows 1",
            "a sweep uses GPU(s) 1: none free now (a sweep waits"], id="allocation-busy"),
        pytest.param([3.0, 3.0, 3.0], {}, (2, 0), PASS, ["a sweep uses GPU(s) 2,0: 2 free"],
                     id="gpu-list-order"),
        pytest.param([3.0, 3.0], {"CUDA_VISIBLE_DEVICES": f"{fake_uuid(1)},7"}, None, PASS, [
            "allows 1", "entry '7' is not a GPU"], id="allocation-by-uuid-then-junk"),
        pytest.param([3.0, 3.0], {}, (5,), FAIL, ["GPU(s) [5] do not exist"],
                     id="gpu-list-no-such-gpu"),
        pytest.param([3.0, 3.0], {"CUDA_VISIBLE_DEVICES": "1"}, (0,), FAIL,
                     ["outside this job's GPUs"], id="gpu-list-outside-allocation"),
        pytest.param([3.0, 3.0], {"CUDA_VISIBLE_DEVICES": "MIG-0a1b"}, None, FAIL,
                     ["names MIG instance"], id="mig"),
    ],
)
def test_gpus_as_a_sweep_reads_them(
    used: list[float], environ: dict[str, str], gpu_list: tuple[int, ...] | None,
    status: str, fragments: list[str],
) -> None:
    """The sweep's own rules decide: free under the threshold, the inherited allocation,
    --gpu-list's order; NVML is shut down again."""
    fake = FakePynvml([[u] for u in used])
    check, view = check_gpus("auto", GpuSettings(gpu_list=gpu_list), environ=environ,
                             module=fake)
    assert check.status == status, check.line()
    for fragment in fragments:
        assert fragment in check.detail
    assert (view is not None) == (status == PASS)
    assert fake.shutdown_calls == 1


@pytest.mark.parametrize(
    ("fake", "environ", "device", "status", "fragment"),
    [
        pytest.param(FakePynvml([], init_error="Driver Not Loaded"), {}, "auto", INFO,
                     "no GPU (NVML could not start", id="no-driver-auto"),
        pytest.param(FakePynvml([], init_error="Driver Not Loaded"), {}, "cuda", FAIL,
                     "install or load the NVIDIA driver", id="no-driver-cuda"),
        pytest.param(FakePynvml([]), {}, "cuda", FAIL, "NVML runs but sees no GPU",
                     id="no-device-cuda"),
        pytest.param(FakePynvml([[3.0]]), {"CUDA_VISIBLE_DEVICES": ""}, "auto", INFO,
                     "allows none", id="empty-allocation-auto"),
        pytest.param(FakePynvml([[3.0]]), {"CUDA_VISIBLE_DEVICES": "-1"}, "cuda", FAIL,
                     "allows none", id="no-gpu-allocated-cuda"),
    ],
)
def test_no_gpu(fake: FakePynvml, environ: dict[str, str], device: str, status: str,
                fragment: str) -> None:
    check, view = check_gpus(device, GpuSettings(), environ=environ, module=fake)
    assert (check.status, view) == (status, None)
    assert fragment in check.line()


def test_device_cpu_does_not_ask_nvml() -> None:
    fake = FakePynvml([[3.0]])
    check, view = check_gpus("cpu", GpuSettings(), environ={}, module=fake)
    assert (check.status, view, fake.init_calls) == (SKIP, None, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch here can use a GPU")
def test_a_gpu_with_a_cpu_only_torch_is_the_old_bug() -> None:
    """NVML sees a free GPU; the worker, started as the sweep starts it (--device cuda,
    CUDA_VISIBLE_DEVICES=0), has a CPU-only torch, as the old scripts' workers had: ✗, with
    what to install. This machine reproduces it for real."""
    args = build_parser().parse_args(["doctor"])
    out = io.StringIO()
    assert diagnose(args, out, nvml_module=FakePynvml([[3.0]]), environ={}) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("✓ gpus: NVML sees 1 GPU(s)")
    worker = lines[1]
    assert worker.startswith("✗ worker: the worker could not use GPU 0 (NVIDIA H100 80GB HBM3, "
                             "free): torch ")
    assert "torch.version.cuda is None" in worker
    assert "CUDA_VISIBLE_DEVICES='0'" in worker  # what the worker itself saw
    assert "— fix: install the CUDA build of torch" in worker


GPU = Gpu(2, "NVIDIA H100 80GB HBM3", fake_uuid(2), 81559.0, 3.0, True)
CUDA_OK = {"selfcheck": "esd-worker", "ok": True, "device": "cuda:0", "error": None,
           "device_name": GPU.name, "device_uuid": GPU.uuid.removeprefix("GPU-"),
           "torch": "2.13.0+cu128", "torch_cuda": "12.8", "cuda_available": True,
           "device_count": 1, "cuda_visible_devices": "2", "max_rel_error": 3e-7,
           "seconds": 0.01, "shape": [512, 256]}


@pytest.mark.parametrize(
    ("report", "gpu", "status", "fragment"),
    [
        pytest.param(CUDA_OK, GPU, PASS, "cuda:0 = GPU 2 (NVIDIA H100 80GB HBM3, free), "
                     "CUDA_VISIBLE_DEVICES=2", id="the-gpu-it-was-given"),
        pytest.param(CUDA_OK | {"device_uuid": fake_uuid(0)}, GPU, FAIL,
                     "the worker's cuda:0 is", id="another-gpu"),
        pytest.param(CUDA_OK | {"device": "cpu"}, GPU, FAIL,
                     "ran on the CPU although it was given GPU 2", id="silent-cpu-fallback"),
        pytest.param(CUDA_OK | {"device": None, "cuda_available": False, "ok": False}, GPU,
                     FAIL, "built for CUDA 12.8 but torch.cuda.is_available() is False",
                     id="driver-too-old"),
        pytest.param(CUDA_OK | {"ok": False, "error": "eigenvalues off by 0.001"}, GPU, FAIL,
                     "on cuda:0 = GPU 2 (NVIDIA H100 80GB HBM3, free): eigenvalues off",
                     id="wrong-numbers"),
        pytest.param(None, GPU, FAIL, "exited 1 without a self-check report: "
                     "ModuleNotFoundError", id="no-report"),
        pytest.param(CUDA_OK | {"device": "cpu", "threads": 2}, None, PASS, "cpu (",
                     id="cpu-wanted"),
    ],
)
def test_judge_worker(report: dict[str, Any] | None, gpu: Gpu | None, status: str,
                      fragment: str) -> None:
    check = judge_worker(report, 1, "ModuleNotFoundError: No module named 'torch'", gpu)
    assert check.status == status, check.line()
    assert fragment in check.line()


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        pytest.param("import time; time.sleep(60)", "did not finish in 1 s (killed)",
                     id="hangs"),
        pytest.param("import sys; sys.stderr.write('ImportError: no torch\\n'); sys.exit(3)",
                     "exited 3 without a self-check report: ImportError: no torch",
                     id="no-report"),
    ],
)
def test_worker_process_trouble(code: str, fragment: str) -> None:
    check = check_worker("cpu", None, timeout_s=1.0, worker_cmd=[sys.executable, "-c", code])
    assert (check.status, check.name) == (FAIL, "worker")
    assert fragment in check.detail


def test_worker_that_cannot_start(tmp_path: Path) -> None:
    check = check_worker("cpu", None, worker_cmd=[str(tmp_path / "no-python")])
    assert check.status == FAIL and "cannot start the worker" in check.detail


# -- store ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_local_store_probe_leaves_nothing(tmp_path: Path) -> None:
    check = check_store(str(tmp_path))
    assert check.status == PASS, check.line()
    assert PROBE_KEY.format(host=socket.gethostname(), pid=os.getpid()) in check.detail
    assert list(tmp_path.iterdir()) == []


def test_missing_local_store_is_not_created(tmp_path: Path) -> None:
    check = check_store(str(tmp_path / "a" / "b"))
    assert check.status == PASS and "does not exist yet" in check.detail
    assert not (tmp_path / "a").exists()


def test_local_store_under_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    check = check_store(str(tmp_path / "file" / "out"))
    assert check.status == FAIL and "is not a directory" in check.detail
    assert "--output-dir" in check.fix


def test_a_store_that_refuses_the_write_fails(tmp_path: Path) -> None:
    """The store's own check passes (a writable folder) but the probe cannot be written:
    a folder holds its name. Works as root, unlike a read-only folder."""
    (tmp_path / PROBE_KEY.format(host=socket.gethostname(), pid=os.getpid())).mkdir()
    check = check_store(str(tmp_path))
    assert check.status == FAIL, check.line()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only folder")
def test_read_only_local_store_fails(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        assert check_store(str(tmp_path)).status == FAIL
    finally:
        tmp_path.chmod(0o700)


def test_s3_store(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    check = check_store(s3_server.url(bucket, "results"))
    assert check.status == PASS, check.line()
    assert s3_server.keys(bucket) == []  # the probe was deleted
    writes = [r for r in s3_server.requests if r[0] == "PUT" and "_doctor-probe-" in r[1]]
    assert writes  # it was written first


def test_s3_wrong_bucket(s3_server: S3Server) -> None:
    check = check_store("s3://esd-no-such-bucket-for-doctor/results")
    assert check.status == FAIL
    assert "esd-no-such-bucket-for-doctor" in check.detail
    assert "AWS_ENDPOINT_URL" in check.fix


# -- HF token ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_token(TOKEN, "ada")
        yield server


@pytest.fixture
def hub_env(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return {"HF_ENDPOINT": hub.url}


@pytest.mark.parametrize(
    ("environ", "status", "fragment"),
    [
        pytest.param({"HF_TOKEN": TOKEN}, PASS, "HF_TOKEN is valid: user ada", id="valid"),
        pytest.param({"HUGGING_FACE_HUB_TOKEN": TOKEN}, PASS,
                     "HUGGING_FACE_HUB_TOKEN is valid", id="old-name"),
        pytest.param({"HF_TOKEN": TOKEN[::-1]}, FAIL, "HF_TOKEN is not valid", id="invalid"),
        pytest.param({"HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}, SKIP, "HF_HUB_OFFLINE is on",
                     id="offline"),
        pytest.param({}, SKIP, "no HF_TOKEN set", id="no-token"),
    ],
)
def test_hf_token(hub: HubServer, hub_env: dict[str, str], environ: dict[str, str],
                  status: str, fragment: str) -> None:
    hub.clear_log()
    check = check_hf_token(hub_env | environ)
    assert check.status == status, check.line()
    assert fragment in check.detail
    assert TOKEN not in check.detail + check.fix and TOKEN[::-1] not in check.detail
    asked = len(hub.calls(kind="api"))
    assert asked == (0 if status == SKIP else 1)  # one hub call, none offline


def test_hub_unreachable(hub_env: dict[str, str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check = check_hf_token({"HF_TOKEN": TOKEN, "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert check.status == FAIL and "cannot reach the hub" in check.detail


def test_token_never_printed(hub: HubServer, hub_env: dict[str, str], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI, valid and invalid, lines and JSON: the token is not in the output."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for token, extra, status in ((TOKEN, [], "✓ hf-token"), (TOKEN[::-1], ["--json"], FAIL)):
        monkeypatch.setenv("HF_TOKEN", token)
        main(["doctor", "--device", "cpu", "--output-dir", str(tmp_path), *extra])
        captured = capsys.readouterr()
        assert status in captured.out
        assert token not in captured.out + captured.err
