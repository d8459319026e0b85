"""Shared pieces of the Kubernetes backend tests: a JobSimulator that writes markers as the
worker does, a backend builder over KubeSim, and polling."""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from controller.backends.base import Outcome, Task
from controller.backends.kubernetes.common.client import (
    KubeClient,
    RetryPolicy,
    WatchEvent,
)
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import run_selector
from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
from controller.backends.kubernetes.per_model.backend import KubernetesBackend
from esd_worker.core.command.invocation import WorkerInvocation
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import write_model_result
from esd_worker.core.store.marker import Marker, canonical_parameters
from esd_worker.core.store.stores import Store
from tests.support.kubesim import (
    K8S_VERSION,
    JobSimulator,
    KubeSim,
)

NS = "esd"
PARAMS = canonical_parameters(AnalysisSettings().as_dict())  # what `run` asks for by default
IMAGE = "ghcr.io/example/esd-sweep:0.1.0"
RUN_ID = "20261123T070501Z-3fa9c2"
# Fast retries: KubeSim's injected faults must not make a test slow.
RETRY = RetryPolicy(attempts=40, base_s=0.01, max_s=0.1, deadline_s=20.0)


class MarkerSimulator(JobSimulator):
    """A JobSimulator whose successful Jobs write the model's marker first (the worker's
    last act before it exits 0)."""

    store: Store

    def succeed(self, name: str, *, log: str = "done\n") -> dict[str, Any]:
        job = self.job(name)
        annotations = job["metadata"]["annotations"]
        key = annotations["esd-sweep/model-key"]
        marker = Marker(model=annotations["esd-sweep/model-ref"], model_key=key,
                        parameters=PARAMS, summary={"layers": 1})
        write_model_result(self.store, marker, layers=b"layer,alpha\nl0,3.0\n")
        return super().succeed(name, log=log)


def write_list(path: Path, ids: Sequence[str]) -> Path:
    """A model list CSV of these ids (no relation, no source)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", "base_model_relation", "source_model"])
        writer.writerows([(i, "", "") for i in ids])
    return path


def write_kubeconfig(path: Path, server: str, *, namespace: str) -> Path:
    """A kubeconfig whose current context is `server` (a KubeSim URL), as for a cluster."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sim",
        "clusters": [{"name": "sim", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "tester",
                                                 "namespace": namespace}}],
    }))
    return path


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def make_rows(n: int, prefix: str = "org/model") -> list[ModelRow]:
    return [ModelRow(model_id=f"{prefix}-{i}", revision=None, relation="", source_model=None)
            for i in range(n)]


def make_backend(
    kube: KubeClient, store: Store, *, max_retries: int = 2, gpus_per_job: int = 1,
    poll_interval_s: float = 0.02, max_checks: int = 1,
    worker: WorkerInvocation | None = None,
    run_id: str = RUN_ID, scrape_fn: Callable[..., list[Any]] | None = None,
    clock: Callable[[], float] | None = None,
    size: Callable[[ModelRow], int] | None = None, **overrides: Any,
) -> KubernetesBackend:
    """A KubernetesBackend in namespace NS writing to `store`, telemetry off unless asked;
    overrides are ClusterSettings fields."""
    options: dict[str, Any] = {"namespace": NS, "watch_timeout_s": 2, "telemetry": False,
                               "image": IMAGE}
    options.update(overrides)
    settings = ClusterSettings(**options)
    job_settings = settings.job_settings(
        run_id=run_id, instance=sweep_instance(store.url), gpus_per_job=gpus_per_job,
        worker=worker)
    extra: dict[str, Any] = {}
    if scrape_fn is not None:
        extra["scrape_fn"] = scrape_fn
    if clock is not None:
        extra["clock"] = clock
    if size is not None:
        extra["size"] = size
    return KubernetesBackend(
        settings, kube, job_settings=job_settings, output_url=store.url,
        gpus_per_job=gpus_per_job, max_retries=max_retries, max_checks=max_checks,
        poll_interval_s=poll_interval_s, **extra)


def tasks_for(rows: Sequence[ModelRow]) -> list[Task]:
    return [Task.for_model(row) for row in rows]


def run_models(backend: KubernetesBackend, rows: Sequence[ModelRow],
               outcomes: list[Outcome] | None = None) -> list[Outcome]:
    """backend.run over these models, each Outcome also appended to `outcomes`."""
    sink = outcomes if outcomes is not None else []
    return backend.run(tasks_for(rows), sink.append)


def by_attempt(scripts: Mapping[int, Sequence[Any]]) -> Callable[[Mapping[str, Any]], list[Any]]:
    """An autopilot script by the Job's attempt number (missing: succeed)."""
    def script(job: Mapping[str, Any]) -> list[Any]:
        attempt = int(job["metadata"]["labels"]["esd-sweep/attempt"])
        return list(scripts.get(attempt, ["succeed"]))
    return script


def job_names(sim: KubeSim) -> list[str]:
    return [j["metadata"]["name"] for j in sim.objects("jobs", NS)]


def run_in_thread(backend: KubernetesBackend, rows: Sequence[ModelRow],
                  outcomes: list[Outcome] | None = None) -> threading.Thread:
    """run_models on a daemon thread; what it raised is in the thread's `errors`."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run_models(backend, rows, outcomes)
        except BaseException as e:  # surfaced by the test through .errors
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


RUN = "20261123T070501Z-3fa9c2"


FAST = RetryPolicy(attempts=5, base_s=0.001, max_s=0.01, deadline_s=5.0)


def make_job(ref: str = "openai-community/gpt2", *, run_id: str = RUN, attempt: int = 0,
             **settings: Any) -> dict[str, Any]:
    return build_job(
        model_ref=ref, model_key=model_key(ref), relation="", source_model=None,
        output_url="s3://esd-results/atlas", attempt=attempt,
        settings=JobSettings(image="ghcr.io/example/esd-sweep:0.1.0", namespace=NS,
                             run_id=run_id, hf_token_secret="hf-token:token", **settings),
    )


def assert_stored_objects_valid(sim: KubeSim) -> None:
    """What the cluster holds (with server-set metadata and status) passes strict 1.31."""
    for resource in ("jobs", "pods", "events"):
        for obj in sim.objects(resource):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def watch_until(kube: KubeClient, rv: str, done: Any, timeout_s: int = 5) -> list[WatchEvent]:
    """Watch Jobs of the run from rv until done(events) is true (or the watch times out)."""
    events: list[WatchEvent] = []
    for event in kube.watch_jobs(NS, run_selector(RUN), rv, timeout_s=timeout_s):
        events.append(event)
        if done(events):
            break
    return events
