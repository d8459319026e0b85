"""Tests of controller.backends.local.backend with real subprocesses (tiny Python scripts), no GPU
needed.

GPU placement runs against a GpuTracker over a fake pynvml module (the function boundary),
polled every few milliseconds.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from controller.backends.base import Task, WorkerSpec
from controller.backends.local.backend import LocalBackend
from controller.backends.local.process import describe_exit
from controller.backends.local.settings import LocalSettings
from controller.errors import SweepError
from controller.gpu.gpus import GpuTracker
from controller.progress import Progress
from controller.run.commands import read_commands
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from tests.support.local import FAST, Concurrency, by_key, exit_task, make_task, make_tracker

# --- builders -----------------------------------------------------------------------------------












# --- exit codes and retries ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "status", "attempts", "exit_code", "sig", "retryable", "error"),
    [
        ("import sys; sys.exit(0)", "done", 1, 0, None, False, ""),
        ("import sys; sys.exit(3)", "failed", 1, 3, None, False, "PermanentModelError"),
        ("import sys; sys.exit(2)", "failed", 1, 2, None, False, "UsageError"),
        ("import sys; sys.exit(4)", "failed", 3, 4, None, True, "TransientError"),
        ("import sys; sys.exit(5)", "failed", 3, 5, None, True, "GpuOutOfMemoryError"),
        ("import sys; sys.exit(7)", "failed", 1, 7, None, False, "WorkerCrashed"),
        ("raise SystemExit('boom')", "failed", 1, 1, None, False, "WorkerCrashed"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "failed", 3, None, 9, True,
         "KilledBySignal: the worker was killed by SIGKILL"),
    ],
    ids=["ok", "permanent", "usage", "transient", "oom", "other-code", "exception", "sigkill"],
)
def test_exit_code_decides_status_and_retries(
    script: str, status: str, attempts: int, exit_code: int | None, sig: int | None,
    retryable: bool, error: str,
) -> None:
    """3 and 2 are never retried; 4, 5 and a signal get max_retries=2 more attempts."""
    [outcome] = LocalBackend(FAST, None).run([make_task("t", script)])
    assert (outcome.status, outcome.attempts, outcome.exit_code, outcome.signal) == (
        status, attempts, exit_code, sig
    )
    assert outcome.retryable is retryable
    assert outcome.error.startswith(error)
    assert outcome.total_s >= outcome.duration_s > 0


def test_transient_failure_then_success_is_done(tmp_path: Path) -> None:
    """Exit 4 on the first attempt, 0 on the second: done after 2 attempts, no error."""
    marker = tmp_path / "tried"
    task = make_task("flaky", f"""
        import pathlib, sys
        p = pathlib.Path({str(marker)!r})
        if not p.exists():
            p.write_text("x")
            sys.exit(4)
    """)
    [outcome] = LocalBackend(FAST, None).run([task])
    assert (outcome.status, outcome.attempts, outcome.error, outcome.retryable) == (
        "done", 2, "", False
    )


def test_no_retries_when_max_retries_is_zero() -> None:
    settings = LocalSettings(max_retries=0, backoff_s=0.01)
    [outcome] = LocalBackend(settings, None).run([exit_task("t", 4)])
    assert (outcome.status, outcome.attempts, outcome.retryable) == ("failed", 1, True)


def test_one_failing_task_does_not_stop_the_others() -> None:
    outcomes = by_key(LocalBackend(FAST, None).run(
        [exit_task("a", 0), exit_task("b", 3), exit_task("c", 0)]
    ))
    assert {k: o.status for k, o in outcomes.items()} == {
        "a": "done", "b": "failed", "c": "done"
    }


def test_command_that_cannot_start_is_a_permanent_failure() -> None:
    task = Task(key="missing", argv=("/nonexistent/esd-worker",), label="missing")
    outcomes = by_key(LocalBackend(FAST, None).run([task, exit_task("ok", 0)]))
    missing = outcomes["missing"]
    assert (missing.status, missing.attempts, missing.retryable) == ("failed", 1, False)
    assert missing.error.startswith("StartFailed: cannot run /nonexistent/esd-worker")
    assert outcomes["ok"].status == "done"


@pytest.mark.parametrize(
    ("returncode", "retryable"),
    [(0, False), (2, False), (3, False), (4, True), (5, True), (1, False), (137, True),
     (-15, True), (-9, True)],
)
def test_describe_exit(returncode: int, retryable: bool) -> None:
    assert describe_exit(returncode)[1] is retryable


# --- output: stderr tail and log files ----------------------------------------------------------


def test_stderr_tail_is_the_last_20_lines_of_the_attempt() -> None:
    task = make_task("noisy", """
        import sys
        print("to stdout")
        for i in range(30):
            print(f"line {i}", file=sys.stderr)
        sys.exit(3)
    """)
    [outcome] = LocalBackend(FAST, None).run([task])
    assert outcome.stderr_tail == tuple(f"line {i}" for i in range(10, 30))
    assert outcome.log_path is None


def test_each_attempt_is_appended_to_the_worker_log(tmp_path: Path) -> None:
    """Three attempts of a transient failure: three headers, three outputs, one file; the
    tail holds only the last attempt's lines."""
    settings = LocalSettings(max_retries=2, backoff_s=0.01, log_dir=tmp_path / "logs")
    task = make_task("org--model@main-1a2b", """
        import sys
        print("loading weights")
        print("network is down", file=sys.stderr)
        sys.exit(4)
    """)
    [outcome] = LocalBackend(settings, None).run([task])
    log_file = tmp_path / "logs" / "workers" / "org--model@main-1a2b.log"
    assert outcome.log_path == str(log_file)
    text = log_file.read_text()
    assert [line.split(" attempt ")[1].split()[0] for line in text.splitlines()
            if line.startswith("=== ")] == ["1", "2", "3"]
    assert text.splitlines().count("network is down") == 3
    assert outcome.stderr_tail == ("loading weights", "network is down")


