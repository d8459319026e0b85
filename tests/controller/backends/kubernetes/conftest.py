"""Fixtures of the Kubernetes backend tests: KubeSim, a real client on it, a store, and a
MarkerSimulator playing the cluster (helpers are in tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.backends.kubernetes.common.client import KubeClient
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from tests.support.cluster import NS, RETRY, MarkerSimulator, write_kubeconfig
from tests.support.kubesim import KubeSim


@pytest.fixture
def sim() -> Iterator[KubeSim]:
    with KubeSim() as server:
        yield server


@pytest.fixture
def kube(sim: KubeSim) -> Iterator[KubeClient]:
    with KubeClient(sim.configuration(), retry=RETRY) as client:
        yield client


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """The result store's directory (the `store` fixture opens the same one)."""
    return tmp_path / "out"


@pytest.fixture
def store(out: Path) -> Store:
    return open_store(str(out))


@pytest.fixture
def kubeconfig(sim: KubeSim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """KUBECONFIG pointing at the KubeSim, as a cluster's would; offline (no hub calls)."""
    path = write_kubeconfig(tmp_path / "kubeconfig", sim.url, namespace=NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # size lookups: every model gets the estimate
    return path


@pytest.fixture
def cluster(sim: KubeSim, store: Store) -> MarkerSimulator:
    simulator = MarkerSimulator(sim, namespace=NS)
    simulator.store = store
    return simulator


@pytest.fixture(autouse=True)
def _no_hub_size_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model sizes come from the list's size_bytes column, local files or the default here:
    the hub is never reachable from the tests (tests/controller/test_sizing.py talks to a
    local hub double for the lookups themselves)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
