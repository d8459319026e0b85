"""One run's metrics in its own CollectorRegistry, and what feeds them.

Owns the metric names, types and labels (docs/operations.md "Metrics" lists them; a test
holds the two together) and the arithmetic from what the run knows to what is exported:
Progress counts (controller.progress.ProgressObserver), each resource class's progress
(ClassProgress, from a sharded Kubernetes run) and each model's end (the recorder's
verdict, controller.run.recorder). Not owned: serving them (server.py), nor how a failure's
domain is decided (domains.py).

Why a private registry: the process-wide default one holds whatever any import registered;
a run serves exactly its own metrics, and tests make as many runs as they like.
Why counters by deltas: Progress and ClassProgress give totals so far; Prometheus' rate()
needs counters, so each new total adds what it grew by (a total that shrinks, a restarted
shard's bytes, adds nothing and becomes the new base).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from controller.backends.base import Outcome
from controller.metrics.domains import error_class, fault_domain
from controller.progress import ClassProgress

PREFIX = "esd_sweep_"
MODEL_STATES = ("done", "failed", "running", "waiting", "to_do")
CLASS_STATES = ("done", "failed", "running", "pending")
# Seconds: a tiny model on a CPU (a second) to a large one on a GPU (hours).
DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800)


class RunMetrics:
    """The metrics of one run (`esd-sweep run`): a ProgressObserver, and `ended` for the
    recorder. Safe to call from any thread (the run's, the Kubernetes watch's)."""

    def __init__(self, *, run_id: str, backend: str, version: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._done = 0
        self._planned = 0
        self._bytes: dict[str, int] = {}
        r = self.registry
        Info(PREFIX + "run", "The run: its id, backend and esd-sweep version.",
             registry=r).info({"run_id": run_id, "backend": backend, "version": version})
        self.start_time = Gauge(PREFIX + "run_start_time_seconds",
                                "When the run started, Unix time.", registry=r)
        self.start_time.set(clock())
        self.last_progress = Gauge(
            PREFIX + "last_progress_time_seconds",
            "When the run last reported progress (counts or classes), Unix time; the start "
            "until the first report.", registry=r)
        self.last_progress.set(clock())
        self.planned = Gauge(PREFIX + "run_models",
                             "Models this run analyses (the plan's to-do).", registry=r)
        self.models = Gauge(PREFIX + "models", "Models of this run by state (done, failed, "
                            "running, waiting for a device, to_do: not finished).",
                            ["state"], registry=r)
        self.done_total = Counter(PREFIX + "models_done",
                                  "Models this run finished with a result.", registry=r)
        self.failures = Counter(PREFIX + "failures", "Models this run failed, by cause (error "
                                "class), fault domain and whether a retry could help.",
                                ["cause", "fault_domain", "retryable"], registry=r)
        self.duration = Histogram(PREFIX + "model_duration_seconds",
                                  "Run time of a model's last attempt, by outcome.",
                                  ["outcome"], buckets=DURATION_BUCKETS, registry=r)
        self.wait = Histogram(PREFIX + "model_wait_seconds", "Time a model waited for a GPU, "
                              "a CPU slot or a node, all attempts.",
                              buckets=DURATION_BUCKETS, registry=r)
        self.attempts = Counter(PREFIX + "model_attempts",
                                "Attempts started for the models that ended.", registry=r)
        self.class_models = Gauge(PREFIX + "class_models",
                                  "Models of a resource class by state.",
                                  ["resource_class", "state"], registry=r)
        self.class_shards = Gauge(PREFIX + "class_shards",
                                  "Shards of a resource class by state.",
                                  ["resource_class", "state"], registry=r)
        self.downloaded = Counter(PREFIX + "downloaded_bytes",
                                  "Bytes a resource class's workers downloaded.",
                                  ["resource_class"], registry=r)
        self.busy = Gauge(PREFIX + "device_busy_ratio", "Share of its workers' time a "
                          "resource class's devices were busy (device seconds / worker "
                          "seconds).", ["resource_class"], registry=r)
        for state in MODEL_STATES:
            self.models.labels(state=state).set(0)

    def plan(self, models: int) -> None:
        """The run analyses `models` models (before the first counts)."""
        with self._lock:
            self._planned = models
        self.planned.set(models)
        self.models.labels(state="to_do").set(models)

    # ProgressObserver ---------------------------------------------------------------------

    def counts(self, *, done: int, failed: int, running: int, waiting: int) -> None:
        with self._lock:
            if done > self._done:
                self.done_total.inc(done - self._done)
            self._done = max(self._done, done)
            planned = self._planned
            for state, value in (("done", done), ("failed", failed), ("running", running),
                                 ("waiting", waiting),
                                 ("to_do", max(planned - done - failed, 0))):
                self.models.labels(state=state).set(value)
            self.last_progress.set(self._clock())

    def classes(self, classes: Sequence[ClassProgress]) -> None:
        with self._lock:
            for c in classes:
                name = c.name
                pending = max(c.models - c.done - c.failed - c.running, 0)
                for state, value in (("done", c.done), ("failed", c.failed),
                                     ("running", c.running), ("pending", pending)):
                    self.class_models.labels(resource_class=name, state=state).set(value)
                shards_pending = max(c.shards - c.shards_done - c.shards_failed
                                     - c.shards_running, 0)
                for state, value in (("done", c.shards_done), ("failed", c.shards_failed),
                                     ("running", c.shards_running),
                                     ("pending", shards_pending)):
                    self.class_shards.labels(resource_class=name, state=state).set(value)
                before = self._bytes.get(name, 0)
                if c.bytes_downloaded > before:
                    self.downloaded.labels(resource_class=name).inc(c.bytes_downloaded - before)
                self._bytes[name] = c.bytes_downloaded
                share = c.device_busy_s / c.worker_s if c.worker_s > 0 else 0.0
                self.busy.labels(resource_class=name).set(min(max(share, 0.0), 1.0))
            self.last_progress.set(self._clock())

    # The recorder's verdicts ----------------------------------------------------------------

    def ended(self, outcome: Outcome, error: str, retryable: bool) -> None:
        """A model ended: done when `error` is empty, else failed with that error (the
        recorder's verdict, which may differ from the backend's: a "done" without a marker
        fails). Outcomes the store already held (a sharded run's) carry no timings."""
        if error:
            cls = error_class(error, outcome.exit_code, outcome.signal)
            self.failures.labels(cause=cls, fault_domain=fault_domain(cls),
                                 retryable=str(retryable).lower()).inc()
        if outcome.recorded:
            return
        self.duration.labels(outcome="failed" if error else "done").observe(outcome.duration_s)
        self.wait.observe(outcome.wait_s)
        self.attempts.inc(outcome.attempts)
