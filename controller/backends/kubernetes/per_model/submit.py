"""Getting each model a Job: adopting this sweep's Jobs found at start, and creating the rest.

Owns the rules that keep a model from running twice: a Job is this sweep's when it has the
sweep's instance label, the model's key and the same result-changing worker args; names
are pure functions of model key and attempt, so a 409 on create is read back and adopted
(or refused as another sweep's). Submits as the caps allow (max_active_jobs, max_pending,
GPU room from Placement, a full ResourceQuota). Does not watch (controller.backends
.kubernetes.watch, .events) or build Job objects (.jobs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.diagnosis import Diagnosis, job_condition
from controller.backends.kubernetes.common.errors import JobSpecError, KubeQuotaError
from controller.backends.kubernetes.common.jobs import CONTAINER_NAME, JobSettings, build_job
from controller.backends.kubernetes.common.names import (
    ATTEMPT_LABEL,
    INSTANCE_LABEL,
    MODEL_KEY_LABEL,
    OUTPUT_ANNOTATION,
)
from controller.backends.kubernetes.common.placement import Placement
from controller.backends.kubernetes.common.settings import ClusterSettings, result_invocation
from controller.backends.kubernetes.per_model.events import JobEvents
from controller.backends.kubernetes.per_model.state import ModelState, ModelTable
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import parse_ref

SizeFn = Callable[[ModelRow], int]
Listed = Callable[[str], "ModelRow | None"]
GpuFn = Callable[[ModelRow, "Listed | None"], int]  # controller.gpu.counts.GpuCounts

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)


def model_job_settings(
    cluster: ClusterSettings, job: JobSettings, row: ModelRow, size: SizeFn | None,
    listed: Listed | None = None, gpus: int | None = None,
) -> JobSettings:
    """`job` with the memory and disk one model's pod asks for: sized from the bytes of its
    weights (and an adapter's base, downloaded with it), known before any download (size:
    controller.weights.sizing.Sizer.size; None: unknown, the settings' defaults). listed: the run's
    row of a model key, if listed, so a base in the list is sized from its own row (its
    size_bytes column). gpus: the GPU rule's count for this model (a GPU Job asks for it
    instead of the run's; None: the run's)."""
    if gpus is not None and job.gpus_per_job > 0:
        job = replace(job, gpus_per_job=gpus)
    if size is None:
        return job
    total = size(row)
    if row.is_adapter and row.source_model:
        model_id, revision, problem = parse_ref(row.source_model)
        if problem is None:
            base = ModelRow(model_id, revision, "", None)
            total += size((listed(base.key) if listed else None) or base)
    return cluster.sized_for(job, total, copies=1)


class Submitter:
    """Adopts and creates the Jobs of the models in a ModelTable.

    adopt_complete: a Complete Job of this sweep found at start counts as done (the
    recorder then confirms its marker); False (--overwrite) makes it history and the model
    runs again. `created`, `adopted`: Jobs of this run, for the run report. `blocked`:
    the last pass stopped for lack of room (a cap, GPUs, quota), not for lack of work.
    """

    def __init__(
        self, table: ModelTable, events: JobEvents, kube: KubeClient,
        settings: ClusterSettings, placement: Placement, *, job_settings: JobSettings,
        output_url: str, selector: str, adopt_complete: bool, stopping: Callable[[], bool],
        size: SizeFn | None = None, gpus: GpuFn | None = None,
    ) -> None:
        self.table = table
        self.events = events
        self.kube = kube
        self.settings = settings
        self.placement = placement
        self.job_settings = job_settings
        self.output_url = output_url
        self.selector = selector
        self.adopt_complete = adopt_complete
        self.stopping = stopping
        self.size = size
        self.gpus = gpus
        self.created = 0
        self.adopted = 0
        self.blocked = False
        self._quota_said = False

    def _listed(self, key: str) -> ModelRow | None:
        model = self.table.models.get(key)
        return model.row if model is not None else None

    # -- adoption ---------------------------------------------------------------------------

    def _build(self, model: ModelState, attempt: int, affinity: Mapping[str, Any] | None,
               *, sized: bool = True) -> dict[str, Any]:
        """The model's Job; sized=False: with the unsized requests (for its args only, which
        the sizes do not change: no size lookup)."""
        row = model.row
        settings = self.job_settings
        if sized:
            settings = model_job_settings(self.settings, settings, row, self.size, self._listed,
                                          self._gpus_of(model))
        return build_job(
            model_ref=row.ref, model_key=row.key, relation=row.relation,
            source_model=row.source_model, output_url=self.output_url, settings=settings,
            attempt=attempt, affinity=affinity)

    def _gpus_of(self, model: ModelState) -> int:
        """The GPUs the model's Jobs ask for, decided once (the rule's lookups are memoised
        too, but its log line is once per model)."""
        if model.gpus is None:
            base = self.job_settings.gpus_per_job
            model.gpus = base if self.gpus is None or base == 0 else self.gpus(
                model.row, self._listed)
        return model.gpus

    def _args_for(self, model: ModelState) -> tuple[str, ...]:
        if not model.args:
            job = self._build(model, 0, None, sized=False)
            model.args = tuple(job["spec"]["template"]["spec"]["containers"][0]["args"])
        return model.args

    def is_ours(self, job: Mapping[str, Any], model: ModelState) -> bool:
        """Same output and same worker args (model, parameters): this sweep's Job."""
        meta = job.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if (meta.get("labels") or {}).get(INSTANCE_LABEL) != self.job_settings.instance:
            return False
        if annotations.get(MODEL_KEY_LABEL) != model.key:
            return False
        containers = ((job.get("spec") or {}).get("template") or {}).get("spec", {}).get(
            "containers") or []
        args = next((c.get("args") for c in containers if c.get("name") == CONTAINER_NAME), None)
        ours = result_invocation(self._args_for(model))
        return ours is not None and result_invocation(args or ()) == ours

    def adopt(self) -> str:
        """List this sweep's Jobs: take their attempt numbers, adopt unfinished ones of
        listed models, and count finished ones as done (Complete) or as history. Returns
        the list's resourceVersion (the watch starts there)."""
        items, rv = self.kube.list_jobs(self.settings.namespace, self.selector)
        latest: dict[str, tuple[int, dict[str, Any]]] = {}
        for job in items:
            meta = job.get("metadata") or {}
            key = (meta.get("annotations") or {}).get(MODEL_KEY_LABEL)
            model = self.table.models.get(str(key))
            if model is None:
                continue
            try:
                attempt = int((meta.get("labels") or {}).get(ATTEMPT_LABEL) or 0)
            except ValueError:
                attempt = 0
            model.attempt = max(model.attempt, attempt)
            if self.is_ours(job, model) and attempt >= latest.get(model.key, (-1, {}))[0]:
                latest[model.key] = (attempt, job)
        for key, (_, job) in latest.items():
            model = self.table.models[key]
            state, _, _ = job_condition(job)
            # Complete: finished while no controller watched (the plan ran before it ended):
            # the recorder confirms the marker; without one it is recorded and retried later.
            # A Failed Job of an earlier run is history: this run tries again (next attempt).
            if state is None or (state == "Complete" and self.adopt_complete):
                self._adopt_one(model, job)
        if self.adopted:
            log.info("adopted %d Job(s) of this sweep already in namespace %s",
                     self.adopted, self.settings.namespace)
        return rv

    def _adopt_one(self, model: ModelState, job: Mapping[str, Any]) -> None:
        self.table.track(model, job["metadata"]["name"])
        self.adopted += 1  # its queue entry is skipped when it comes up
        self.events.on_job(job)

    # -- submission -------------------------------------------------------------------------

    def submit(self, now: float) -> None:
        """Create Jobs while the caps and GPU room allow (nodes ranked once per pass:
        Placement.start_pass)."""
        table = self.table
        self.blocked = False
        self.placement.start_pass()
        while table.queue and not self.stopping():
            if len(table.flight) >= self.settings.max_active_jobs:
                return
            model = table.models[table.queue[0]]
            if model.in_flight or model.finished:
                table.queue.popleft()
                continue  # adopted, or queued twice
            node: str | None = None
            if self.placement.pinning:
                node = self.placement.next_node(self._gpus_of(model))
                if node is None and not self.settings.allow_pending:
                    self.blocked = True
                    return
            if self.settings.allow_pending and node is None:
                limit = self.settings.max_pending
                if limit is not None and len(table.waiting) >= limit:
                    self.blocked = True
                    return
            table.queue.popleft()
            self._create(model, node)

    def _create(self, model: ModelState, node: str | None) -> None:
        attempt = model.attempt + 1
        affinity = self.placement.affinity(node) if node is not None else None
        try:
            job = self._build(model, attempt, affinity)
        except JobSpecError as e:
            self.table.finish(model, "failed",
                              Diagnosis(f"JobSpecError: {e}", False, None, None, ()))
            return
        name = job["metadata"]["name"]
        ns = self.settings.namespace
        try:
            result = self.kube.create_job(ns, job)
        except KubeQuotaError as e:
            # A ResourceQuota is full: wait for something to finish, do not fail the sweep.
            self.table.queue.appendleft(model.key)
            self.blocked = True
            if not self._quota_said:
                log.warning("namespace %s is at its quota (%s): waiting for running Jobs "
                            "to finish", ns, e)
                self._quota_said = True
            return
        model.attempt = attempt
        if result == "exists":
            self._on_exists(model, name)
            return
        self.created += 1
        self.table.track(model, name)
        if node is not None:
            self.placement.reserve(node, model.gpus)
            model.node = node
        log.info("model=%s key=%s job=%s submitted (attempt %d)%s", model.row.ref,
                 model.key, name, attempt, f" node={node}" if node else "")

    def _on_exists(self, model: ModelState, name: str) -> None:
        """409 on create: adopt the Job if it is this sweep's, else fail the model."""
        ns = self.settings.namespace
        existing = self.kube.read_job(ns, name)
        if existing is None:  # deleted in between: try the next name on the next pass
            self.table.queue.appendleft(model.key)
            return
        if not self.is_ours(existing, model):
            output = ((existing.get("metadata") or {}).get("annotations") or {}).get(
                OUTPUT_ANNOTATION, "?")
            self.table.finish(model, "failed", Diagnosis(
                f"JobNameTaken: Job {name} in namespace {ns} exists "
                f"but belongs to another sweep (output {output}, or other analysis "
                "parameters): delete it, or run this sweep in another --namespace",
                False, None, None, ()))
            return
        log.info("model=%s key=%s job=%s already exists: adopted", model.row.ref,
                 model.key, name)
        self._adopt_one(model, existing)
