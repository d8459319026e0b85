"""The Kubernetes backend: one batch/v1 Job per model, placed by GPU telemetry, watched, retried.

Owns submitting, adopting (after a restart), watching and diagnosing worker Jobs, and their
placement on nodes whose GPUs have room. Does not build Job objects (controller.backends.kubernetes.jobs), talk
HTTP itself (controller.backends.kubernetes.client), or write records (the sweep's recorder turns each Outcome
into a store record). controller.backends.kubernetes.client, and with it the optional `kubernetes` package, is
imported only when a ClusterBackend is made, so the local backend runs without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from controller import records
from controller.backends.kubernetes.jobs import (
    ATTEMPT_LABEL,
    CONTAINER_NAME,
    JobSettings,
    JobSpecError,
    build_job,
    managed_selector,
)
from controller.backends.kubernetes.settings import (  # noqa: F401  (re-exported until the split)
    DEFAULT_NAMESPACE,
    DEFAULT_SERVICE_ACCOUNT,
    DEFAULT_TELEMETRY_PORT,
    DEFAULT_TELEMETRY_SELECTOR,
    INSTANCE_LABEL,
    JOB_NAME_LABEL,
    MODEL_KEY_ANNOTATION,
    OUTPUT_ANNOTATION,
    PASSTHROUGH_ENV,
    ClusterSettings,
    default_image,
    job_setting_problems,
    result_args,
    sweep_instance,
    worker_passthrough_env,
)
from controller.backends.kubernetes.telemetry import (
    NodeGpu,
    NodeGpuTracker,
    TelemetryError,
    node_affinity,
    scrape,
)
from controller.backends.local import Outcome, Task
from controller.modellist import ModelRow
from controller.progress import Progress

if TYPE_CHECKING:
    from controller.backends.kubernetes.client import KubeClient

log = logging.getLogger(__name__)

_TICK_S = 0.05  # longest wait for a watch event before the loop looks at submissions again


# -- diagnosis (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """Why a Job failed: error "Class: what happened", whether a retry may help, how the
    worker ended (exit code / signal, None when unknown) and the last log lines."""

    error: str
    retryable: bool
    exit_code: int | None
    signal: int | None
    tail: tuple[str, ...]
    pod: str | None = None
    node: str | None = None


def job_condition(job: Mapping[str, Any]) -> tuple[str | None, str, str]:
    """("Complete" | "Failed" | None, reason, message) of a Job from its conditions."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return str(cond["type"]), str(cond.get("reason") or ""), str(cond.get("message") or "")
    return None, "", ""


def _pod_sort_key(pod: Mapping[str, Any]) -> tuple[str, int]:
    meta = pod.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), int(meta.get("resourceVersion") or 0)


def _worker_terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER_NAME:
            terminated = (cs.get("state") or {}).get("terminated")
            return terminated if isinstance(terminated, Mapping) else None
    return None


def _pod_condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def _lines(text: str, n: int) -> tuple[str, ...]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return tuple(lines[-n:]) if n > 0 else ()


