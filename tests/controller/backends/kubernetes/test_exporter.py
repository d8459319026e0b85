"""Tests of controller.gpu.exporter: NVML (faked at the pynvml function boundary) to Prometheus
text.

The fake module has the pynvml functions the exporter calls (nvmlInit, nvmlShutdown,
nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo with and without
`version`, nvmlDeviceGetUUID, nvmlDeviceGetName), NVMLError and nvmlMemory_v2. The HTTP tests
serve on 127.0.0.1 on a free port and read it back with
controller.backends.kubernetes.common.telemetry.scrape.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from controller.backends.kubernetes.common.telemetry import (
    NodeGpu,
    TelemetryError,
    parse_metrics,
    scrape,
)
from controller.gpu import exporter
from controller.gpu.exporter import (
    CachedReader,
    GpuReading,
    add_exporter_flags,
    format_value,
    make_server,
    read_gpus,
    render_metrics,
    run_exporter,
)
from controller.gpu.gpus import NvmlUnavailable

MIB = 2**20


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeGpu:
    uuid: str
    name: str | bytes
    used_mib: float  # v2 meaning: without the driver's reserved memory
    total_mib: float = 81559.0
    reserved_mib: float = 527.0


@dataclass
class MemV1:
    total: int
    free: int
    used: int


@dataclass
class MemV2:
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class FakePynvml:
    """pynvml at its function boundary, one object per test.

    v2: "yes" (nvmlMemory_v2 and the _v2 entry point), "no-constant" (bindings too old to
    know nvmlMemory_v2), "no-entry-point" (driver without nvmlDeviceGetMemoryInfo_v2: NVML
    error), "no-kwarg" (bindings whose nvmlDeviceGetMemoryInfo takes no `version`).
    """

    gpus: list[FakeGpu]
    v2: str = "yes"
    init_error: str | None = None
    fail_gpu: int | None = None
    fail_count: bool = False
    calls: list[str] = field(default_factory=list)
    memory_versions: list[int | None] = field(default_factory=list)

    NVMLError = FakeNVMLError

    def __getattr__(self, name: str) -> Any:
        if name == "nvmlMemory_v2" and self.v2 != "no-constant":
            return 0x02000028
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        if self.fail_count:
            raise FakeNVMLError("Unknown Error")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index == self.fail_gpu:
            raise FakeNVMLError("GPU is lost")
        return 1000 + index

    def _gpu(self, handle: int) -> FakeGpu:
        return self.gpus[handle - 1000]

    def nvmlDeviceGetMemoryInfo(self, handle: int, **kwargs: Any) -> MemV1 | MemV2:
        version = kwargs.get("version")
        if "version" in kwargs and self.v2 == "no-kwarg":
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument")
        self.memory_versions.append(version)
        g = self._gpu(handle)
        total, reserved, used = (int(x * MIB) for x in (g.total_mib, g.reserved_mib, g.used_mib))
        if version:
            if self.v2 == "no-entry-point":
                raise FakeNVMLError("Function Not Found")
            return MemV2(version, total, reserved, total - reserved - used, used)
        return MemV1(total, total - reserved - used, used + reserved)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self._gpu(handle).name


def two_gpus(**kwargs: Any) -> FakePynvml:
    return FakePynvml(
        [
            FakeGpu("GPU-aaaaaaaa-0000-1111-2222-333333333333", "NVIDIA H100 80GB HBM3", 0.0),
            FakeGpu("GPU-bbbbbbbb-0000-1111-2222-333333333333", "NVIDIA H100 80GB HBM3", 40960.5),
        ],
        **kwargs,
    )


# --- reading NVML -----------------------------------------------------------------------------


def test_read_gpus_uses_the_v2_memory_struct() -> None:
    nvml = two_gpus()
    readings = read_gpus(nvml)
    assert nvml.memory_versions == [0x02000028, 0x02000028]
    assert readings == [
        GpuReading(0, "GPU-aaaaaaaa-0000-1111-2222-333333333333", "NVIDIA H100 80GB HBM3",
                   used_mib=0.0, free_mib=81559.0 - 527.0, total_mib=81559.0),
        GpuReading(1, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "NVIDIA H100 80GB HBM3",
                   used_mib=40960.5, free_mib=81559.0 - 527.0 - 40960.5, total_mib=81559.0),
    ]


@pytest.mark.parametrize("v2", ["no-constant", "no-entry-point", "no-kwarg"])
def test_read_gpus_falls_back_to_v1(v2: str) -> None:
    # v1 counts the driver's reserved memory as used: an idle GPU reads 527 MiB.
    readings = read_gpus(two_gpus(v2=v2))
    assert [r.used_mib for r in readings] == [527.0, 40960.5 + 527.0]
    assert [r.total_mib for r in readings] == [81559.0, 81559.0]


def test_read_gpus_decodes_bytes_from_old_bindings() -> None:
    nvml = FakePynvml([FakeGpu("GPU-1", b"Tesla V100-SXM2-32GB", 1.0)])
    assert read_gpus(nvml)[0].model_name == "Tesla V100-SXM2-32GB"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"fail_gpu": 1}, "NVML could not read GPU 1: GPU is lost"),
     ({"fail_count": True}, "NVML could not count the GPUs: Unknown Error")],
)
def test_read_gpus_errors_name_the_gpu(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(NvmlUnavailable, match=message):
        read_gpus(two_gpus(**kwargs))


def test_no_gpu_reads_as_an_empty_list() -> None:
    assert read_gpus(FakePynvml([])) == []


# --- rendering --------------------------------------------------------------------------------


def test_render_metrics_has_dcgm_exporter_names_labels_and_order() -> None:
    readings = [GpuReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 0.0, 81032.0, 81559.0),
                GpuReading(1, "GPU-b", "NVIDIA H100 80GB HBM3", 1234.5, 79797.5, 81559.0)]
    assert render_metrics(readings, "gpu-node-a") == (
        "# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).\n"
        "# TYPE DCGM_FI_DEV_FB_FREE gauge\n"
        'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",device="nvidia0",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 81032\n'
        'DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b",device="nvidia1",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 79797.5\n'
        "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n"
        "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",device="nvidia0",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 0\n'
        'DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b",device="nvidia1",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 1234.5\n'
        "# HELP DCGM_FI_DEV_FB_TOTAL Total framebuffer memory (in MiB).\n"
        "# TYPE DCGM_FI_DEV_FB_TOTAL gauge\n"
        'DCGM_FI_DEV_FB_TOTAL{gpu="0",UUID="GPU-a",device="nvidia0",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 81559\n'
        'DCGM_FI_DEV_FB_TOTAL{gpu="1",UUID="GPU-b",device="nvidia1",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-a"} 81559\n'
    )


@pytest.mark.parametrize(
    ("hostname", "label", "expected"),
    [("node-a", "Hostname", ',Hostname="node-a"}'),
     ("node-a", "hostname", ',hostname="node-a"}'),
     ("", "Hostname", 'modelName="M"}')],  # no label at all, as dcgm-exporter does
)
def test_render_hostname_label(hostname: str, label: str, expected: str) -> None:
    text = render_metrics([GpuReading(0, "U", "M", 1, 2, 3)], hostname, hostname_label=label)
    assert expected in text


def test_render_rejects_an_unknown_hostname_label() -> None:
    with pytest.raises(ValueError, match="hostname_label"):
        render_metrics([], "n", hostname_label="HOSTNAME")


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0, "0"), (81559.0, "81559"), (0.5, "0.5"), (1 / 3, repr(1 / 3)), (-2.0, "-2"),
     (float("nan"), "NaN"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"),
     (2.0**60, "1.152921504606847e+18"), (7, "7")],
)
def test_format_value(value: float, text: str) -> None:
    assert format_value(value) == text


ROUND_TRIP = [
    [],
    [GpuReading(0, "GPU-a", "NVIDIA H100 80GB HBM3", 0.0, 81032.0, 81559.0)],
    [GpuReading(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", used, 81920.0 - used, 81920.0)
     for i, used in enumerate([0.0, 499.99, 500.0, 1 / 3, 81000.123456789])],
    # label values that need escaping
    [GpuReading(3, 'GPU-"quoted"', 'Model \\ with "quotes"\nand a newline', 1.0, 2.0, 3.0)],
]


@pytest.mark.parametrize("readings", ROUND_TRIP)
@pytest.mark.parametrize("label", ["Hostname", "hostname"])
def test_render_then_parse_gives_the_readings_back(readings: list[GpuReading], label: str) -> None:
    parsed = parse_metrics(render_metrics(readings, "node-1", hostname_label=label))
    assert parsed == [
        NodeGpu(node="node-1", gpu=str(r.index), uuid=r.uuid, model_name=r.model_name,
                used_mib=r.used_mib, free_mib=r.free_mib)
        for r in readings
    ]


# --- cache ------------------------------------------------------------------------------------


def test_cached_reader_reads_at_most_once_a_second_and_keeps_no_failure() -> None:
    now = [100.0]
    results: list[Any] = [[GpuReading(0, "a", "m", 1, 2, 3)], RuntimeError("boom"),
                          [GpuReading(0, "a", "m", 5, 6, 7)]]
    calls = []

    def read() -> list[GpuReading]:
        calls.append(now[0])
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    cached = CachedReader(read, max_age_s=1.0, clock=lambda: now[0])
    assert cached.get()[0].used_mib == 1
    now[0] += 0.99
    assert cached.get()[0].used_mib == 1  # reused
    now[0] += 0.01
    with pytest.raises(RuntimeError):
        cached.get()
    assert cached.get()[0].used_mib == 5  # the failure was not kept: read again at once
    assert calls == [100.0, 101.0, 101.0]


# --- HTTP -------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_served_metrics_are_fresh_per_scrape_and_parse_back() -> None:
    nvml = two_gpus()
    server = make_server("127.0.0.1", 0, lambda: read_gpus(nvml), "gpu-node-a", cache_s=0.0)
    with serving(server) as base:
        first = scrape(base + "/metrics")
        assert [(g.node, g.gpu, g.used_mib) for g in first] == [
            ("gpu-node-a", "0", 0.0), ("gpu-node-a", "1", 40960.5)]
        assert first[1].free_mib == 81559.0 - 527.0 - 40960.5
        assert first[0].uuid == "GPU-aaaaaaaa-0000-1111-2222-333333333333"
        assert first[0].model_name == "NVIDIA H100 80GB HBM3"
        nvml.gpus[0].used_mib = 12000.0
        assert scrape(base + "/metrics")[0].used_mib == 12000.0
        status, content_type, body = get(base + "/metrics")
        assert status == 200
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert body.startswith("# HELP DCGM_FI_DEV_FB_FREE ")


def test_scrapes_within_the_cache_age_read_nvml_once() -> None:
    nvml = two_gpus()
    server = make_server("127.0.0.1", 0, lambda: read_gpus(nvml), "n", cache_s=60.0)
    with serving(server) as base:
        for _ in range(3):
            scrape(base + "/metrics")
    assert len(nvml.memory_versions) == 2  # one read of two GPUs


def test_nvml_failure_is_a_500_with_one_line_and_the_exporter_keeps_serving() -> None:
    nvml = two_gpus(fail_gpu=1)
    server = make_server("127.0.0.1", 0, lambda: read_gpus(nvml), "n", cache_s=0.0)
    with serving(server) as base:
        status, _, body = get(base + "/metrics")
        assert (status, body) == (500, "NVML read failed: NVML could not read GPU 1: GPU is lost\n")
        with pytest.raises(TelemetryError, match=r"HTTP 500: NVML read failed: .*GPU 1"):
            scrape(base + "/metrics")
        assert get(base + "/healthz")[:1] == (200,)
        nvml.fail_gpu = None
        assert len(scrape(base + "/metrics")) == 2


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [("/healthz", 200, "ok\n"), ("/nope", 404, "not found: try /metrics or /healthz\n")],
)
def test_other_paths(path: str, status: int, body: str) -> None:
    server = make_server("127.0.0.1", 0, lambda: [], "n")
    with serving(server) as base:
        assert (get(base + path)[0], get(base + path)[2]) == (status, body)


# --- the command ------------------------------------------------------------------------------


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_exporter_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args()
    assert (args.port, args.listen, args.hostname, args.hostname_label) == (
        9400, "0.0.0.0", None, "Hostname")
    args = parse_args("--port", "9500", "--listen", "::", "--hostname", "n1",
                      "--hostname_label", "hostname")
    assert (args.port, args.listen, args.hostname, args.hostname_label) == (
        9500, "::", "n1", "hostname")
    monkeypatch.setenv("NODE_NAME", "node-from-downward-api")
    assert exporter.default_hostname() == "node-from-downward-api"
    monkeypatch.delenv("NODE_NAME")
    assert exporter.default_hostname() == socket.gethostname()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("module", "message"),
    [(None, "the NVML bindings are not installed"),
     (FakePynvml([], init_error="NVML Shared Library Not Found"),
      "NVML could not start .*NVML Shared Library Not Found"),
     (two_gpus(fail_count=True), "NVML could not count the GPUs")],
)
def test_startup_without_nvml_exits_3(
    module: Any, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)  # None: the import fails
    rc = run_exporter(parse_args("--listen", "127.0.0.1", "--port", str(free_port())))
    assert rc == 3
    err = capsys.readouterr().err
    assert err.startswith("esd-sweep gpu-exporter: error: ")
    assert err.count("\n") == 1
    assert re.search(message, err)


def test_a_port_in_use_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml = two_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = run_exporter(parse_args("--listen", "127.0.0.1", "--port", str(port)))
    assert rc == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
    assert nvml.calls == ["init", "shutdown"]


def test_run_exporter_serves_until_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = two_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("NODE_NAME", "gpu-node-z")
    port = free_port()
    seen: list[list[NodeGpu]] = []

    def client() -> None:
        deadline = time.monotonic() + 5
        try:
            while time.monotonic() < deadline:
                try:
                    seen.append(scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=1))
                    return
                except TelemetryError:
                    time.sleep(0.02)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    rc = run_exporter(parse_args("--listen", "127.0.0.1", "--port", str(port)))
    thread.join(5)
    assert rc == 0
    assert [(g.node, g.gpu) for g in seen[0]] == [("gpu-node-z", "0"), ("gpu-node-z", "1")]
    assert nvml.calls == ["init", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
