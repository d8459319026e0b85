"""`esd-sweep gpu-exporter`: GPU memory from NVML as Prometheus text, with dcgm-exporter's names.

Runs on each GPU node (a DaemonSet, or a sidecar) so the Kubernetes backend can see which
GPUs are free. It serves what NVIDIA's dcgm-exporter serves for GPU memory, so either one
can be scraped by the same reader (controller.backends.kubernetes.common.telemetry; the names
are controller.gpu.dcgm's):

    # HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
    # TYPE DCGM_FI_DEV_FB_USED gauge
    DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-…",device="nvidia0",modelName="NVIDIA H100 …",\
Hostname="node-a"} 0    (one line)

Metrics (gauges, MiB, names and help texts as in dcgm-exporter and DCGM's field list):
DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE (dcgm-exporter's default counters) and
DCGM_FI_DEV_FB_TOTAL (a DCGM field dcgm-exporter exports when listed in its counters CSV).
Labels: gpu (NVML index), UUID, device ("nvidia<index>"), modelName and Hostname.

Memory comes from nvmlDeviceGetMemoryInfo with the v2 struct, which leaves out the memory the
driver reserves for itself (v1 counts it as used, so idle GPUs look busy), falling back to
v1 on drivers or bindings without it, like controller.gpu.gpus.

Hostname is the node name: --hostname, else the NODE_NAME environment variable, else the
machine's hostname, as dcgm-exporter does. In a pod the machine's hostname is the pod's
name, so the DaemonSet must set NODE_NAME from the downward API, because the controller pins
Jobs to nodes by the names it reads here:

    env:
      - name: NODE_NAME
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}

The container needs the NVIDIA driver's libraries and every GPU's device node without
taking a GPU from Kubernetes: no nvidia.com/gpu request, NVIDIA_VISIBLE_DEVICES=all with the
NVIDIA container runtime (runtimeClassName: nvidia where that is not the default), as the
GPU operator runs dcgm-exporter.

Newer dcgm-exporter releases (after NVIDIA/dcgm-exporter#655) spell the label `hostname`;
--hostname-label picks the spelling, and the reader accepts both.

HTTP: /metrics reads NVML on each scrape (readings are reused for at most 1 s, so a burst of
scrapes costs one read); a read that fails answers 500 with a one-line message, and the
exporter keeps running. /healthz answers "ok". Exit status: 3 when NVML cannot be used at
startup, 2 when the address cannot be bound, 0 on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

from controller.gpu.dcgm import FB_FREE, FB_TOTAL, FB_USED
from controller.gpu.gpus import NvmlUnavailable
from esd_worker.core.command.flags import PORT, add_flag

log = logging.getLogger(__name__)

# The same values as controller.run.sweep's EXIT_USAGE / EXIT_INFRA (not imported: this program
# runs on GPU nodes and needs nothing of the sweep).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_NVML = 3

DEFAULT_PORT = 9400
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HOSTNAME_LABELS = ("Hostname", "hostname")

# (metric, help text, GpuReading field), in the order they are served.
_METRICS: tuple[tuple[str, str, str], ...] = (
    (FB_FREE, "Framebuffer memory free (in MiB).", "free_mib"),
    (FB_USED, "Framebuffer memory used (in MiB).", "used_mib"),
    (FB_TOTAL, "Total framebuffer memory (in MiB).", "total_mib"),
)

_MIB = float(2**20)


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML reports it; memory in MiB."""

    index: int
    uuid: str
    model_name: str
    used_mib: float
    free_mib: float
    total_mib: float


def _text(value: Any) -> str:
    """pynvml returns str in current versions and bytes in old ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _memory_info(nvml: Any, handle: Any) -> Any:
    """nvmlDeviceGetMemoryInfo, v2 struct where the bindings and the driver have it, else v1."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except (nvml.NVMLError, TypeError):
            # No nvmlDeviceGetMemoryInfo_v2 in this driver, or bindings without `version`.
            # A real device error fails again just below and is reported from there.
            pass
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def read_gpus(nvml_module: Any) -> list[GpuReading]:
    """Every GPU NVML sees, in NVML index order. NVML must be initialised (nvmlInit).

    `nvml_module` is pynvml, or a fake with the same functions. Raises NvmlUnavailable,
    naming the GPU, when NVML fails.
    """
    nvml = nvml_module
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML could not count the GPUs: {e}") from e
    readings: list[GpuReading] = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = _memory_info(nvml, handle)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not read GPU {index}: {e}") from e
        readings.append(
            GpuReading(
                index=index,
                uuid=uuid,
                model_name=name,
                used_mib=float(memory.used) / _MIB,
                free_mib=float(memory.free) / _MIB,
                total_mib=float(memory.total) / _MIB,
            )
        )
    return readings


