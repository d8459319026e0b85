"""Each model's GPU count: its weight shape (controller.weights.weightmeta.ShapeFinder) through
the GPU rule (controller.gpu.gpurule), capped by what the backend can give.

Owns the per-run bookkeeping of that decision: one log line per model that gets several GPUs,
the tally of where shapes came from, one line at the end for the shapes that stayed unknown
(those models get one GPU). Does not find shapes nor pick GPUs (the backends do).
"""

from __future__ import annotations

import logging
import threading

from controller.gpu.gpurule import GpuRule, describe
from controller.weights.weightmeta import (
    PARAMS_COLUMN,
    WIDTH_COLUMN,
    Listed,
    ShapeFinder,
    ShapeStats,
    WeightShape,
)
from esd_worker.core.models.modellist import ModelRow

log = logging.getLogger(__name__)

_COUNTED_KEYS = 100_000  # models remembered as counted in the stats (beyond: counted again)


class GpuCounts:
    """Each model's GPU count: its shape (`finder`) through `rule`, at most `cap` GPUs.

    Logs the reason once per model that gets several GPUs; shapes that stay unknown get 1
    and are counted (stats) for one line at the end (log_stats). Thread-safe: the local
    backend asks from a look-ahead thread too."""

    def __init__(self, rule: GpuRule, finder: ShapeFinder, cap: int) -> None:
        self.rule = rule
        self.finder = finder
        self.cap = max(1, cap)
        self.stats = ShapeStats()
        self._logged: set[str] = set()
        self._counted: set[str] = set()  # models in stats (a sharded plan asks twice)
        self._lock = threading.Lock()

    def __call__(self, row: ModelRow, listed: Listed | None = None) -> int:
        return self.decide(row, listed)[0]

    def decide(self, row: ModelRow,
               listed: Listed | None = None) -> tuple[int, WeightShape | None]:
        """(the model's GPU count, the shape it came from; None: not looked up or unknown)."""
        if not self.rule.splits(self.cap):
            return self.rule.base, None
        shape = self.finder.shape(row, listed)
        gpus = self.rule.gpus(shape, cap=self.cap)
        with self._lock:
            if row.key not in self._counted:
                source = shape.source if shape is not None else "unknown"
                setattr(self.stats, source, getattr(self.stats, source) + 1)
                if len(self._counted) < _COUNTED_KEYS:
                    self._counted.add(row.key)
            first = gpus > 1 and shape is not None and row.key not in self._logged
            if first:
                self._logged.add(row.key)
        if first and shape is not None:
            log.info("%s", describe(row.ref, shape, gpus))
        return gpus, shape

    def log_stats(self) -> None:
        """One line: how many models got several GPUs, and how many had no known shape."""
        s = self.stats
        if not (s.column or s.local or s.hub or s.unknown):
            return
        level = logging.WARNING if s.unknown else logging.INFO
        log.log(level, "GPU rule: shapes of %d model(s) from the %s/%s columns, %d local, %d "
                "from the hub; %d on several GPUs; %d of unknown shape got one GPU%s",
                s.column, PARAMS_COLUMN, WIDTH_COLUMN, s.local, s.hub, len(self._logged),
                s.unknown, f" (add a {PARAMS_COLUMN} column to the list to size them)"
                if s.unknown else "")
