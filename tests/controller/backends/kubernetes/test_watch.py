"""controller.backends.kubernetes.common.watch: the watch thread keeps up through 410 Gone, with
the backend against KubeSim."""

from __future__ import annotations

import time

from controller.backends.base import Outcome
from controller.backends.kubernetes.common.client import KubeClient
from esd_worker.core.store.stores import Store
from tests.support.cluster import (
    MarkerSimulator,
    make_backend,
    make_rows,
    run_in_thread,
    wait_for,
)
from tests.support.kubesim import KubeSim


def test_410_gone_on_watch_relists(sim: KubeSim, kube: KubeClient, store: Store,
                                   cluster: MarkerSimulator) -> None:
    """Watches expire (410 Gone) repeatedly during the run: the backend lists again and
    misses no ending."""
    rows = make_rows(8)
    outcomes: list[Outcome] = []
    backend = make_backend(kube, store, max_active_jobs=2)
    with cluster.autopilot():
        thread = run_in_thread(backend, rows, outcomes)
        for _ in range(4):
            wait_for(lambda: sim.count("watch", "jobs") >= 1)
            sim.expire_watches()
            time.sleep(0.1)
        sim.compact()
        thread.join(30)
    assert not thread.errors  # type: ignore[attr-defined]
    assert len(outcomes) == 8 and {o.status for o in outcomes} == {"done"}
    assert sim.count("list", "jobs") >= 2  # the first list plus at least one relist
    assert sim.count("create", "jobs") == 8