def diagnose_failure(
    job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], log_text: str, *,
    tail_lines: int = 20,
) -> Diagnosis:
    """Why a Failed Job failed, from the Job's condition, its last failed pod and its log.

    The exit code goes through records.classify_exit (the one mapping of the worker's exit
    codes): 3 → permanent, 4/5 → transient, 128+N → killed by a signal (transient; this
    includes OOMKilled, the kernel's OOM killer on host memory). Deadline exceeded is not
    retried (the next attempt would get the same deadline); an eviction or disruption is.
    """
    _, reason, message = job_condition(job)
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    pod = max(failed or pods, key=_pod_sort_key) if (failed or pods) else None
    terminated = _worker_terminated(pod) if pod is not None else None
    pod_name = str((pod.get("metadata") or {}).get("name")) if pod is not None else None
    node = str((pod.get("spec") or {}).get("nodeName") or "") or None if pod else None
    tail = _lines(log_text, tail_lines)
    if not tail and terminated is not None and terminated.get("message"):
        tail = _lines(str(terminated["message"]), tail_lines)  # FallbackToLogsOnError
    exit_code = terminated.get("exitCode") if terminated is not None else None
    exit_code = int(exit_code) if isinstance(exit_code, int) else None
    signal = exit_code - 128 if exit_code is not None and 128 < exit_code <= 192 else None
    where = f" (pod {pod_name}{' on ' + node if node else ''})" if pod_name else ""

    def out(error: str, retryable: bool) -> Diagnosis:
        return Diagnosis(error + where, retryable, exit_code, signal, tail, pod_name, node)

    if reason == "DeadlineExceeded":
        return out("DeadlineExceeded: the Job ran longer than --job-deadline "
                   f"(activeDeadlineSeconds): {message}", False)
    if terminated is not None and terminated.get("reason") == "OOMKilled":
        cls, retryable = records.classify_exit(exit_code, None)
        return out(f"{cls}: OOMKilled: the worker ran out of host memory (exit "
                   f"{exit_code}); raise --memory-request if it repeats", retryable)
    disruption = _pod_condition(pod, "DisruptionTarget") if pod is not None else None
    if disruption is not None:
        return out(f"Disrupted: {disruption.get('reason')}: {disruption.get('message')}",
                   True)
    status = (pod.get("status") or {}) if pod is not None else {}
    if status.get("reason") == "Evicted":
        return out(f"Evicted: {status.get('message') or 'the kubelet evicted the pod'}", True)
    if exit_code is not None:
        cls, retryable = records.classify_exit(exit_code, None)
        if signal is not None:
            detail = f"the worker was killed by {records.signal_name(signal)} (exit {exit_code})"
        else:
            detail = f"the worker exited {exit_code}"
        return out(f"{cls}: {detail}", retryable)
    # No pod ran to an end: the Job failed around it (pods never created, quota, ...).
    return out(f"JobFailed: {reason or 'unknown reason'}: {message}".rstrip(": "), True)


def describe_pending(
    job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> str:
    """One line on why a Job is not running: Kueue, Unschedulable (insufficient GPUs,
    untolerated taint, ...), quota, image pulls, from pod conditions and events."""
    if (job.get("spec") or {}).get("suspend"):
        return "suspended: waiting for Kueue to admit it"
    for pod in sorted(pods, key=_pod_sort_key, reverse=True):
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}"
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
                return f"{waiting.get('reason')}: {waiting.get('message') or ''}"
    warnings = [e for e in events if e.get("type") == "Warning"]
    if warnings:
        last = max(warnings, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime")
                                                  or ""))
        return f"{last.get('reason')}: {last.get('message')}"
    if not pods:
        return "no pod created yet (see the Job's events; a ResourceQuota may be full)"
    return "pending: the scheduler has not placed the pod yet"


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return max((datetime.fromisoformat(end) - datetime.fromisoformat(start))
                   .total_seconds(), 0.0)
    except ValueError:
        return None


# -- the backend ---------------------------------------------------------------------------


@dataclass
class _Model:
    row: ModelRow
    args: tuple[str, ...] = ()  # the worker args, built only to compare with a found Job
    attempt: int = -1  # the highest attempt number taken (any sweep), -1: none
    tries: int = 0  # Jobs of this run's count (submitted or adopted active)
    name: str | None = None  # the Job in flight
    submitted_at: float = 0.0
    running: bool = False
    running_at: float | None = None
    node: str | None = None  # where it was pinned (reservation held until it runs)
    pending_reason: str | None = None
    pending_checked_at: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    in_flight: bool = False
    finished: bool = False
    last: Diagnosis | None = None  # the last failed attempt, while its retry waits


