"""The local backend's long-lived workers: one process many models, a crash charged to the model in
progress, poison models, hung models (no heartbeat for their limit), --worker-reuse, stops,
logs and GPUs; through a stand-in worker that
speaks the real protocol (tests/support/served_worker.py), so no torch is needed."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.local.backend import LocalBackend, serve_argv
from controller.backends.local.process import WorkerLogs
from controller.backends.local.served import ServedWorker
from controller.backends.local.settings import LocalSettings
from controller.errors import EXIT_SOME_FAILED
from controller.run.sweep import run_sweep
from controller.settings import SweepSettings
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.cpus import CPU_SHARE_ENV, usable_cpus
from esd_worker.core.models.modellist import make_single
from esd_worker.core.protocol import Request
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.records import read_failure
from esd_worker.core.watchdog import no_progress_limit_s
from tests.support.local import FAST, by_key, make_tracker
from tests.support.served_worker import BIG_BYTES, HANG_S

FAKE_WORKER = (sys.executable, "-m", "tests.support.served_worker")


def tasks(*names: str) -> list[Task]:
    return [Task.for_model(make_single(name).rows[0]) for name in names]


def backend(state: Path, monkeypatch: pytest.MonkeyPatch, *,
            worker: tuple[str, ...] = FAKE_WORKER, **settings: Any) -> LocalBackend:
    monkeypatch.setenv("FAKE_WORKER_STATE", str(state))
    spec = WorkerSpec(run_id="run-1", store_url=str(state / "out"),
                      prefetch=settings.pop("prefetch", 1),
                      model_timeout=settings.pop("model_timeout", None))
    tracker = settings.pop("tracker", None)
    fields = {"max_retries": FAST.max_retries, "backoff_s": FAST.backoff_s,
              "backoff_max_s": FAST.backoff_max_s, "terminate_grace_s": 2.0} | settings
    return LocalBackend(LocalSettings(**fields), tracker, spec=spec, worker_cmd=worker)


def starts(state: Path) -> list[tuple[int, str, int]]:
    path = state / "starts"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(pid), key, int(attempt)) for pid, key, attempt in map(str.split, lines)]


def workers(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / "workers").read_text().splitlines()]


def test_one_worker_analyses_every_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"ok-{i}" for i in range(6)]
    outcomes = backend(tmp_path, monkeypatch).run(tasks(*names))
    assert [(o.status, o.attempts, o.where) for o in outcomes] == [("done", 1, "cpu")] * 6
    assert len({pid for pid, _, _ in starts(tmp_path)}) == 1
    assert [key for _, key, _ in starts(tmp_path)] == [t.key for t in tasks(*names)]


def test_a_crash_is_an_attempt_of_the_model_in_progress_and_the_rest_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies under crash-once-b: b is retried on a fresh worker, the models it had
    been sent but not started are not charged, every model ends done."""
    outcomes = by_key(backend(tmp_path, monkeypatch).run(
        tasks("ok-a", "crash-once-b", "ok-c", "ok-d")))
    assert {o.task.label: (o.status, o.attempts) for o in outcomes.values()} == {
        "ok-a": ("done", 1), "crash-once-b": ("done", 2), "ok-c": ("done", 1),
        "ok-d": ("done", 1)}
    assert len({pid for pid, _, _ in starts(tmp_path)}) == 2
    assert Counter(key for _, key, _ in starts(tmp_path))[tasks("ok-c")[0].key] == 1


@pytest.mark.parametrize("max_retries", [0, 1, 2])
def test_a_poison_model_is_a_permanent_failure_after_crashing_every_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_retries: int
) -> None:
    outcomes = by_key(backend(tmp_path, monkeypatch, max_retries=max_retries).run(
        tasks("ok-a", "poison-b", "ok-c")))
    poison = outcomes[tasks("poison-b")[0].key]
    assert (poison.status, poison.attempts, poison.retryable) == ("failed", max_retries + 1,
                                                                  False)
    assert (poison.exit_code, poison.signal) == (None, 9)
    assert poison.error.startswith("WorkerCrashed: the worker was killed by SIGKILL")
    assert "poison model" in poison.error
    assert poison.stderr_tail[-1] == f"analysing poison-b attempt {max_retries + 1}"
    assert [o.status for o in outcomes.values()].count("done") == 2


