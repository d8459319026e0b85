"""A batch worker's results-tables parts: the models it finished, written as table parts
(esd_worker.core.store.tables) every few hundred models, every couple of minutes, and when
the batch ends or stops.

Owns the buffer of finished models (their models and layers rows, already as Arrow tables:
a few hundred bytes a layer row where Python dicts would take kilobytes), its bounds, when
it is written, and what a failed write does: nothing to the models. The tables are derived
data (the per-model files are the truth, and `esd-sweep compact` rebuilds the tables from
them), so a store that refuses a part costs one warning line and the buffer, never a model
or the batch; a worker killed hard loses only its buffer, which readers find again from the
per-model files (controller.results.tables' fallback). Does not own the columns, the part
keys nor how a part is written (esd_worker.core.store.tables), nor when a batch ends
(esd_worker.serve.runner).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from esd_worker.core.redact import redact
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import DoneModel, PartKey, part_tables, write_part

log = logging.getLogger("esd_worker")

MAX_MODELS = 256
MAX_LAYER_ROWS = 200_000  # about 50 MB of Arrow rows: a worker's memory stays bounded
MAX_AGE_S = 120.0


@dataclass(frozen=True)
class _Entry:
    arch: str
    models: pa.Table
    layers: pa.Table


class TableWriter:
    """Buffer done models and write them as parts, one per architecture.

    add(): a model whose marker is written. The buffer is written (flush) once it holds
    `max_models` models or `max_layer_rows` layer rows, or its oldest model is `max_age_s`
    old: on add(), and with start() also from a timer thread (a long-lived worker may idle
    between requests, or spend an hour on one model). close() writes what is left and stops
    the timer. Thread-safe. A model added twice (analysed again) keeps its last rows.
    """

    def __init__(self, store: Store, *, max_models: int = MAX_MODELS,
                 max_layer_rows: int = MAX_LAYER_ROWS, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.max_models, self.max_layer_rows, self.max_age_s = (
            max_models, max_layer_rows, max_age_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._buffer: dict[str, _Entry] = {}  # model_key → its rows, in the order added
        self._layer_rows = 0
        self._oldest: float | None = None
        self._closed = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.parts_written = 0
        self.models_written = 0

    @property
    def pending_models(self) -> int:
        return len(self._buffer)

    @property
    def pending_layer_rows(self) -> int:
        return self._layer_rows

    def add(self, done: DoneModel) -> None:
        """Buffer a done model's rows (writing the buffer when it is full or old); never
        raises: a model whose rows cannot be made is left to the per-model files."""
        try:
            (arch, (models, layers)), = part_tables([done]).items()
        except Exception as e:  # a row the schema refuses: the tables' bug, not the model's
            log.warning("results tables: model_key=%s left out of this worker's parts (%s); "
                        "`esd-sweep compact` adds it from its files", done.marker.model_key,
                        redact(str(e)))
            return
        with self._lock:
            old = self._buffer.pop(done.marker.model_key, None)
            if old is not None:
                self._layer_rows -= old.layers.num_rows
            self._buffer[done.marker.model_key] = _Entry(arch, models, layers)
            self._layer_rows += layers.num_rows
            if self._oldest is None:
                self._oldest = self._clock()
            if self._closed or self._due():
                self.flush()

    def _due(self) -> bool:
        return bool(self._buffer) and (
            len(self._buffer) >= self.max_models or self._layer_rows >= self.max_layer_rows
            or (self._oldest is not None and self._clock() - self._oldest >= self.max_age_s))

    def flush(self) -> list[PartKey]:
        """Write the buffer as parts (one per architecture) and empty it; the parts written.
        A failed write logs one warning and drops the buffer (derived data: see the module
        docstring); the parts of other architectures written before it stay."""
        with self._lock:
            entries, self._buffer = list(self._buffer.values()), {}
            self._layer_rows, self._oldest = 0, None
            if not entries:
                return []
            by_arch: dict[str, list[_Entry]] = {}
            for entry in entries:
                by_arch.setdefault(entry.arch, []).append(entry)
            written: list[PartKey] = []
            left = len(entries)
            try:
                for arch, group in by_arch.items():
                    written.append(write_part(
                        self.store, arch, pa.concat_tables([e.models for e in group]),
                        pa.concat_tables([e.layers for e in group])))
                    left -= len(group)
            except Exception as e:  # StoreError, a full disk, a bug in a part: never a model's
                log.warning("results tables: %d finished model(s) not written as a table part "
                            "(%s); their own files hold them and `esd-sweep compact` adds them "
                            "to the tables", left, redact(str(e)))
            self.parts_written += len(written)
            self.models_written += len(entries) - left
            return written

    def start(self) -> TableWriter:
        """Also write the buffer from a timer thread once it is `max_age_s` old."""
        with self._lock:
            if self._timer is None and not self._closed:
                self._timer = threading.Thread(target=self._tick, name="esd-table-writer",
                                               daemon=True)
                self._timer.start()
        return self

    def _tick(self) -> None:
        interval = max(0.01, min(10.0, self.max_age_s / 4))
        while not self._stop.wait(interval):
            with self._lock:
                if self._due():
                    self.flush()

    def close(self) -> list[PartKey]:
        """Stop the timer and write what is left; a model added after this is written at
        once."""
        self._stop.set()
        timer, self._timer = self._timer, None
        if timer is not None and timer is not threading.current_thread():
            timer.join()
        with self._lock:
            self._closed = True
            return self.flush()