def test_key_with_path_separators_gives_a_flat_log_name(tmp_path: Path) -> None:
    settings = LocalSettings(log_dir=tmp_path)
    [outcome] = LocalBackend(settings, None).run([exit_task("../odd/key", 0)])
    assert outcome.log_path == str(tmp_path / "workers" / ".._odd_key.log")


# --- environment and GPU placement --------------------------------------------------------------

PRINT_ENV = """
    import os
    print("CVD=" + repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
    print("ORDER=" + repr(os.environ.get("CUDA_DEVICE_ORDER")))
    print("EXTRA=" + repr(os.environ.get("EXTRA")))
    print("INHERITED=" + repr(os.environ.get("ESD_TEST_INHERITED")))
"""


def test_cpu_mode_hides_every_gpu_and_passes_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA_VISIBLE_DEVICES="" so a CPU worker never grabs a GPU; the controller's own
    environment (HF_TOKEN and the like) is inherited; task.env is added."""
    monkeypatch.setenv("ESD_TEST_INHERITED", "yes")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    [outcome] = LocalBackend(FAST, None).run([make_task("env", PRINT_ENV, EXTRA="1")])
    assert outcome.stderr_tail == (
        "CVD=''", "ORDER='PCI_BUS_ID'", "EXTRA='1'", "INHERITED='yes'"
    )
    assert outcome.gpus == ()


@pytest.mark.parametrize(("workers", "preset"), [(1, None), (2, None), (2, "7")],
                         ids=["one-worker", "two-workers", "user-setting-kept"])
def test_cpu_workers_share_the_cores(
    workers: int, preset: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CPU worker gets cores // workers threads (at least 1) unless the user set
    OMP_NUM_THREADS: N workers each using every core oversubscribe the machine."""
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    settings = dataclasses.replace(FAST, cpu_workers=workers)
    script = 'import os; print(os.environ["OMP_NUM_THREADS"])'
    [outcome] = LocalBackend(settings, None).run([make_task("t", script)])
    expected = preset or str(max(1, (os.cpu_count() or 1) // workers))
    assert outcome.stderr_tail == (expected,)


def test_gpu_mode_sets_cuda_visible_devices_to_the_assigned_gpus() -> None:
    tracker = make_tracker([10.0, 9000.0, 10.0, 10.0], gpus_per_job=2)
    backend = LocalBackend(FAST, tracker, gpus_per_job=2)
    [outcome] = backend.run([make_task("env", PRINT_ENV)])
    assert outcome.gpus == (0, 2)  # GPU 1 is busy with another user's job
    assert outcome.stderr_tail[0] == "CVD='0,2'"
    assert not any(g.taken for g in tracker.snapshot())  # released at exit


def test_gpus_per_job_two_runs_disjoint_pairs() -> None:
    """4 free GPUs, 2 per job, 4 tasks: never more than 2 at once, never sharing a GPU."""
    tracker = make_tracker([10.0] * 4, gpus_per_job=2)
    seen = Concurrency()
    backend = LocalBackend(FAST, tracker, gpus_per_job=2, on_start=seen.start)
    script = """
        import os, time
        time.sleep(0.3)
        print(os.environ["CUDA_VISIBLE_DEVICES"])
    """
    outcomes = backend.run([make_task(f"t{i}", script) for i in range(4)], seen.end)
    assert all(o.status == "done" for o in outcomes)
    assert seen.most == 2 and not seen.overlap
    for o in outcomes:
        assert o.stderr_tail == (",".join(map(str, o.gpus)),)
        assert len(o.gpus) == 2
    assert max(o.wait_s for o in outcomes) > 0.2  # the second pair waited for the first


def test_gpu_released_by_our_worker_is_reused_without_max_checks_polls() -> None:
    """One GPU, max_checks=3 at 0.2 s: the first task waits for 3 polls (0.4 s); the next
    ones start right after the previous worker exits (one immediate fresh poll)."""
    tracker = make_tracker([10.0], max_checks=3, poll_interval_s=0.2)
    starts: list[float] = []
    backend = LocalBackend(FAST, tracker, on_start=lambda t, g: starts.append(time.monotonic()))
    t0 = time.monotonic()
    outcomes = backend.run([exit_task(f"t{i}", 0) for i in range(3)])
    assert [o.gpus for o in outcomes] == [(0,)] * 3
    assert starts[0] - t0 >= 0.39
    # Between one worker's exit and the next start: reaping and one poll, not 2 more polls
    # (0.4 s) as for a GPU busy for unknown reasons.
    idle = [b - a - o.duration_s for a, b, o in zip(starts, starts[1:], outcomes, strict=False)]
    assert max(idle) < 0.2, idle


def test_gpus_per_job_over_what_the_tracker_has_is_rejected() -> None:
    tracker = make_tracker([10.0, 10.0])
    with pytest.raises(SweepError, match="gpus_per_job: 3 GPU"):
        LocalBackend(FAST, tracker, gpus_per_job=3)


def test_cpu_workers_caps_concurrency() -> None:
    settings = LocalSettings(cpu_workers=2)
    seen = Concurrency()
    backend = LocalBackend(settings, None, on_start=seen.start)
    outcomes = backend.run([make_task(f"t{i}", "import time; time.sleep(0.2)") for i in range(5)],
                           seen.end)
    assert [o.status for o in outcomes] == ["done"] * 5
    assert seen.most == 2


# --- stopping -------------------------------------------------------------------------------


















# --- progress -----------------------------------------------------------------------------------


def test_backend_feeds_progress() -> None:
    stream = io.StringIO()
    progress = Progress(3, stream=stream, interactive=True)
    backend = LocalBackend(FAST, None)
    backend.run([exit_task("a", 0), exit_task("b", 3), exit_task("c", 0)], progress=progress)
    progress.close()
    last = stream.getvalue().rstrip("\n").split("\r\x1b[2K")[-1]
    assert "3/3  done 2  failed 1  running 0  waiting 0" in last


# --- custom commands ----------------------------------------------------------------------------






def test_commands_run_under_the_backend(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    path = tmp_path / "commands.txt"
    script = 'import sys; open(sys.argv[1], "w").write("hi")'
    path.write_text(f"{sys.executable} -c '{script}' {out}\n")
    [outcome] = LocalBackend(FAST, None).run(read_commands(path))
    assert outcome.status == "done"
    assert out.read_text() == "hi"


def test_settings_validation_names_every_bad_field() -> None:
    settings = LocalSettings(max_retries=-1, backoff_s=-1, backoff_max_s=-1, cpu_workers=0,
                             terminate_grace_s=-1)
    with pytest.raises(ValueError) as info:
        settings.validate()
    for name in ("max_retries", "backoff_s", "backoff_max_s", "cpu_workers", "terminate_grace_s"):
        assert f"{name}:" in str(info.value)



# --- model tasks, the Backend contract ------------------------------------------------------------

ECHO_ARGV = (sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        pytest.param(ModelRow("org/m", "v1", "", None), [], id="base"),
        pytest.param(ModelRow("org/lora", None, "lora", "org/base@main"),
                     ["--relation", "lora", "--base-model", "org/base@main"], id="adapter"),
    ],
)
def test_a_model_task_runs_the_worker_with_the_runs_flags(
    row: ModelRow, expected: list[str]
) -> None:
    """A model's one-model worker command (what --dry-run prints) has the model, the store
    and key, the device and the spec's analysis flags as separate arguments (never a shell
    string)."""
    spec = WorkerSpec(run_id="r", store_url="/out", save_eigs=False, log_format="json",
                      analysis=AnalysisSettings(fix_fingers="DKS"))
    backend = LocalBackend(FAST, None, spec=spec, worker_cmd=ECHO_ARGV)
    full = backend.argv(Task.for_model(row), "cpu")
    assert full[:len(ECHO_ARGV)] == ECHO_ARGV
    argv = list(full[len(ECHO_ARGV):])
    assert argv[:10] == ["--model", row.ref, "--output", "/out", "--model-key", row.key,
                         "--log-format", "json", "--device", "cpu"]
    assert argv[10:10 + len(expected)] == expected
    rest = argv[10 + len(expected):]
    assert "--no-eigs" in rest and rest[rest.index("--fix-fingers") + 1] == "DKS"


def test_dry_run_prints_each_command_and_starts_nothing(tmp_path: Path) -> None:
    """One shell-quoted line per task: a model id with shell syntax reads back as one
    argument, and nothing runs."""
    odd = ModelRow(str(tmp_path / "a model; rm -rf $HOME"), None, "", None)
    spec = WorkerSpec(run_id="r", store_url=str(tmp_path / "out"), device="auto")
    backend = LocalBackend(FAST, None, spec=spec, worker_cmd=("esd-worker",))
    out = io.StringIO()
    assert backend.dry_run([Task.for_model(odd), exit_task("cmd-1", 0)], out) == 2
    first, second = out.getvalue().splitlines()
    argv = shlex.split(first)
    assert argv[0] == "esd-worker" and argv[argv.index("--model") + 1] == odd.ref
    assert argv[argv.index("--device") + 1] == "auto"
    assert shlex.split(second)[-1] == "import sys; sys.exit(0)"
    assert not (tmp_path / "out").exists()


def test_the_tracker_is_opened_only_when_there_is_work() -> None:
    """Nothing to do touches no NVML (a sweep whose models are all done needs no GPU)."""
    opened: list[int] = []

    def open_tracker() -> GpuTracker | None:
        opened.append(1)
        return make_tracker([10.0, 10.0])

    backend = LocalBackend(FAST, None, open_tracker=open_tracker)
    assert backend.run([]) == [] and opened == []
    assert backend.report() == {"device": "cpu", "gpus": []}
    [outcome] = backend.run([exit_task("t", 0)])
    assert opened == [1] and outcome.where == "gpus=0"
    assert backend.report() == {"device": "cuda", "gpus": [0, 1]}
    backend.close()


def test_stop_notices_say_what_each_request_does() -> None:
    backend = LocalBackend(FAST, None)
    assert "running workers finish" in backend.stop_notice(1)
    assert backend.stop_notice(2) == "terminating running workers"
