"""Fixtures of the Kubernetes backend tests: KubeSim, a real client on it, a store, and a
MarkerSimulator playing the cluster (helpers are in tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.backends.kubernetes.client import KubeClient
from esd_worker.store import Store, open_store
from tests.support.cluster import NS, RETRY, MarkerSimulator
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
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "out"))


@pytest.fixture
def cluster(sim: KubeSim, store: Store) -> MarkerSimulator:
    simulator = MarkerSimulator(sim, namespace=NS)
    simulator.store = store
    return simulator
