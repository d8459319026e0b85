"""The per-model backend under Kueue: why a suspended Job waits, read from its Workload's
conditions (kueue.x-k8s.io/v1beta2) through the test API server, which plays Kueue."""

from __future__ import annotations

from typing import Any

import pytest

from controller.backends.kubernetes.common.client import KubeClient
from esd_worker.core.store.stores import Store
from tests.support.cluster import (
    NS,
    MarkerSimulator,
    job_names,
    make_backend,
    make_rows,
    run_in_thread,
    wait_for,
)
from tests.support.kubesim import KubeSim, condition

QUOTA_MESSAGE = ("couldn't assign flavors to pod set main: insufficient unused quota for "
                 "nvidia.com/gpu in flavor h100, 1 more needed")


@pytest.mark.parametrize(("conditions", "expected"), [
    pytest.param([condition("QuotaReserved", "Pending", QUOTA_MESSAGE, status="False")],
                 f"Kueue: Pending: {QUOTA_MESSAGE}", id="no-quota"),
    pytest.param([condition("QuotaReserved", "QuotaReserved", "Quota reserved in "
                            "ClusterQueue gpu-cluster-queue"),
                  condition("Admitted", "NoChecks", "waiting for ProvisioningRequest",
                            status="False")],
                 "Kueue: NoChecks: waiting for ProvisioningRequest", id="admission-check"),
    pytest.param([condition("Evicted", "Preempted", "Preempted to accommodate a workload "
                            "(UID: 1) due to prioritization in the ClusterQueue")],
                 "Kueue: Preempted: Preempted to accommodate a workload (UID: 1) due to "
                 "prioritization in the ClusterQueue", id="preempted"),
    pytest.param(None, "suspended: waiting for Kueue, which has made no Workload for it",
                 id="no-workload"),
])
def test_a_job_kueue_holds_is_explained_from_its_workload(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
    conditions: list[dict[str, Any]] | None, expected: str,
) -> None:
    """A Job Kueue has not admitted: after --pending-timeout, the reason is the message of
    the Workload condition that holds it (read through the API, kueue.x-k8s.io/v1beta2,
    the Workload found by Kueue's job-uid label)."""
    row = make_rows(1)[0]
    backend = make_backend(kube, store, kueue_queue="gpu-queue", pending_timeout_s=0.2)
    thread = run_in_thread(backend, [row])
    (name,) = wait_for(lambda: job_names(sim) or None)
    if conditions is not None:
        cluster.queue_workload(name, conditions, queue="gpu-queue")
    # Checked once per timeout: the first look may come before Kueue made the Workload.
    reason = wait_for(lambda: (r := backend.pending.get(row.key, "")).startswith(expected)
                      and r)
    backend.request_stop()
    thread.join(10)
    assert reason, backend.pending
    assert sim.count("list", "workloads") >= 1


def test_workloads_rbac_denied_explains_and_the_sweep_goes_on(
    sim: KubeSim, kube: KubeClient, store: Store, cluster: MarkerSimulator,
) -> None:
    """Without the kueue component's Role the controller cannot read Workloads: the pending
    line says what to grant, and the sweep neither fails nor stops."""
    row = make_rows(1)[0]
    sim.forbid("list", "workloads", namespace=NS)
    backend = make_backend(kube, store, kueue_queue="gpu-queue", pending_timeout_s=0.2)
    thread = run_in_thread(backend, [row])
    reason = wait_for(lambda: backend.pending.get(row.key))
    assert thread.is_alive()
    backend.request_stop()
    thread.join(10)
    assert "could not be read" in reason and "workloads.kueue.x-k8s.io" in reason
    assert thread.errors == []  # type: ignore[attr-defined]