def escape_label_value(value: str) -> str:
    """A label value as the text exposition format writes it: \\ \" and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: whole numbers without a fraction (as dcgm-exporter writes MiB), others
    exactly (repr), NaN and infinities as the format spells them."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render_metrics(
    readings: Sequence[GpuReading], hostname: str, *, hostname_label: str = "Hostname"
) -> str:
    """The /metrics body: HELP and TYPE, then one line per GPU, for each metric.

    Labels in dcgm-exporter's order (gpu, UUID, device, modelName, Hostname); the hostname
    label is left out when `hostname` is empty, as dcgm-exporter does.
    """
    if hostname_label not in HOSTNAME_LABELS:
        raise ValueError(f"hostname_label: one of {HOSTNAME_LABELS}, got {hostname_label!r}")
    host = f',{hostname_label}="{escape_label_value(hostname)}"' if hostname else ""
    lines: list[str] = []
    for metric, help_text, field in _METRICS:
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} gauge")
        for r in readings:
            labels = (
                f'gpu="{r.index}",UUID="{escape_label_value(r.uuid)}",device="nvidia{r.index}",'
                f'modelName="{escape_label_value(r.model_name)}"{host}'
            )
            lines.append(f"{metric}{{{labels}}} {format_value(getattr(r, field))}")
    return "\n".join(lines) + "\n"


class CachedReader:
    """Calls `read` at most once per `max_age_s` (serialised); failures are not kept."""

    def __init__(
        self,
        read: Callable[[], list[GpuReading]],
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._value: list[GpuReading] = []

    def get(self) -> list[GpuReading]:
        with self._lock:
            now = self._clock()
            if self._at is not None and now - self._at < self._max_age_s:
                return self._value
            value = self._read()
            self._value, self._at = value, self._clock()
            return value


class _Handler(BaseHTTPRequestHandler):
    server: _ExporterServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                readings = self.server.reader.get()
            except Exception as e:  # any read failure is a 500; the exporter keeps serving
                message = " ".join(str(e).split()) or type(e).__name__
                log.warning("scrape failed: %s", message)
                self._send(500, f"NVML read failed: {message}\n")
                return
            body = render_metrics(
                readings, self.server.hostname, hostname_label=self.server.hostname_label
            )
            self._send(200, body, CONTENT_TYPE)
        elif path in ("/healthz", "/health"):
            self._send(200, "ok\n")
        else:
            self._send(404, "not found: try /metrics or /healthz\n")

    def _send(
        self, status: int, body: str, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _ExporterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        reader: CachedReader,
        hostname: str,
        hostname_label: str,
        family: socket.AddressFamily = socket.AF_INET,
    ) -> None:
        self.address_family = family  # read by TCPServer.__init__ when it makes the socket
        self.reader = reader
        self.hostname = hostname
        self.hostname_label = hostname_label
        super().__init__(address, _Handler)


def make_server(
    listen: str,
    port: int,
    read: Callable[[], list[GpuReading]],
    hostname: str,
    *,
    hostname_label: str = "Hostname",
    cache_s: float = 1.0,
) -> ThreadingHTTPServer:
    """The HTTP server, bound but not serving yet (call serve_forever). Port 0: any free port."""
    if hostname_label not in HOSTNAME_LABELS:
        raise ValueError(f"hostname_label: one of {HOSTNAME_LABELS}, got {hostname_label!r}")
    host = listen.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reader = CachedReader(read, max_age_s=cache_s)
    return _ExporterServer((host, port), reader, hostname, hostname_label, family)


def default_hostname() -> str:
    """NODE_NAME (the Kubernetes node name, from the downward API), else this machine's name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def add_exporter_flags(parser: argparse.ArgumentParser) -> None:
    """The gpu-exporter subcommand's flags."""
    add_flag(parser, "--port", type=PORT, default=DEFAULT_PORT, metavar="PORT",
             help=f"port to serve /metrics on (default {DEFAULT_PORT}, as dcgm-exporter)")
    add_flag(parser, "--listen", default="0.0.0.0", metavar="ADDR",
             help="address to listen on (default 0.0.0.0: all IPv4 interfaces; '::' for IPv6)")
    add_flag(parser, "--hostname", default=None, metavar="NAME",
             help="value of the Hostname label: the Kubernetes node name (default: env "
             "NODE_NAME, else this machine's hostname)")
    add_flag(parser, "--hostname-label", choices=HOSTNAME_LABELS, default="Hostname",
             help="label spelling: Hostname (dcgm-exporter 3.x/4.x, default) or hostname "
             "(newer dcgm-exporter)")


def run_exporter(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT. Returns the exit status (see the module docstring)."""
    hostname = args.hostname if args.hostname is not None else default_hostname()
    try:
        import pynvml
    except ImportError:
        print("esd-sweep gpu-exporter: error: the NVML bindings are not installed "
              "(pip install nvidia-ml-py)", file=sys.stderr)
        return EXIT_NO_NVML
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as e:
        print(f"esd-sweep gpu-exporter: error: NVML could not start (no NVIDIA driver, or "
              f"no GPU visible to this container?): {e}", file=sys.stderr)
        return EXIT_NO_NVML
    try:
        try:
            first = read_gpus(pynvml)
        except NvmlUnavailable as e:
            print(f"esd-sweep gpu-exporter: error: {e}", file=sys.stderr)
            return EXIT_NO_NVML
        if not first:
            log.warning("NVML runs but sees no GPU; serving empty metrics")
        try:
            server = make_server(args.listen, args.port, lambda: read_gpus(pynvml), hostname,
                                 hostname_label=args.hostname_label)
        except OSError as e:
            print(f"esd-sweep gpu-exporter: error: cannot listen on {args.listen}:{args.port}: "
                  f"{e}", file=sys.stderr)
            return EXIT_USAGE
        return _serve(server, hostname, len(first))
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            log.debug("nvmlShutdown failed: %s", e)


def _serve(server: ThreadingHTTPServer, hostname: str, gpus: int) -> int:
    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        # shutdown() waits for serve_forever to return, so not from serve_forever's thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    host, port = server.server_address[:2]
    log.info("serving %d GPU(s) as Hostname=%s on http://%s:%s/metrics", gpus, hostname,
             host, port)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.server_close()
    return EXIT_OK
