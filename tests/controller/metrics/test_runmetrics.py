"""RunMetrics: what the run's registry exports for each input (Progress counts, per-class
progress, the recorder's verdicts), read back through the text format and its parser;
and each error class's fault domain."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.backends.base import Outcome, Task
from controller.metrics.domains import (
    INFRASTRUCTURE,
    MODEL,
    NODE,
    WORKER,
    error_class,
    fault_domain,
)
from controller.metrics.runmetrics import RunMetrics
from controller.progress import ClassProgress, Progress
from esd_worker.core import redact as redact_module
from tests.controller.metrics.scrape import Samples, value


def exported(metrics: RunMetrics) -> Samples:
    text = generate_latest(metrics.registry).decode("utf-8")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def outcome(status: str = "failed", error: str = "", *, exit_code: int | None = 3,
            signal: int | None = None, attempts: int = 1, recorded: bool = False,
            duration_s: float = 2.0) -> Outcome:
    return Outcome(task=Task(key="k", label="org/m"), status=status, exit_code=exit_code,
                   signal=signal, attempts=attempts, duration_s=duration_s,
                   total_s=duration_s, wait_s=0.5, where="cpu", stderr_tail=(), error=error,
                   retryable=False, recorded=recorded)


Feed = Callable[[RunMetrics], None]
Expect = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _counts(*steps: tuple[int, int, int, int]) -> Feed:
    def feed(m: RunMetrics) -> None:
        m.plan(10)
        for done, failed, running, waiting in steps:
            m.counts(done=done, failed=failed, running=running, waiting=waiting)
    return feed


def _classes(*steps: list[ClassProgress]) -> Feed:
    def feed(m: RunMetrics) -> None:
        for step in steps:
            m.classes(step)
    return feed


def _ended(*verdicts: tuple[Outcome, str, bool]) -> Feed:
    def feed(m: RunMetrics) -> None:
        for o, error, retryable in verdicts:
            m.ended(o, error, retryable)
    return feed


CPU = "gpu-x0"
CASES: list[tuple[str, Feed, Expect]] = [
    ("counts: gauges are the last counts, to_do what is not finished",
     _counts((1, 0, 2, 3), (4, 1, 2, 0)),
     {("esd_sweep_run_models", ()): 10,
      ("esd_sweep_models", (("state", "done"),)): 4,
      ("esd_sweep_models", (("state", "failed"),)): 1,
      ("esd_sweep_models", (("state", "running"),)): 2,
      ("esd_sweep_models", (("state", "waiting"),)): 0,
      ("esd_sweep_models", (("state", "to_do"),)): 5,
      ("esd_sweep_models_done_total", ()): 4}),
    ("the done counter grows by deltas and never goes back",
     _counts((3, 0, 0, 0), (2, 0, 0, 0), (5, 0, 0, 0)),
     {("esd_sweep_models_done_total", ()): 5,
      ("esd_sweep_models", (("state", "done"),)): 5}),
    ("classes: models and shards by state, pending the rest; busy share",
     _classes([ClassProgress(name=CPU, models=10, done=3, failed=1, running=2, shards=4,
                             shards_done=1, shards_running=2, bytes_downloaded=1000,
                             device_busy_s=30.0, worker_s=120.0)]),
     {("esd_sweep_class_models", (("resource_class", CPU), ("state", "done"))): 3,
      ("esd_sweep_class_models", (("resource_class", CPU), ("state", "failed"))): 1,
      ("esd_sweep_class_models", (("resource_class", CPU), ("state", "running"))): 2,
      ("esd_sweep_class_models", (("resource_class", CPU), ("state", "pending"))): 4,
      ("esd_sweep_class_shards", (("resource_class", CPU), ("state", "done"))): 1,
      ("esd_sweep_class_shards", (("resource_class", CPU), ("state", "failed"))): 0,
      ("esd_sweep_class_shards", (("resource_class", CPU), ("state", "pending"))): 1,
      ("esd_sweep_downloaded_bytes_total", (("resource_class", CPU),)): 1000,
      ("esd_sweep_device_busy_ratio", (("resource_class", CPU),)): 0.25}),
    ("bytes: a total that shrinks (a restarted shard) adds nothing and is the new base",
     _classes([ClassProgress(name=CPU, models=1, bytes_downloaded=1000)],
              [ClassProgress(name=CPU, models=1, bytes_downloaded=400)],
              [ClassProgress(name=CPU, models=1, bytes_downloaded=900)]),
     {("esd_sweep_downloaded_bytes_total", (("resource_class", CPU),)): 1500,
      ("esd_sweep_device_busy_ratio", (("resource_class", CPU),)): 0}),
    ("failures by cause, domain and retryable; the recorder's verdict wins over the status",
     _ended((outcome(error="PermanentModelError: not found"), "PermanentModelError: x", False),
            (outcome(error="DeviceError: lost", exit_code=6), "DeviceError: lost", True),
            (outcome("done", exit_code=0), "MarkerMissing: no result.json", True),
            (outcome("done", exit_code=0, attempts=2), "", False)),
     {("esd_sweep_failures_total", (("cause", "PermanentModelError"),
                                    ("fault_domain", "model"), ("retryable", "false"))): 1,
      ("esd_sweep_failures_total", (("cause", "DeviceError"), ("fault_domain", "node"),
                                    ("retryable", "true"))): 1,
      ("esd_sweep_failures_total", (("cause", "MarkerMissing"), ("fault_domain", "worker"),
                                    ("retryable", "true"))): 1,
      ("esd_sweep_model_attempts_total", ()): 5,
      ("esd_sweep_model_duration_seconds_count", (("outcome", "done"),)): 1,
      ("esd_sweep_model_duration_seconds_count", (("outcome", "failed"),)): 3}),
    ("a sharded run's recorded outcomes count as failures but carry no timings",
     _ended((outcome(error="Evicted: node drained", recorded=True), "Evicted: drained", True),
            (outcome("done", exit_code=0, recorded=True), "", False)),
     {("esd_sweep_failures_total", (("cause", "Evicted"), ("fault_domain", "infrastructure"),
                                    ("retryable", "true"))): 1,
      ("esd_sweep_model_attempts_total", ()): 0}),
]


@pytest.mark.parametrize(("feed", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_what_the_registry_exports(feed: Feed, expected: Expect) -> None:
    metrics = RunMetrics(run_id="r1", backend="kubernetes", version="9.9")
    feed(metrics)
    samples = exported(metrics)
    got = {key: samples.get((key[0], frozenset(key[1]))) for key in expected}
    assert got == expected
    assert value(samples, "esd_sweep_run_info", run_id="r1", backend="kubernetes",
                 version="9.9") == 1


def test_killed_by_signal_without_a_class_is_named_from_its_signal() -> None:
    """An error text with no `Class:` prefix: the class its exit code and signal give."""
    metrics = RunMetrics(run_id="r", backend="local", version="1")
    metrics.ended(outcome(exit_code=None, signal=9), "", False)  # done: no failure
    metrics.ended(outcome(exit_code=None, signal=9), "killed (SIGKILL)", True)
    assert value(exported(metrics), "esd_sweep_failures_total", cause="KilledBySignal",
                 fault_domain="node", retryable="true") == 1


LIVE_TOKEN = "liveToken0123456789"  # an identifier, no token shape: only HF_TOKEN says so


@pytest.mark.parametrize("secret", [
    pytest.param("hf_" + "Zq9x" * 9, id="hf-token"),
    pytest.param("AKIA" + "Q7ZB3XK2LMNP4RST", id="aws-key-id"),
    pytest.param(LIVE_TOKEN, id="hf-token-env-value"),
])
def test_an_error_prefixed_by_a_secret_gives_no_label_of_it(
        secret: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's error that starts `<secret>: …` (a secret is an identifier too): /metrics
    names the class its exit code gives, never the secret."""
    monkeypatch.setenv("HF_TOKEN", LIVE_TOKEN)
    monkeypatch.setattr(redact_module, "_default", None)  # it reads HF_TOKEN on first use
    metrics = RunMetrics(run_id="r", backend="local", version="1")
    metrics.ended(outcome(exit_code=1), f"{secret}: hub said 401", False)
    text = generate_latest(metrics.registry).decode()
    assert secret not in text
    assert value(exported(metrics), "esd_sweep_failures_total", cause="WorkerCrashed",
                 fault_domain="worker", retryable="false") == 1