def test_failures_reported_by_the_worker_keep_their_class_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = by_key(backend(tmp_path, monkeypatch).run(tasks("fail-a", "transient-b")))
    fail, transient = outcomes[tasks("fail-a")[0].key], outcomes[tasks("transient-b")[0].key]
    assert (fail.status, fail.attempts, fail.exit_code, fail.retryable) == ("failed", 1, 3,
                                                                            False)
    assert fail.error == "PermanentModelError: model not found: fail-a"
    assert fail.stderr_tail[-1] == "esd-worker: error: model not found: fail-a"
    assert (transient.attempts, transient.exit_code, transient.retryable) == (3, 4, True)
    assert len({pid for pid, _, _ in starts(tmp_path)}) == 1  # a failure is not a crash


@pytest.mark.parametrize(("reuse", "expected_workers"), [(None, 1), (1, 5), (2, 3)])
def test_worker_reuse_replaces_a_worker_after_n_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reuse: int | None, expected_workers: int
) -> None:
    outcomes = backend(tmp_path, monkeypatch, worker_reuse=reuse).run(
        tasks(*(f"ok-{i}" for i in range(5))))
    assert [o.status for o in outcomes] == ["done"] * 5
    per_worker = Counter(pid for pid, _, _ in starts(tmp_path))
    assert len(per_worker) == expected_workers
    assert max(per_worker.values()) <= (reuse or 5)


def test_cpu_workers_run_one_long_lived_worker_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = backend(tmp_path, monkeypatch, cpu_workers=2).run(
        tasks(*(f"wait-{i}" for i in range(4))))
    assert [o.status for o in outcomes] == ["done"] * 4
    assert len({pid for pid, _, _ in starts(tmp_path)}) == 2
    assert {w["gpus"] for w in workers(tmp_path)} == {""}  # no GPU visible on CPU slots


def test_gpu_slots_hold_their_gpus_while_the_worker_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker = make_tracker([10.0, 10.0])
    b = backend(tmp_path, monkeypatch, tracker=tracker)
    outcomes = b.run(tasks(*(f"wait-{i}" for i in range(4))))
    assert sorted(o.where for o in outcomes) == ["gpus=0", "gpus=0", "gpus=1", "gpus=1"]
    assert sorted(w["gpus"] for w in workers(tmp_path)) == ["0", "1"]
    assert not any(g.taken for g in tracker.snapshot())  # given back once the workers left
    # Each GPU worker's host eigensolvers stay within its GPU's part of the machine's CPUs.
    share = f"{usable_cpus() / 2:.2f}"
    assert [w["cpu_share"] for w in workers(tmp_path)] == [share, share]


def test_cpu_workers_and_a_share_the_run_sets_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for folder in ("cpu", "set"):
        (tmp_path / folder).mkdir()
    backend(tmp_path / "cpu", monkeypatch).run(tasks("ok-a"))
    assert [w["cpu_share"] for w in workers(tmp_path / "cpu")] == [None]
    monkeypatch.setenv(CPU_SHARE_ENV, "3")
    backend(tmp_path / "set", monkeypatch, tracker=make_tracker([10.0])).run(tasks("ok-a"))
    assert [w["cpu_share"] for w in workers(tmp_path / "set")] == ["3"]


