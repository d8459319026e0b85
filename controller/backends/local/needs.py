"""How many GPUs each model of a local run wants, known by the time it is dispatched.

Owns when the GPU rule's shape lookups happen on this machine: a model whose shape needs no
network (list columns, a local directory's headers) is answered when dispatch asks; a hub
model is looked up ahead of dispatch by one background thread, in queue order and at most
`lookahead` models ahead, so the run loop never waits on HTTP (it leaves a model whose
answer is not there yet at the head of the queue and comes back on its next pass). Does not
estimate (controller.gpu.gpurule), find shapes (controller.weights.weightmeta) or place workers
(controller.backends.local.slots).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from controller.backends.base import Task
from controller.gpu.counts import GpuCounts
from esd_worker.core.models.modellist import ModelRow

log = logging.getLogger(__name__)

LOOKAHEAD = 32  # hub models looked up ahead of dispatch at most: a stopped run wastes few


class GpuNeeds:
    """GPUs per model task: `fixed` for all when `counts` is None (no model can get more
    than one, or an explicit --gpus-per-job), else counts(row). rows: the run's models, in
    queue order (adapter bases are found among them)."""

    def __init__(self, counts: GpuCounts | None, fixed: int, rows: Sequence[ModelRow] = (),
                 *, lookahead: int = LOOKAHEAD) -> None:
        self.counts = counts
        self.fixed = fixed
        self._rows = list(rows) if counts is not None else []
        self._listed = {row.key: row for row in self._rows}
        self._known: dict[str, int] = {}
        self._lookahead = max(1, lookahead)
        self._dispatched = 0
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        if counts is not None and any(counts.finder.needs_hub(r, self._listed.get)
                                      for r in self._rows):
            self._thread = threading.Thread(target=self._look_ahead, name="gpu-needs",
                                            daemon=True)
            self._thread.start()

    def want(self, task: Task) -> int | None:
        """The task's GPU count; None while its hub lookup is still under way."""
        row = task.row
        if self.counts is None or row is None or task.argv:
            return self.fixed
        with self._wake:
            known = self._known.get(row.key)
        if known is not None:
            return known
        if self.counts.finder.needs_hub(row, self._listed.get):
            return None  # the look-ahead thread answers it
        return self._decide(row)

    def taken(self) -> None:
        """Dispatch took a model: the look-ahead may go one further."""
        with self._wake:
            self._dispatched += 1
            self._wake.notify_all()

    def close(self) -> None:
        """Stop looking ahead; log the rule's tally once."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self.counts is not None:
            self.counts.log_stats()

    def _decide(self, row: ModelRow) -> int:
        assert self.counts is not None
        try:
            gpus = self.counts(row, self._listed.get)
        except Exception:  # a bug here must not stall dispatch: the model gets the default
            log.exception("model=%s: the GPU rule failed; it gets %d GPU(s)", row.ref,
                          self.fixed)
            gpus = self.fixed
        with self._wake:
            self._known[row.key] = gpus
        return gpus

    def _look_ahead(self) -> None:
        assert self.counts is not None
        for index, row in enumerate(self._rows):
            with self._wake:
                while not self._closed and index >= self._dispatched + self._lookahead:
                    self._wake.wait()
                if self._closed:
                    return
                if row.key in self._known:
                    continue
            if self.counts.finder.needs_hub(row, self._listed.get):
                self._decide(row)
