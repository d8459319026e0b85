"""controller.backends.kubernetes.per_model.events: what Job changes mean for a model, against
KubeSim
through the real client (the parts wired as KubernetesBackend wires them)."""

from __future__ import annotations

from controller.backends.base import Task
from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.names import job_name, sweep_selector
from controller.backends.kubernetes.common.placement import Placement
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.per_model.events import JobEvents
from controller.backends.kubernetes.per_model.state import ModelTable
from controller.backends.kubernetes.per_model.submit import Submitter
from esd_worker.core.store.stores import Store
from tests.support.cluster import IMAGE, NS, RUN_ID, make_rows
from tests.support.kubesim import KubeSim


def test_relist_confirms_a_missing_job_before_resubmitting(
    sim: KubeSim, kube: KubeClient, store: Store,
) -> None:
    """After 410 Gone the relist is the truth, but a Job created after the list was taken
    is not in it: each Job in flight that the list lacks is read back (GET) first, and only
    one the API no longer has sends its model back to the queue (else a model would get a
    second Job)."""
    settings = ClusterSettings(namespace=NS, telemetry=False, image=IMAGE)
    instance = sweep_instance(store.url)
    job_settings = settings.job_settings(run_id=RUN_ID, instance=instance, gpus_per_job=1)
    table = ModelTable(NS)
    placement = Placement(settings, kube, gpus_per_job=1)
    events = JobEvents(table, kube, settings, placement, max_retries=2,
                       stopping=lambda: False)
    submitter = Submitter(table, events, kube, settings, placement,
                          job_settings=job_settings, output_url=store.url,
                          selector=sweep_selector(instance), adopt_complete=True,
                          stopping=lambda: False)
    rows = make_rows(2)
    for row in rows:
        table.add(Task.for_model(row), row)
    submitter.adopt()
    submitter.submit(0.0)
    assert table.flight == {r.key for r in rows} and not table.queue

    gets = sim.count("get", "jobs")
    events.on_relist([])  # a list taken before both Jobs were created
    assert sim.count("get", "jobs") == gets + 2
    assert table.flight == {r.key for r in rows} and not table.queue

    assert kube.delete_job(NS, job_name(rows[0].key))
    items, _ = kube.list_jobs(NS, sweep_selector(instance))
    events.on_relist(items)
    assert list(table.queue) == [rows[0].key]  # deleted before it ended: submitted again
    assert table.flight == {rows[1].key}
    assert sim.count("create", "jobs") == 2 and not table.outcomes