def test_progress_hands_its_updates_to_the_metrics() -> None:
    """The observer attached to a real Progress: its counts and classes arrive; after close
    nothing more does; last progress moves with each update."""
    now = [100.0]
    metrics = RunMetrics(run_id="r", backend="local", version="1", clock=lambda: now[0])
    progress = Progress(3, interactive=False)
    metrics.plan(3)
    progress.observe(metrics)
    now[0] = 160.0
    progress.update(done=1, failed=0, running=1, waiting=1)
    progress.update_classes([ClassProgress(name="gpu-x1", models=3, done=1)])
    progress.close()
    progress.update(done=3, failed=0, running=0, waiting=0)
    samples = exported(metrics)
    assert value(samples, "esd_sweep_models", state="done") == 1
    assert value(samples, "esd_sweep_models", state="to_do") == 2
    assert value(samples, "esd_sweep_class_models", resource_class="gpu-x1",
                 state="pending") == 2
    assert value(samples, "esd_sweep_run_start_time_seconds") == 100.0
    assert value(samples, "esd_sweep_last_progress_time_seconds") == 160.0


@pytest.mark.parametrize(("error", "exit_code", "signal", "cls", "domain"), [
    ("PermanentModelError: model not found", 3, None, "PermanentModelError", MODEL),
    ("GpuOutOfMemoryError: layer x", 5, None, "GpuOutOfMemoryError", MODEL),
    ("ModelTimeout: no progress for 600 s", None, 9, "ModelTimeout", MODEL),
    ("HostOutOfMemory: 40 GB past --memory-limit", None, 9, "HostOutOfMemory", MODEL),
    ("WorkerCrashed: the worker was killed", None, 11, "WorkerCrashed", WORKER),
    ("StartFailed: cannot run esd-worker", None, None, "StartFailed", WORKER),
    ("something odd happened", 1, None, "WorkerCrashed", WORKER),
    ("SomeNewClass: unknown to the table", 1, None, "SomeNewClass", WORKER),
    ("DeviceError: GPU lost", 6, None, "DeviceError", NODE),
    ("Evicted: the kubelet evicted the pod", None, None, "Evicted", INFRASTRUCTURE),
    ("Disrupted: the node was drained", None, None, "Disrupted", INFRASTRUCTURE),
    ("", 137, None, "KilledBySignal", NODE),
    ("TransientError: connection reset", 4, None, "TransientError", INFRASTRUCTURE),
    ("StoreError: S3 unreachable", 4, None, "StoreError", INFRASTRUCTURE),
    ("JobDeleted: Job x was deleted", None, None, "JobDeleted", INFRASTRUCTURE),
    ("RBAC: cannot create jobs", None, None, "RBAC", INFRASTRUCTURE),
])
def test_a_failures_cause_and_fault_domain(error: str, exit_code: int | None,
                                           signal: int | None, cls: str,
                                           domain: str) -> None:
    assert error_class(error, exit_code, signal) == cls
    assert fault_domain(cls) == domain
