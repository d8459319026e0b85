"""How many bytes a sharded run's pods may hold downloaded, and the models that pass it.

Owns the download budget of one resource class's pods, as the worker is given it
(--cache-budget, else the pod's disk request less the headroom when the downloads go to
that disk), and the models the shard plan keeps out of every shard because their download
(with an adapter's base) passes it: each one's ModelTooLarge line, logged for the first few
and kept for its outcome. Does not plan shards (.sharding, .plan) or build Jobs (.indexed).
"""

from __future__ import annotations

import logging

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.jobs import JobSettings
from controller.backends.kubernetes.common.resources import ResourceClass, cache_budget
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.sharded.plan import Item, too_big_error

log = logging.getLogger(__name__)

_LOGGED = 5  # models past their class's budget logged one by one; the rest counted


class DownloadBudgets:
    """The download budgets of a run's classes (of), and the models too big for theirs
    (too_big: the shard plan's on_too_big; errors: model key -> its ModelTooLarge line,
    few, as a list of mostly oversized models is a flag to fix)."""

    def __init__(self, settings: ClusterSettings, job_settings: JobSettings,
                 spec: WorkerSpec) -> None:
        self.settings = settings
        self.job_settings = job_settings
        self.spec = spec
        self.errors: dict[str, str] = {}

    def of(self, cls: ResourceClass) -> int | None:
        """The bytes a pod of `cls` may hold downloaded at once, as the backend's Job gives
        it to the worker: --cache-budget, else, when the downloads go to the pod's own disk
        (no --cache-dir, no --hf-cache-pvc), its disk request less the headroom; None: not
        known here (a shared cache's size is the volume's)."""
        budget = self.spec.batch().cache_budget
        if budget is not None or self.spec.cache_dir or self.settings.hf_cache_pvc:
            return budget
        return cache_budget(self._disk(cls))

    def too_big(self, item: Item, cls: ResourceClass, budget: int) -> None:
        """Record `item` as too big for `cls`'s pods (logged for the first few)."""
        if self.spec.batch().cache_budget is not None:
            remedy = "raise --cache-budget (and the pods' disk with it)"
        else:
            remedy = (f"they ask for {self._disk(cls)} of ephemeral storage, less the "
                      "headroom; raise --ephemeral-storage-request (on nodes with that much "
                      "disk: node-local NVMe) or give --hf-cache-pvc")
        error = too_big_error(item, cls, budget, remedy)
        if len(self.errors) < _LOGGED:
            log.warning("model=%s: %s", item.ref, error)
        self.errors[item.key] = error

    def log_count(self) -> None:
        if self.errors:
            log.warning("%d model(s) fit no class's download budget and are not sharded "
                        "(each fails with ModelTooLarge)", len(self.errors))

    def _disk(self, cls: ResourceClass) -> str | None:
        return self.settings.for_class(self.job_settings, cls).ephemeral_storage_request