class ClusterBackend:
    """Runs one Job per model on a Kubernetes cluster; same shape as LocalBackend.

    run(rows) adopts this sweep's Jobs (label app.kubernetes.io/instance, a hash of the
    output), submits the others as room allows (max_active_jobs, GPU telemetry,
    max_pending), watches Jobs from the list's resourceVersion (relisting on 410 Gone) on
    a second thread, and turns each ended model into one Outcome (on_outcome). Retryable
    failures get a new Job `<name>-a<N>` up to max_retries times. A model is never
    submitted twice: names are pure functions of model key and attempt, and a 409 on
    create is adopted after checking the Job is this sweep's. Callbacks run in the thread
    that called run(). adopt_complete: a Complete Job of this sweep found at start counts
    as done (its marker is then confirmed by the recorder); False (--overwrite) makes it
    history and the model runs again. scrape_fn, clock: for tests.
    """

    def __init__(
        self,
        settings: ClusterSettings,
        kube: KubeClient,
        *,
        job_settings: JobSettings,
        output_url: str,
        gpus_per_job: int = 1,
        max_retries: int = 2,
        threshold_mib: float = 500.0,
        max_checks: int = 10,
        poll_interval_s: float = 1.0,
        adopt_complete: bool = True,
        on_outcome: Callable[[Outcome], None] | None = None,
        progress: Progress | None = None,
        scrape_fn: Callable[..., list[NodeGpu]] = scrape,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from controller.backends.kubernetes import (
            client as kube_module,  # the optional extra, only from here on
        )

        self._k = kube_module
        problems = settings.problems()
        if problems:
            raise ValueError("invalid cluster settings: " + "; ".join(problems))
        self.settings = settings
        self.kube = kube
        self.job_settings = job_settings
        self.output_url = output_url
        self.instance = job_settings.instance
        self.selector = f"{managed_selector()},{INSTANCE_LABEL}={self.instance}"
        self.gpus_per_job = gpus_per_job
        self.max_retries = max_retries
        self.poll_interval_s = poll_interval_s
        self.adopt_complete = adopt_complete
        self.on_outcome = on_outcome
        self.progress = progress
        self._scrape = scrape_fn
        self._clock = clock
        self.tracker = NodeGpuTracker(
            threshold_mib=threshold_mib, max_checks=max_checks,
            stale_after_s=max(60.0, 10 * poll_interval_s), clock=clock)
        self._stop_requests = 0
        self._models: dict[str, _Model] = {}
        self._by_name: dict[str, str] = {}
        self._queue: deque[str] = deque()
        self._outcomes: list[Outcome] = []
        self._counts = {"done": 0, "failed": 0}
        self._flight: set[str] = set()  # keys with a Job in flight
        self._waiting: set[str] = set()  # ... of which not running yet
        self._room_blocked = False
        self._next_pending_check = 0.0
        self._telemetry_state = "unknown"  # unknown | on | off
        self._telemetry_said_off = False
        self._quota_said = False
        self._polls = 0  # telemetry polls that gave readings
        self._next_poll = 0.0
        self._pool: ThreadPoolExecutor | None = None
        # What the run report shows.
        self.left_running: list[str] = []
        self.pending: dict[str, str] = {}
        self.adopted = 0
        self.created = 0
        self.cpu_s = 0.0
        self._watch_cpu_s = 0.0

    def request_stop(self) -> None:
        """Stop submitting and return soon; Jobs already submitted keep running on the
        cluster (a later run adopts them). Safe from a signal handler."""
        self._stop_requests += 1

    @property
    def placement(self) -> str:
        """How Jobs were placed: "telemetry" (pinned to nodes with room) or "plain"."""
        return "telemetry" if self._telemetry_state == "on" else "plain"

    # -- the loop ------------------------------------------------------------------------

    def run(self, rows: Iterable[ModelRow]) -> list[Outcome]:
        """Run every model; returns one Outcome per model that ended (done or failed).

        Returns early on request_stop, or with wait=False once everything that fits is
        submitted: models still in flight are listed in `left_running`.
        """
        cpu0 = time.thread_time()
        for row in rows:
            if row.key not in self._models:
                self._models[row.key] = _Model(row)
                self._queue.append(row.key)
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        watcher: _Watcher | None = None
        try:
            rv = self._adopt()
            watcher = _Watcher(self, rv, events)
            watcher.start()
            while True:
                if self._stop_requests:
                    log.warning("stop requested: no new Jobs; %d Job(s) keep running on the "
                                "cluster (the next run adopts them)", len(self._flight))
                    self._drop_retries()
                    break
                self._drain(events)
                now = self._clock()
                if self._queue and now >= self._next_poll:
                    self._poll_telemetry(now)
                self._submit(now)
                self._check_pending(now)
                self._update_progress()
                if not self._queue and not self._flight:
                    break
                if not self.settings.wait and (not self._queue or self._cannot_submit()) and (
                        self._telemetry_state != "on"
                        or self._polls >= self.tracker.max_checks):
                    # (with telemetry, GPUs count as free only after max_checks polls)
                    log.info("--no-wait: %d Job(s) submitted and running, %d model(s) not "
                             "submitted yet; a later run adopts them", len(self._flight),
                             len(self._queue))
                    self._drop_retries()
                    break
        finally:
            if watcher is not None:
                watcher.stop()
                self._watch_cpu_s = watcher.cpu_s
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            self.left_running = sorted(m.name for m in self._models.values()
                                       if m.in_flight and m.name)
            self.cpu_s = time.thread_time() - cpu0
        return self._outcomes

    @property
    def watch_cpu_s(self) -> float:
        """CPU seconds the watch thread used (reading and parsing watch events)."""
        return self._watch_cpu_s

    def _cannot_submit(self) -> bool:
        return len(self._flight) >= self.settings.max_active_jobs or self._room_blocked

    def _set_flight(self, model: _Model, in_flight: bool, *, running: bool = False) -> None:
        key = model.row.key
        model.in_flight = in_flight
        model.running = running
        if in_flight:
            self._flight.add(key)
        else:
            self._flight.discard(key)
        if in_flight and not running:
            self._waiting.add(key)
        else:
            self._waiting.discard(key)

    def _drop_retries(self) -> None:
        """Retries that will not happen now are reported as the failures they were."""
        for key in list(self._queue):
            model = self._models[key]
            if model.last is not None and not (model.in_flight or model.finished):
                self._finish(model, "failed", model.last)
        self._queue.clear()

    def _drain(self, events: queue.Queue[tuple[str, Any]]) -> None:
        """Handle watch events: wait up to one tick for the first, then take what is there."""
        try:
            item = events.get(timeout=_TICK_S)
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "event":
                if payload.type == "DELETED":
                    self._on_deleted(payload.object)
                else:
                    self._on_job(payload.object)
            elif kind == "relist":
                self._on_relist(payload)
            elif kind == "error":
                raise payload
            try:
                item = events.get_nowait()
            except queue.Empty:
                return

    # -- adoption ------------------------------------------------------------------------

    def _args_for(self, model: _Model) -> tuple[str, ...]:
        if not model.args:
            job = self._build(model, 0, None)
            model.args = tuple(job["spec"]["template"]["spec"]["containers"][0]["args"])
        return model.args

    def _build(self, model: _Model, attempt: int,
               affinity: Mapping[str, Any] | None) -> dict[str, Any]:
        row = model.row
        return build_job(
            model_ref=row.ref, model_key=row.key, relation=row.relation,
            source_model=row.source_model, output_url=self.output_url,
            settings=self.job_settings, attempt=attempt, affinity=affinity)

    def _is_ours(self, job: Mapping[str, Any], model: _Model) -> bool:
        """Same output and same worker args (model, parameters): this sweep's Job."""
        meta = job.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if (meta.get("labels") or {}).get(INSTANCE_LABEL) != self.instance:
            return False
        if annotations.get(MODEL_KEY_ANNOTATION) != model.row.key:
            return False
        containers = ((job.get("spec") or {}).get("template") or {}).get("spec", {}).get(
            "containers") or []
        args = next((c.get("args") for c in containers if c.get("name") == CONTAINER_NAME), None)
        return result_args(args or ()) == result_args(self._args_for(model))

    def _adopt(self) -> str:
        """List this sweep's Jobs: take their attempt numbers, adopt unfinished ones of
        listed models, and count finished ones as done (Complete) or as history."""
        items, rv = self.kube.list_jobs(self.settings.namespace, self.selector)
        latest: dict[str, tuple[int, dict[str, Any]]] = {}
        for job in items:
            meta = job.get("metadata") or {}
            key = (meta.get("annotations") or {}).get(MODEL_KEY_ANNOTATION)
            model = self._models.get(str(key))
            if model is None:
                continue
            try:
                attempt = int((meta.get("labels") or {}).get(ATTEMPT_LABEL) or 0)
            except ValueError:
                attempt = 0
            model.attempt = max(model.attempt, attempt)
            if self._is_ours(job, model) and attempt >= latest.get(model.row.key, (-1, {}))[0]:
                latest[model.row.key] = (attempt, job)
        for key, (_, job) in latest.items():
            model = self._models[key]
            state, _, _ = job_condition(job)
            if state is None:
                self._track(model, job["metadata"]["name"], adopted=True)
                self._on_job(job)
            elif state == "Complete" and self.adopt_complete:
                # Finished while no controller watched (the plan ran before it ended): the
                # recorder confirms the marker; without one it is recorded and retried later.
                self._track(model, job["metadata"]["name"], adopted=True)
                self._on_job(job)
            # A Failed Job of an earlier run is history: this run tries again (next attempt).
        if self.adopted:
            log.info("adopted %d Job(s) of this sweep already in namespace %s",
                     self.adopted, self.settings.namespace)
        return rv

    def _track(self, model: _Model, name: str, *, adopted: bool = False) -> None:
        model.name = name
        self._set_flight(model, True)
        model.submitted_at = self._clock()
        model.tries += 1
        self._by_name[name] = model.row.key
        if adopted:
            self.adopted += 1  # its queue entry is skipped when it comes up

    # -- submission ----------------------------------------------------------------------

    def _submit(self, now: float) -> None:
        """Create Jobs while the caps and GPU room allow.

        With telemetry, the nodes with room are ranked once per pass (most free GPUs first)
        and filled in that order, each until its free GPUs are reserved: ranking again for
        every Job would cost O(nodes) each, and packing a node before the next keeps whole
        nodes free for other work and for the autoscaler to remove.
        """
        self._room_blocked = False
        candidates: list[str] | None = None
        index = 0
        n = self.gpus_per_job
        while self._queue and not self._stop_requests:
            if len(self._flight) >= self.settings.max_active_jobs:
                return
            affinity: Mapping[str, Any] | None = None
            node: str | None = None
            if self._telemetry_state == "on" and n > 0:
                if candidates is None:
                    candidates = self.tracker.nodes_with_room(n)
                while index < len(candidates) and self.tracker.free_gpus(candidates[index]) < n:
                    index += 1
                if index < len(candidates):
                    node = candidates[index]
                    affinity = node_affinity([node], key="metadata.name")
                elif not self.settings.allow_pending:
                    self._room_blocked = True
                    return
            if self.settings.allow_pending and node is None:
                limit = self.settings.max_pending
                if limit is not None and len(self._waiting) >= limit:
                    self._room_blocked = True
                    return
            key = self._queue.popleft()
            model = self._models[key]
            if model.in_flight or model.finished:
                continue  # adopted, or queued twice
            self._create(model, node, affinity, now)

    def _create(self, model: _Model, node: str | None, affinity: Mapping[str, Any] | None,
                now: float) -> None:
        attempt = model.attempt + 1
        try:
            job = self._build(model, attempt, affinity)
        except JobSpecError as e:
            self._finish(model, "failed", Diagnosis(f"JobSpecError: {e}", False, None, None, ()))
            return
        name = job["metadata"]["name"]
        try:
            result = self.kube.create_job(self.settings.namespace, job)
        except self._k.KubeQuotaError as e:
            # A ResourceQuota is full: wait for something to finish, do not fail the sweep.
            self._queue.appendleft(model.row.key)
            self._room_blocked = True
            if not self._quota_said:
                log.warning("namespace %s is at its quota (%s): waiting for running Jobs "
                            "to finish", self.settings.namespace, e)
                self._quota_said = True
            return
        model.attempt = attempt
        if result == "exists":
            existing = self.kube.read_job(self.settings.namespace, name)
            if existing is None:  # deleted in between: try the next name on the next pass
                self._queue.appendleft(model.row.key)
                return
            if not self._is_ours(existing, model):
                output = ((existing.get("metadata") or {}).get("annotations") or {}).get(
                    OUTPUT_ANNOTATION, "?")
                self._finish(model, "failed", Diagnosis(
                    f"JobNameTaken: Job {name} in namespace {self.settings.namespace} exists "
                    f"but belongs to another sweep (output {output}, or other analysis "
                    "parameters): delete it, or run this sweep in another --namespace",
                    False, None, None, ()))
                return
            log.info("model=%s key=%s job=%s already exists: adopted", model.row.ref,
                     model.row.key, name)
            self._track(model, name, adopted=True)
            self._on_job(existing)
            return
        self.created += 1
        self._track(model, name)
        if node is not None:
            self.tracker.reserve(node, self.gpus_per_job)
            model.node = node
        log.info("model=%s key=%s job=%s submitted (attempt %d)%s", model.row.ref,
                 model.row.key, name, attempt, f" node={node}" if node else "")

    # -- watch events --------------------------------------------------------------------

    def _model_for(self, job: Mapping[str, Any]) -> _Model | None:
        key = self._by_name.get(str((job.get("metadata") or {}).get("name")))
        model = self._models.get(key) if key is not None else None
        if model is None or not model.in_flight or model.name != job["metadata"]["name"]:
            return None
        return model

    def _release(self, model: _Model) -> None:
        if model.node is not None:
            self.tracker.release(model.node, self.gpus_per_job)
            model.node = None

    def _on_job(self, job: Mapping[str, Any]) -> None:
        model = self._model_for(job)
        if model is None:
            return
        status = job.get("status") or {}
        if not model.running and (status.get("ready") or 0) >= 1:
            self._set_flight(model, True, running=True)
            model.running_at = self._clock()
            model.wait_s += max(model.running_at - model.submitted_at, 0.0)
            self._release(model)
            if model.row.key in self.pending:
                log.info("model=%s job=%s running after being pending", model.row.ref,
                         model.name)
        state, _, _ = job_condition(job)
        if state is None:
            return
        duration = _seconds(status.get("startTime"), status.get("completionTime")
                            or _last_transition(job))
        if duration is None:
            duration = self._clock() - (model.running_at or model.submitted_at)
        model.total_s += duration
        self._release(model)
        if state == "Complete":
            self._finish(model, "done", Diagnosis("", False, 0, None, ()), duration)
            return
        diagnosis = self._diagnose(job, model)
        retry = (diagnosis.retryable and model.tries <= self.max_retries
                 and not self._stop_requests)
        if retry:
            log.warning("model=%s key=%s job=%s failed (%s); resubmitting as attempt %d",
                        model.row.ref, model.row.key, model.name, diagnosis.error,
                        model.attempt + 1)
            self._set_flight(model, False)
            model.last = diagnosis
            self._queue.appendleft(model.row.key)  # a retry goes before fresh work
            return
        self._finish(model, "failed", diagnosis, duration)

    def _diagnose(self, job: Mapping[str, Any], model: _Model) -> Diagnosis:
        ns = self.settings.namespace
        name = str(job["metadata"]["name"])
        pods = self.kube.list_pods(ns, f"{JOB_NAME_LABEL}={name}")
        failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
        text = ""
        last = max(failed, key=_pod_sort_key) if failed else None
        if last is not None:
            text = self.kube.read_pod_log(ns, last["metadata"]["name"],
                                          tail_lines=self.settings.log_tail_lines)
        return diagnose_failure(job, pods, text, tail_lines=self.settings.log_tail_lines)

    def _on_deleted(self, job: Mapping[str, Any]) -> None:
        model = self._model_for(job)
        if model is None:
            return
        self._release(model)
        state, _, _ = job_condition(job)
        if state == "Complete":
            self._on_job(job)
            return
        log.warning("model=%s key=%s job=%s was deleted before it ended; resubmitting",
                    model.row.ref, model.row.key, model.name)
        self._set_flight(model, False)
        if model.tries <= self.max_retries and not self._stop_requests:
            self._queue.appendleft(model.row.key)
        else:
            self._finish(model, "failed", Diagnosis(
                f"JobDeleted: Job {model.name} was deleted before it ended", True, None, None,
                ()))

    def _on_relist(self, items: Sequence[Mapping[str, Any]]) -> None:
        """After 410 Gone: the list is the truth; Jobs in flight that are gone were deleted."""
        seen = set()
        for job in items:
            seen.add(job["metadata"]["name"])
            self._on_job(job)
        for key in list(self._flight):
            model = self._models[key]
            # A Job created after the list was taken is not in it: only one the API no
            # longer has was deleted (else the model would be submitted a second time).
            if model.name is not None and model.name not in seen and self.kube.read_job(
                self.settings.namespace, model.name
            ) is None:
                self._on_deleted({"metadata": {"name": model.name}, "status": {}})

    def _finish(self, model: _Model, status: str, diagnosis: Diagnosis,
                duration: float = 0.0) -> None:
        self._set_flight(model, False)
        model.finished = True
        model.last = None
        if status == "done":
            self.pending.pop(model.row.key, None)
        outcome = Outcome(
            task=Task(key=model.row.key, argv=(), label=model.row.ref),  # argv: in the Job
            status=status,
            exit_code=diagnosis.exit_code,
            signal=diagnosis.signal,
            attempts=max(model.tries, 1),
            duration_s=duration,
            total_s=model.total_s,
            wait_s=model.wait_s,
            gpus=(),
            stderr_tail=diagnosis.tail,
            log_path=(f"pod/{diagnosis.pod}" if diagnosis.pod else
                      (f"job/{model.name}" if model.name else None)),
            error=diagnosis.error,
            retryable=status != "done" and diagnosis.retryable,
        )
        self._outcomes.append(outcome)
        self._counts[status] = self._counts.get(status, 0) + 1
        if self.progress is not None:
            self.progress.record_duration(model.total_s)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    # -- telemetry -----------------------------------------------------------------------

    def _telemetry_targets(self) -> list[tuple[str, str | None]]:
        if self.settings.telemetry_urls:
            return [(url, None) for url in self.settings.telemetry_urls]
        ns = self.settings.telemetry_namespace or self.settings.namespace
        pods = self.kube.list_pods(ns, self.settings.telemetry_selector)
        out = []
        for pod in pods:
            status = pod.get("status") or {}
            ip = status.get("podIP")
            if status.get("phase") == "Running" and ip:
                host = f"[{ip}]" if ":" in str(ip) else str(ip)
                out.append((f"http://{host}:{self.settings.telemetry_port}/metrics",
                            (pod.get("spec") or {}).get("nodeName")))
        return out

    def _poll_telemetry(self, now: float) -> None:
        self._next_poll = now + self.poll_interval_s
        if not self.settings.telemetry or self.gpus_per_job < 1:
            self._telemetry_off("telemetry is off")
            return
        try:
            targets = self._telemetry_targets()
        except self._k.KubePermissionError as e:
            self._telemetry_off(f"cannot list the exporter pods ({e})")
            return
        if not targets:
            self._telemetry_off(
                f"no GPU exporter pods ({self.settings.telemetry_selector} in namespace "
                f"{self.settings.telemetry_namespace or self.settings.namespace})")
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="telemetry")

        def one(target: tuple[str, str | None]) -> list[NodeGpu]:
            url, node = target
            try:
                return self._scrape(url, default_node=node)
            except TelemetryError as e:
                log.debug("telemetry %s: %s", url, e)
                return []

        samples = [s for batch in self._pool.map(one, targets) for s in batch]
        if not samples and self._telemetry_state != "on":
            self._telemetry_off(f"{len(targets)} exporter(s) gave no GPU readings")
            return
        self.tracker.observe(samples)
        self._polls += 1
        if self._telemetry_state != "on":
            log.info("GPU telemetry from %d exporter(s): Jobs go to nodes whose GPUs stayed "
                     "under %g MiB for %d polls", len(targets), self.tracker.threshold_mib,
                     self.tracker.max_checks)
        self._telemetry_state = "on"

    def _telemetry_off(self, why: str) -> None:
        if self._telemetry_state == "on":
            if self.tracker.has_fresh_nodes():
                return  # keep the tracker's view while some node is still fresh
            # Every node went stale: pinning to nothing would stall the sweep for good.
            log.warning("GPU telemetry lost (%s): Jobs now only request nvidia.com/gpu and "
                        "the scheduler places them", why)
            self._telemetry_said_off = True
        self._telemetry_state = "off"
        if not self._telemetry_said_off:
            log.info("no GPU telemetry (%s): Jobs only request nvidia.com/gpu and the "
                     "scheduler places them", why)
            self._telemetry_said_off = True

    # -- pending diagnosis ---------------------------------------------------------------

    def _check_pending(self, now: float) -> None:
        timeout = self.settings.pending_timeout_s
        if now < self._next_pending_check or not self._waiting:
            return
        self._next_pending_check = now + min(timeout / 4, 30.0)
        for key in list(self._waiting):
            model = self._models[key]
            if model.name is None:
                continue
            if now - model.submitted_at < timeout or now - model.pending_checked_at < timeout:
                continue
            model.pending_checked_at = now
            job = self.kube.read_job(self.settings.namespace, model.name)
            if job is None:
                continue
            pods = self.kube.list_pods(self.settings.namespace, f"{JOB_NAME_LABEL}={model.name}")
            events: list[dict[str, Any]] = []
            for obj in [model.name, *(p["metadata"]["name"] for p in pods)]:
                events += self.kube.list_events(self.settings.namespace,
                                                f"involvedObject.name={obj}")
            reason = describe_pending(job, pods, events)
            self.pending[model.row.key] = reason
            log.warning("model=%s key=%s job=%s pending for %.0fs: %s", model.row.ref,
                        model.row.key, model.name, now - model.submitted_at, reason)

    def _update_progress(self) -> None:
        if self.progress is None:
            return
        self.progress.update(
            done=self._counts["done"], failed=self._counts["failed"],
            running=len(self._flight) - len(self._waiting),
            waiting=len(self._queue) + len(self._waiting))