def test_the_worker_gets_the_runs_flags_as_an_argument_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend(tmp_path, monkeypatch).run(tasks("ok-a"))
    [worker] = workers(tmp_path)
    spec = WorkerSpec(run_id="run-1", store_url=str(tmp_path / "out"))
    assert worker["argv"] == list(serve_argv((), spec, "cpu"))
    argv = serve_argv(("esd-worker",), WorkerSpec(
        run_id="r", store_url="s3://b/p", analysis=AnalysisSettings(fix_fingers="DKS"),
        prefetch=3, cache_budget=10**9, cache_dir="/scratch", overwrite=True), "cuda")
    assert argv[:8] == ("esd-worker", "--serve", "--output", "s3://b/p", "--log-format", "text",
                        "--device", "cuda")
    for flag, value in [("--run-id", "r"), ("--prefetch", "3"), ("--cache-budget", "1000000000"),
                        ("--cache-dir", "/scratch"), ("--fix-fingers", "DKS")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--overwrite" in argv


def test_each_model_has_its_own_log_and_the_worker_one_for_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "logs"
    outcomes = backend(tmp_path, monkeypatch, log_dir=logs).run(tasks("ok-a", "crash-once-b"))
    crashed = by_key(outcomes)[tasks("crash-once-b")[0].key]
    text = Path(str(crashed.log_path)).read_text()
    assert text.count("=== ") == 2 and "attempt 1 key=" in text and "attempt 2 key=" in text
    assert "analysing crash-once-b attempt 1" in text and "analysing ok-a" not in text
    assert sorted(p.name for p in (logs / "workers").glob("_worker-*.log")) == [
        "_worker-1.log", "_worker-2.log"]


def test_a_worker_that_never_serves_fails_its_model_after_bounded_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker command that exits at once (not a serving worker) is charged to the model it
    was sent, with retries bounded: no endless restarts."""
    outcomes = backend(tmp_path, monkeypatch, max_retries=1,
                       worker=(sys.executable, "-c", "print('no protocol here')")).run(
        tasks("ok-a", "ok-b"))
    assert [(o.status, o.attempts) for o in outcomes] == [("failed", 2)] * 2
    assert outcomes[0].error.startswith("WorkerExited")


def test_first_stop_finishes_the_model_in_progress_and_drops_what_was_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(tmp_path, monkeypatch, prefetch=2)
    b.on_start = lambda task, gpus: b.request_stop()
    outcomes = b.run(tasks("wait-a", "ok-b", "ok-c", "ok-d"))
    assert [(o.task.label, o.status) for o in outcomes] == [("wait-a", "done")]
    assert [key for _, key, _ in starts(tmp_path)] == [tasks("wait-a")[0].key]


def test_second_stop_terminates_the_worker_and_cancels_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(tmp_path, monkeypatch)

    def stop_twice(task: Task, gpus: tuple[int, ...]) -> None:
        b.request_stop()
        threading.Timer(0.3, b.request_stop).start()

    b.on_start = stop_twice
    got: list[Outcome] = []
    outcomes = b.run(tasks("slow-a", "ok-b"), got.append)
    assert [(o.task.label, o.status) for o in outcomes] == [("slow-a", "cancelled")]
    assert got == outcomes


# -- hung models: no heartbeat for the model's limit (esd_worker.core.watchdog) ----------------

@pytest.mark.parametrize("max_retries", [0, 1])
def test_a_hung_model_is_killed_after_its_limit_and_the_rest_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_retries: int
) -> None:
    """hang-b says nothing after it starts: with --model-timeout 1 its worker is killed about
    1 s later, each time charged one attempt, and after --max-retries it is recorded with the
    watch's ModelTimeout cause, not as a crash, and not retryable (a model that hung in every
    attempt hangs again, as a poison model crashes again). beat-c runs twice the limit but
    beats, so it is done; ok-d, sent to the hung worker ahead and never started there, is not
    charged."""
    outcomes = by_key(backend(tmp_path, monkeypatch, max_retries=max_retries,
                              model_timeout=1.0).run(tasks("ok-a", "hang-b", "beat-c", "ok-d")))
    hung = outcomes[tasks("hang-b")[0].key]
    assert (hung.status, hung.attempts, hung.signal) == ("failed", max_retries + 1, 9)
    assert hung.error.startswith("ModelTimeout: no progress for "), hung.error
    assert "limit 1 s" in hung.error and "WorkerCrashed" not in hung.error
    # Hung in every attempt: recorded as a poison model is, for --retry-failed to try again.
    assert f"it hung in all {max_retries + 1} attempt(s)" in hung.error
    assert not hung.retryable
    assert 1.0 <= hung.duration_s < HANG_S / 2
    assert hung.stderr_tail[-1] == f"analysing hang-b attempt {max_retries + 1}"
    assert {o.task.label: (o.status, o.attempts) for o in outcomes.values()
            if o is not hung} == {"ok-a": ("done", 1), "beat-c": ("done", 1), "ok-d": ("done", 1)}
    assert Counter(key for _, key, _ in starts(tmp_path))[tasks("ok-d")[0].key] == 1


def test_a_model_that_hung_once_is_done_on_its_retry_and_the_kill_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hang is one attempt, like a crash: the retry on a fresh worker finishes it. The kill
    is one warning naming the model, how long it was quiet and its limit."""
    with caplog.at_level(logging.WARNING, logger="controller.backends.local.slots"):
        outcomes = backend(tmp_path, monkeypatch, model_timeout=1.0).run(
            tasks("hang-once-a", "ok-b"))
    assert [(o.task.label, o.status, o.attempts) for o in outcomes] == [
        ("ok-b", "done", 1), ("hang-once-a", "done", 2)]
    [warning] = [r.getMessage() for r in caplog.records
                 if r.name == "controller.backends.local.slots" and "hung" in r.getMessage()]
    assert warning.startswith("model=hang-once-a key=")
    assert re.search(r"hung: no progress for \d+ s \(limit 1 s, --model-timeout", warning)
    assert "SIGKILL worker 1" in warning


