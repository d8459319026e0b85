"""Scraping a metrics endpoint over real HTTP and reading it with prometheus_client's parser."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    """GET /metrics: every sample by (name, labels)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode("utf-8")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def free_port() -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def refused(port: int) -> bool:
    """Nothing accepts connections on the port any more."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
