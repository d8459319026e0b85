"""What the controller does with what the watch saw: a Job running, ended, deleted, pending.

Owns turning Job states into model states: a Job running (its GPUs reservation released),
Complete (done), Failed (diagnosed from its pods and log, then retried as a new attempt or
finished, with a ModelFailed Event on its Job: common.jobevents), deleted before it ended
(resubmitted), missing after a relist (confirmed gone with a GET first), and too long
pending (explained in `pending`). Runs on the controller
thread only; does not create Jobs (controller.backends.kubernetes.per_model.submit does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.diagnosis import (
    Diagnosis,
    config_error,
    describe_pending,
    diagnose_failure,
    job_condition,
    last_transition,
    pod_sort_key,
    seconds_between,
)
from controller.backends.kubernetes.common.jobevents import (
    JobEventRecorder,
    failure_line,
    foreign,
)
from controller.backends.kubernetes.common.kueue import queued_workloads
from controller.backends.kubernetes.common.names import JOB_NAME_LABEL
from controller.backends.kubernetes.common.placement import Placement
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.per_model.state import ModelState, ModelTable
from controller.errors import InfrastructureError

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)


class JobEvents:
    """Applies Job events to the ModelTable. max_retries: new Jobs a model may get after
    its first for retryable failures; stopping: whether a stop was requested (no retry is
    queued then). `pending`: model key → why its Job is not running (the run report's).
    recorder: the run's Events on its Jobs (None: none)."""

    def __init__(
        self, table: ModelTable, kube: KubeClient, settings: ClusterSettings,
        placement: Placement, *, max_retries: int, stopping: Callable[[], bool],
        recorder: JobEventRecorder | None = None,
    ) -> None:
        self.recorder = recorder
        self.table = table
        self.kube = kube
        self.settings = settings
        self.placement = placement
        self.max_retries = max_retries
        self.stopping = stopping
        self.pending: dict[str, str] = {}
        self._next_pending_check = 0.0

    def release(self, model: ModelState) -> None:
        """Give back the GPUs reserved for the model's pod on its node (it runs, or ended)."""
        if model.node is not None:
            self.placement.release(model.node, model.gpus)
            model.node = None

    def on_job(self, job: Mapping[str, Any]) -> None:
        """A Job was added or changed (or found in a list)."""
        table = self.table
        model = table.model_for(job)
        if model is None:
            return
        status = job.get("status") or {}
        if not model.running and (status.get("ready") or 0) >= 1:
            table.set_flight(model, True, running=True)
            model.running_at = table.clock()
            model.wait_s += max(model.running_at - model.submitted_at, 0.0)
            self.release(model)
            if model.key in self.pending:
                log.info("model=%s job=%s running after being pending", model.row.ref,
                         model.name)
        state, _, _ = job_condition(job)
        if state is None:
            return
        duration = seconds_between(status.get("startTime"), status.get("completionTime")
                                   or last_transition(job))
        if duration is None:
            duration = table.clock() - (model.running_at or model.submitted_at)
        model.total_s += duration
        self.release(model)
        if state == "Complete":
            self.pending.pop(model.key, None)
            table.finish(model, "done", Diagnosis("", False, 0, None, ()), duration)
            return
        diagnosis = self._diagnose(job)
        if diagnosis.retryable and model.tries <= self.max_retries and not self.stopping():
            log.warning("model=%s key=%s job=%s failed (%s); resubmitting as attempt %d",
                        model.row.ref, model.key, model.name, diagnosis.error,
                        model.attempt + 1)
            table.set_flight(model, False)
            model.last = diagnosis
            table.queue.appendleft(model.key)  # a retry goes before fresh work
            return
        if self.recorder is not None:
            self.recorder.warning(job, "ModelFailed", (
                f"model {model.row.ref} failed after {max(model.tries, 1)} Job(s) ("
                f"{'retryable' if diagnosis.retryable else 'permanent'}): "
                f"{failure_line(diagnosis.error, diagnosis.tail)}"))
        table.finish(model, "failed", diagnosis, duration)

    def _diagnose(self, job: Mapping[str, Any]) -> Diagnosis:
        ns = self.settings.namespace
        name = str(job["metadata"]["name"])
        pods = self.kube.list_pods(ns, f"{JOB_NAME_LABEL}={name}")
        failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
        text = ""
        last = max(failed, key=pod_sort_key) if failed else None
        if last is not None:
            text = self.kube.read_pod_log(ns, last["metadata"]["name"],
                                          tail_lines=self.settings.log_tail_lines)
        return diagnose_failure(job, pods, text, tail_lines=self.settings.log_tail_lines)

    def on_deleted(self, job: Mapping[str, Any]) -> None:
        """A Job was deleted: done if it had completed, else the model goes again."""
        model = self.table.model_for(job)
        if model is None:
            return
        self.release(model)
        state, _, _ = job_condition(job)
        if state == "Complete":
            self.on_job(job)
            return
        log.warning("model=%s key=%s job=%s was deleted before it ended; resubmitting",
                    model.row.ref, model.key, model.name)
        self.table.set_flight(model, False)
        if model.tries <= self.max_retries and not self.stopping():
            self.table.queue.appendleft(model.key)
        else:
            self.table.finish(model, "failed", Diagnosis(
                f"JobDeleted: Job {model.name} was deleted before it ended", True, None, None,
                ()))

    def on_relist(self, items: Sequence[Mapping[str, Any]]) -> None:
        """After 410 Gone: the list is the truth; Jobs in flight that are gone were deleted."""
        seen = set()
        for job in items:
            seen.add(job["metadata"]["name"])
            self.on_job(job)
        for key in list(self.table.flight):
            model = self.table.models[key]
            # A Job created after the list was taken is not in it: only one the API no
            # longer has was deleted (else the model would be submitted a second time).
            if model.name is not None and model.name not in seen and self.kube.read_job(
                self.settings.namespace, model.name
            ) is None:
                self.on_deleted({"metadata": {"name": model.name}, "status": {}})

    def _check_config(self, ns: str) -> None:
        """End the run at once when the oldest waiting Job's pod can never start (a required
        Secret missing: CreateContainerConfigError): every waiting Job shares its spec, so
        they are deleted (a later run must not adopt them) and no pending timeout waited."""
        waiting = [m for k in self.table.waiting if (m := self.table.models[k]).name]
        if not waiting:
            return
        oldest = min(waiting, key=lambda m: m.submitted_at)
        line = config_error(self.kube.list_pods(ns, f"{JOB_NAME_LABEL}={oldest.name}"),
                            namespace=ns, hf_token_secret=self.settings.hf_token_secret)
        if line is not None:
            for model in waiting:
                self.kube.delete_job(ns, str(model.name))
            raise InfrastructureError(f"{line} ({len(waiting)} Job(s) not started deleted)")

    def check_pending(self, now: float) -> None:
        """Explain Jobs not running after pending_timeout_s (each at most once per timeout)."""
        timeout = self.settings.pending_timeout_s
        if now < self._next_pending_check or not self.table.waiting:
            return
        self._next_pending_check = now + min(timeout / 4, 30.0)
        ns = self.settings.namespace
        self._check_config(ns)
        for key in list(self.table.waiting):
            model = self.table.models[key]
            if model.name is None:
                continue
            if now - model.submitted_at < timeout or now - model.pending_checked_at < timeout:
                continue
            model.pending_checked_at = now
            job = self.kube.read_job(ns, model.name)
            if job is None:
                continue
            pods = self.kube.list_pods(ns, f"{JOB_NAME_LABEL}={model.name}")
            events: list[dict[str, Any]] = []
            for obj in [model.name, *(p["metadata"]["name"] for p in pods)]:
                # The sweep's own Events on its Job explain nothing about why it waits.
                events += foreign(self.kube.list_events(ns, f"involvedObject.name={obj}"))
            reason = describe_pending(job, pods, events,
                                      queued_workloads(self.kube, self.settings, job))
            self.pending[model.key] = reason
            log.warning("model=%s key=%s job=%s pending for %.0fs: %s", model.row.ref,
                        model.key, model.name, now - model.submitted_at, reason)