def test_the_size_a_heartbeat_gives_raises_the_limit_above_the_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """big-hang-a's one heartbeat says it is BIG_BYTES: its limit is the size's (about 3 s,
    no_progress_limit_s), so the 1 s floor alone does not kill it."""
    limit = no_progress_limit_s(BIG_BYTES, 1.0)
    assert limit > 2.0  # the test means something only if the size's limit is the larger
    [outcome] = backend(tmp_path, monkeypatch, max_retries=0, model_timeout=1.0).run(
        tasks("big-hang-a"))
    assert (outcome.status, outcome.attempts) == ("failed", 1)
    assert outcome.error.startswith("ModelTimeout:")
    assert f"limit {limit:.0f} s" in outcome.error
    assert limit <= outcome.duration_s < HANG_S / 2


def test_a_first_stop_does_not_wait_for_a_hung_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first stop lets the model in progress finish: a hung one never does, so the watch
    still kills it. It is not retried during the stop and stays retryable for the next run."""
    b = backend(tmp_path, monkeypatch, model_timeout=1.0)
    b.on_start = lambda task, gpus: b.request_stop()
    [outcome] = b.run(tasks("hang-a", "ok-b"))
    assert (outcome.task.label, outcome.status, outcome.attempts) == ("hang-a", "failed", 1)
    assert outcome.error.startswith("ModelTimeout:") and outcome.retryable
    assert outcome.duration_s < HANG_S / 2

def test_a_sweep_records_a_model_that_hung_in_every_attempt_with_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end from the run's settings (--model-timeout 1, --max-retries 1) to the store:
    the failure record names the ModelTimeout, its two attempts and the SIGKILL, and is not
    retryable; the sweep exits 1 (some failed)."""
    monkeypatch.setenv("FAKE_WORKER_STATE", str(tmp_path))
    models = tmp_path / "models.csv"
    models.write_text("model_id\nhang-b\n")
    out = tmp_path / "out"
    settings = SweepSettings(
        output=str(out), model_list=models, device="cpu", model_timeout=1.0,
        worker_cmd=FAKE_WORKER, local=dataclasses.replace(FAST, max_retries=1))
    assert run_sweep(settings).exit_code == EXIT_SOME_FAILED
    record = read_failure(open_store(str(out)), tasks("hang-b")[0].key)
    assert record is not None
    assert record.error.startswith("ModelTimeout: no progress for ")
    assert (record.attempts, record.signal, record.retryable) == (2, 9, False)


# A worker whose stderr lags behind its stdout: the result of model k arrives while the log
# line that explains it and the model's end line are still on their way (the two pipes are
# read by two threads; under load the stderr reader can be late).
_LAGGING = """
import sys, time
from esd_worker.core.protocol import begin_line, end_line, event_line
sys.stdout.write(event_line("ready", pid=0)); sys.stdout.flush()
sys.stdin.readline()
sys.stderr.write(begin_line("k", 1)); sys.stderr.flush()
sys.stdout.write(event_line("result", key="k", status="failed", exit_code=3,
                            error="PermanentModelError: model not found", retryable=False))
sys.stdout.flush()
time.sleep(0.5)
sys.stderr.write("ERROR esd_worker: model not found: no directory /x\\n")
sys.stderr.write(end_line("k")); sys.stderr.flush()
"""


def test_a_results_tail_waits_for_the_models_last_log_lines() -> None:

    worker = ServedWorker([sys.executable, "-c", _LAGGING], slot=1, gpus=(), env={},
                          logs=WorkerLogs(None), threads=None)
    try:
        assert worker.send(Request(key="k", model="/x"))
        deadline = time.monotonic() + 30
        events: list[dict[str, Any]] = []
        while not any(e["event"] == "result" for e in events):
            assert time.monotonic() < deadline, events
            events += worker.events()
        tail = worker.tail("k", ended=True)
        assert any("model not found" in line for line in tail), tail
    finally:
        worker.wait(10)
