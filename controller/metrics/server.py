"""Serving a run's registry at /metrics from a daemon thread, for as long as the run runs.

Owns the endpoint's life: bound before the run starts anything (a port in use is the
user's to fix: one line, exit 2), served by prometheus_client's WSGI server in a daemon
thread, shut down and its port released when the run ends, however it ends. Not owned:
what is served (runmetrics.py). `run_endpoint` is the whole of it for one run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from controller.errors import SweepError
from controller.metrics.runmetrics import RunMetrics

log = logging.getLogger(__name__)


class MetricsServer:
    """/metrics of `registry` on address:port (port 0: any free one, see `port`)."""

    def __init__(self, registry: CollectorRegistry, *, address: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=address, registry=registry)
        except OSError as e:  # in use, no such address, not allowed: one line, exit 2
            raise SweepError(f"--metrics-port {port}: cannot listen on {address}:{port}: "
                             f"{e.strerror or e}") from e
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.address = address
        self.port: int = server.server_address[1]

    def close(self) -> None:
        """Stop serving and release the port (waits for the serving thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def serving(registry: CollectorRegistry, *, address: str, port: int) -> Iterator[MetricsServer]:
    """The registry served for the `with` block; the port is free again after it."""
    server = MetricsServer(registry, address=address, port=port)
    host = f"[{address}]" if ":" in address else address
    log.info("metrics: http://%s:%d/metrics", host, server.port)
    try:
        yield server
    finally:
        server.close()


@contextmanager
def run_endpoint(*, run_id: str, backend: str, port: int, address: str,
                 version: str) -> Iterator[RunMetrics | None]:
    """A run's metrics, served on address:port while the `with` block runs; None (nothing
    served, nothing bound) when port is 0."""
    if not port:
        yield None
        return
    metrics = RunMetrics(run_id=run_id, backend=backend, version=version)
    with serving(metrics.registry, address=address, port=port):
        yield metrics