def _last_transition(job: Mapping[str, Any]) -> str | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed"):
            return str(cond.get("lastTransitionTime") or "") or None
    return None


class _Watcher(threading.Thread):
    """Lists and watches the sweep's Jobs, handing events to the controller thread.

    Watches from the last resourceVersion seen; on 410 Gone lists again and hands the whole
    list over ("relist"). An API error that survived the client's retries ends the watch
    ("error"); the controller raises it.
    """

    def __init__(self, backend: ClusterBackend, rv: str,
                 out: queue.Queue[tuple[str, Any]]) -> None:
        super().__init__(name="esd-sweep-watch", daemon=True)
        self.backend = backend
        self.rv = rv
        self.out = out
        self._stopping = threading.Event()
        self.cpu_s = 0.0
        self.relists = 0

    def stop(self) -> None:
        """Ask the thread to end. It may sit in an open watch until the next event or the
        watch's timeout; it is a daemon, touches nothing of the controller's but the queue,
        and ends quietly then."""
        self._stopping.set()
        self.join(timeout=0.02)

    def run(self) -> None:
        b = self.backend
        ns, selector = b.settings.namespace, b.selector
        cpu0 = time.thread_time()
        try:
            while not self._stopping.is_set():
                try:
                    for event in b.kube.watch_jobs(ns, selector, self.rv,
                                                   timeout_s=b.settings.watch_timeout_s):
                        if event.resource_version:
                            self.rv = event.resource_version
                        if event.type != "BOOKMARK":
                            self.out.put(("event", event))
                        self.cpu_s = time.thread_time() - cpu0
                        if self._stopping.is_set():
                            return
                except b._k.ResourceVersionExpired:
                    log.info("watch of Jobs expired (410 Gone): listing again")
                    self.relists += 1
                    for tries in range(1, 6):
                        try:  # a long paged list can expire too (410 on its continue token)
                            items, self.rv = b.kube.list_jobs(ns, selector)
                            break
                        except b._k.ResourceVersionExpired:
                            if tries == 5:
                                raise
                    self.out.put(("relist", items))
        except Exception as e:  # handed to the controller thread, which raises it
            if not self._stopping.is_set():
                self.out.put(("error", e))
        finally:
            self.cpu_s = time.thread_time() - cpu0
