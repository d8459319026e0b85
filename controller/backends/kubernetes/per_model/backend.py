"""The Kubernetes backend: one batch/v1 Job per model, placed by GPU telemetry, watched, retried.

Owns the Backend contract (controller.backends.base) for `--backend kubernetes`: building
itself from the sweep's settings, the run loop that ties the parts together, dry runs, the
run report's "kubernetes" section, and the boundary where Kubernetes errors become sweep
errors (errors.as_sweep_error). The parts: ModelTable (state.py: each model's state),
Submitter (submit.py: adopt and create Jobs), JobEvents (events.py: what Job changes mean),
JobWatcher (watch.py: the watch thread), Placement (placement.py: GPU telemetry); what it is
built from, with the sharded mode: common.wiring. Does not build Job objects (jobs.py), talk
HTTP (client.py, imported only when common.wiring opens a client, so the local backend runs
without the optional `kubernetes` package) or write records (the sweep's recorder turns each
Outcome into a store record).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from controller.backends.base import Outcome, OutcomeCallback, Task, Work, WorkerSpec
from controller.backends.kubernetes.common.errors import JobSpecError, sweep_errors
from controller.backends.kubernetes.common.jobevents import JobEventRecorder
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import per_model_selector
from controller.backends.kubernetes.common.placement import Placement, ScrapeFn
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.common.telemetry import scrape
from controller.backends.kubernetes.common.watch import JobWatcher, WatchQueue
from controller.backends.kubernetes.common.wiring import (
    check_server,
    client_for,
    sweep_gpu_counts,
    sweep_job_settings,
    sweep_sizer,
    with_template_image,
)
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from controller.backends.kubernetes.per_model.events import JobEvents
from controller.backends.kubernetes.per_model.state import ModelTable
from controller.backends.kubernetes.per_model.submit import SizeFn, Submitter, model_job_settings
from controller.errors import SweepError
from controller.gpu.counts import GpuCounts
from controller.output.tenure import Guarded
from controller.progress import Progress
from esd_worker.core.models.modellist import ModelRow

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.settings import SweepSettings

log = logging.getLogger(__name__)

_TICK_S = 0.05  # longest wait for a watch event before the loop looks at submissions again


class KubernetesBackend(Guarded):
    """Runs one Job per model on a Kubernetes cluster (the Backend protocol).

    run(tasks) adopts this sweep's Jobs (label app.kubernetes.io/instance, a hash of the
    output), submits the others as room allows (max_active_jobs, GPU telemetry,
    max_pending), watches Jobs from the list's resourceVersion (relisting on 410 Gone) on
    a second thread, and turns each ended model into one Outcome (on_outcome, called in
    the thread that called run). Retryable failures get a new Job `<name>-a<N>` up to
    max_retries times; a model is never submitted twice. kube: None only for a backend
    that dry-runs. own_kube: close() closes kube. scrape_fn, clock: for tests. size: a
    model's weight bytes (requests); gpus: its GPU count (controller.gpu.counts.GpuCounts;
    None: gpus_per_job for every Job).
    """

    name = "kubernetes"

    def __init__(
        self, settings: ClusterSettings, kube: KubeClient | None, *,
        job_settings: JobSettings, output_url: str, gpus_per_job: int = 1,
        max_retries: int = 2, threshold_mib: float = 500.0, max_checks: int = 10,
        poll_interval_s: float = 1.0, adopt_complete: bool = True, own_kube: bool = False,
        scrape_fn: ScrapeFn = scrape, clock: Callable[[], float] = time.monotonic,
        size: SizeFn | None = None, gpus: GpuCounts | None = None,
    ) -> None:
        problems = settings.problems()
        if problems:
            raise SweepError("invalid cluster settings: " + "; ".join(problems))
        self.settings = settings
        self.kube = kube
        self.job_settings = job_settings
        self.output_url = output_url
        self.instance = job_settings.instance
        self.selector = per_model_selector(self.instance)
        self.gpus_per_job = gpus_per_job
        self._own_kube = own_kube
        self._clock = clock
        self._size = size
        self._gpus = gpus
        self._stop_requests = 0
        self.placer = Placement(
            settings, kube, gpus_per_job=gpus_per_job, threshold_mib=threshold_mib,
            max_checks=max_checks, poll_interval_s=poll_interval_s, scrape_fn=scrape_fn,
            clock=clock)
        self.table = ModelTable(settings.namespace, clock=clock)
        self._max_retries = max_retries
        self._adopt_complete = adopt_complete
        self._parts: tuple[JobEvents, Submitter] | None = None
        self.left_running: list[str] = []
        self.cpu_s = 0.0
        self.watch_cpu_s = 0.0  # CPU seconds of the watch thread (reading watch events)

    @classmethod
    def from_settings(cls, settings: SweepSettings, spec: WorkerSpec, *,
                      kube: KubeClient | None = None) -> KubernetesBackend:
        """The backend `esd-sweep run --backend kubernetes` uses: checks the output, opens
        the client from the kubeconfig (unless `kube` is given, or for a dry run)."""
        job_settings = sweep_job_settings(settings, spec)
        sizer = sweep_sizer(settings.cluster)
        with client_for(settings, kube) as (client, own):
            cluster, job_settings = with_template_image(settings, job_settings, client)
            return cls(
                cluster, client, job_settings=job_settings,
                output_url=spec.store_url, gpus_per_job=job_settings.gpus_per_job,
                max_retries=spec.max_retries, adopt_complete=not spec.overwrite,
                threshold_mib=settings.gpu.threshold_mib, max_checks=settings.gpu.max_checks,
                poll_interval_s=settings.gpu.poll_interval_s, own_kube=own,
                size=sizer.size, gpus=sweep_gpu_counts(settings, sizer, job_settings))

    # -- the Backend protocol ---------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop submitting and return soon; Jobs already submitted keep running on the
        cluster (a later run adopts them). Safe from a signal handler."""
        self._stop_requests += 1

    def stop_notice(self, count: int) -> str:
        return ("stopping: no new Jobs; submitted Jobs keep running on the cluster "
                "(the next run adopts them)")

    @property
    def placement(self) -> str:
        """How Jobs were placed: "telemetry" (preferring nodes with room) or "plain"."""
        return self.placer.mode

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_job > 0 else "cpu"

    def dry_run(self, tasks: Work, out: TextIO) -> int:
        """Print the first-attempt Jobs as YAML (`kubectl apply -f -` takes it); create
        nothing. Every model's problem at once, as one SweepError."""
        jobs, problems = [], []
        rows = [_row(task) for task in tasks]  # one read of the list
        listed = {row.key: row for row in rows}
        for row in rows:
            gpus = self._gpus(row, listed.get) if self._gpus is not None else None
            try:
                jobs.append(build_job(
                    model_ref=row.ref, model_key=row.key, relation=row.relation,
                    source_model=row.source_model, output_url=self.output_url,
                    settings=model_job_settings(self.settings, self.job_settings, row,
                                                self._size, listed.get, gpus)))
            except JobSpecError as e:
                problems.append(f"model={row.ref}: {e}")
        if self._gpus is not None:
            self._gpus.log_stats()
        if problems:
            raise SweepError("; ".join(problems))
        if jobs:
            out.write(jobs_to_yaml(jobs))
        out.flush()
        return len(jobs)

    def run(self, tasks: Work, on_outcome: OutcomeCallback,
            progress: Progress | None = None) -> list[Outcome]:
        """Run every model; returns one Outcome per model that ended (done or failed).

        Returns early on request_stop, or with wait=False once everything that fits is
        submitted: models still in flight are listed in `left_running`.
        """
        with sweep_errors():
            return self._run(tasks, on_outcome, progress)

    def report(self) -> dict[str, Any]:
        """The backend's part of runs/<run_id>.json."""
        return {
            "device": self.device,
            "gpus": [],
            "running": len(self.left_running),
            "kubernetes": {
                "namespace": self.settings.namespace,
                "instance": self.instance,
                "image": self.settings.image,
                "placement": self.placement,
                "jobs_created": self.created,
                "jobs_adopted": self.adopted,
                "jobs_left_running": self.left_running,
                "pending": dict(self.pending),
                "api_requests": self.kube.requests if self.kube is not None else 0,
                "waited": self.settings.wait,
            },
        }

    def close(self) -> None:
        self.placer.close()
        if self._own_kube and self.kube is not None:
            self.kube.close()

    # -- what the run report shows ----------------------------------------------------------

    @property
    def created(self) -> int:
        return self._parts[1].created if self._parts is not None else 0

    @property
    def adopted(self) -> int:
        return self._parts[1].adopted if self._parts is not None else 0

    @property
    def pending(self) -> dict[str, str]:
        return self._parts[0].pending if self._parts is not None else {}

    # -- the loop ---------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop_requests > 0 or self.lease_lost  # a Job under way still goes

    def _run(self, tasks: Work, on_outcome: OutcomeCallback,
             progress: Progress | None) -> list[Outcome]:
        if self.kube is None:
            raise SweepError("the kubernetes backend has no client (built for a dry run)")
        if self._parts is None:  # once per backend (its parts are built on its first run)
            check_server(self.kube)
        cpu0 = time.thread_time()
        table = self.table
        table.on_outcome, table.progress = on_outcome, progress
        for task in tasks:
            table.add(task, _row(task))
        if self._parts is None:
            events = JobEvents(table, self.kube, self.settings, self.placer,
                               max_retries=self._max_retries, stopping=self._stopping,
                               recorder=JobEventRecorder(self.kube))
            submitter = Submitter(
                table, events, self.kube, self.settings, self.placer,
                job_settings=self.job_settings, output_url=self.output_url,
                selector=self.selector, adopt_complete=self._adopt_complete,
                stopping=self._stopping, size=self._size, gpus=self._gpus)
            self._parts = (events, submitter)
        events, submitter = self._parts
        inbox: WatchQueue = queue.Queue()
        watcher: JobWatcher | None = None
        try:
            rv = submitter.adopt()
            watcher = JobWatcher(self.kube, namespace=self.settings.namespace,
                                 selector=self.selector, resource_version=rv,
                                 timeout_s=self.settings.watch_timeout_s, out=inbox)
            watcher.start()
            while not self._loop_once(inbox, events, submitter):
                pass
        finally:
            if watcher is not None:
                watcher.stop()
                self.watch_cpu_s = watcher.cpu_s
            self.placer.close()
            self.left_running = table.in_flight_names()
            self.cpu_s = time.thread_time() - cpu0
            if self._gpus is not None:
                self._gpus.log_stats()
        return table.outcomes

    def _loop_once(self, inbox: WatchQueue, events: JobEvents, submitter: Submitter) -> bool:
        """One turn of the run loop; True when run should return."""
        table = self.table
        if self._stopping():
            log.warning("stop requested: no new Jobs; %d Job(s) keep running on the "
                        "cluster (the next run adopts them)", len(table.flight))
            table.drop_retries()
            return True
        _drain(inbox, events)
        now = self._clock()
        if table.queue and self.placer.due(now):
            self.placer.poll(now)
        submitter.submit(now)
        events.check_pending(now)
        table.update_progress()
        if not table.queue and not table.flight:
            return True
        cannot_submit = len(table.flight) >= self.settings.max_active_jobs or submitter.blocked
        if not self.settings.wait and (not table.queue or cannot_submit) and self.placer.settled:
            log.info("--no-wait: %d Job(s) submitted and running, %d model(s) not "
                     "submitted yet; a later run adopts them", len(table.flight),
                     len(table.queue))
            table.drop_retries()
            return True
        return False


def _drain(inbox: WatchQueue, events: JobEvents) -> None:
    """Handle watch events: wait up to one tick for the first, then take what is there."""
    try:
        item = inbox.get(timeout=_TICK_S)
    except queue.Empty:
        return
    while True:
        kind, payload = item
        if kind == "event":
            if payload.type == "DELETED":
                events.on_deleted(payload.object)
            else:
                events.on_job(payload.object)
        elif kind == "relist":
            events.on_relist(payload)
        elif kind == "error":
            raise payload
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            return


def _row(task: Task) -> ModelRow:
    if task.row is None:
        raise SweepError("--mode custom runs on the local backend only")
    return task.row
