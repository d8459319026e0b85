"""The sweep end to end on this machine: real CPU worker subprocesses on locally built models.

What users rely on: one command analyses the list, a failing model does not stop the others,
the exit status says whether all succeeded, a rerun does only what is missing, and a
controller killed at any moment loses nothing and analyses nothing twice.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import marker_key, write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.stores import LocalStore
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT


def make_tiny_gpt2(path: Path, seed: int) -> Path:
    """A 2-block GPT-2 (n_embd 32) saved with save_pretrained: seconds to analyse on a CPU."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def write_model_list(path: Path, rows: Sequence[tuple[str, str, str]]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", "base_model_relation", "source_model"])
        writer.writerows(rows)
    return path


def sweep_argv(model_list: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "controller.cli", "run",
        "--model-list", str(model_list), "--output-dir", str(out),
        "--device", "cpu", "--retry-backoff", "0.1", *extra,
    ]


def run_sweep(model_list: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        sweep_argv(model_list, out, *extra), capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=600,
    )


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("models")
    return [make_tiny_gpt2(base / f"gpt2-{i}", seed=i) for i in range(4)]


def test_sweep_runs_list_records_failure_and_resumes(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """Two good models and a missing one: exit 1, two markers, one permanent failure record;
    the summary has the two good models; a rerun skips the done ones (exit 1 again, because
    the missing model still fails) and leaves their markers untouched."""
    missing = tmp_path / "no-such-model"
    models = write_model_list(tmp_path / "models.csv", [
        (str(tiny_models[0]), "base", ""),
        (str(missing), "", ""),
        (str(tiny_models[1]), "finetune", ""),
    ])
    out = tmp_path / "results"
    first = run_sweep(models, out, "--cpu-workers", "2")
    assert first.returncode == 1, first.stderr
    keys = [model_key(str(p)) for p in tiny_models[:2]]
    for key in keys:
        marker = json.loads((out / key / "result.json").read_text())
        # 2 blocks × (attn c_attn, attn c_proj, mlp c_fc, mlp c_proj) + lm_head (a Linear)
        assert marker["status_counts"] == {"ok": 9}
        assert (out / key / "layers.csv").is_file()
    failure = json.loads((out / "_failures" / f"{model_key(str(missing))}.json").read_text())
    assert failure["exit_code"] == 3 and failure["retryable"] is False
    assert failure["attempts"] == 1  # permanent: never retried
    assert any("not found" in line for line in failure["stderr_tail"])
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [row["model_key"] for row in summary] == keys
    report_files = list((out / "runs").glob("*.json"))
    assert len(report_files) == 1
    report = json.loads(report_files[0].read_text())
    assert report["counts"]["done"] == 2 and report["counts"]["failed"] == 1

    before = {key: (out / key / "result.json").read_bytes() for key in keys}
    second = run_sweep(models, out, "--cpu-workers", "2")
    assert second.returncode == 1, second.stderr
    assert {key: (out / key / "result.json").read_bytes() for key in keys} == before
    reports = sorted((out / "runs").glob("*.json"))
    assert len(reports) == 2
    latest = json.loads(reports[-1].read_text())
    assert latest["counts"]["already_done"] == 2 and latest["counts"]["attempted"] == 1


def test_sweep_all_done_exits_zero_and_skip_failed(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """All good → exit 0. With a permanent failure recorded, --skip-failed does not try it
    again (its record keeps attempts == 1 from the first run), so the rerun exits 0."""
    missing = tmp_path / "gone"
    models = write_model_list(tmp_path / "models.csv", [(str(tiny_models[2]), "", "")])
    out = tmp_path / "results"
    assert run_sweep(models, out).returncode == 0
    both = write_model_list(tmp_path / "both.csv",
                            [(str(tiny_models[2]), "", ""), (str(missing), "", "")])
    assert run_sweep(both, out).returncode == 1
    record = out / "_failures" / f"{model_key(str(missing))}.json"
    first_record = record.read_bytes()
    skipped = run_sweep(both, out, "--skip-failed")
    assert skipped.returncode == 0, skipped.stderr
    assert record.read_bytes() == first_record


def _start_sweep(models: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(sweep_argv(models, out, *extra), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "the sweep ended too early"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("presses", [1, 2], ids=["ctrl-c-once", "ctrl-c-twice"])
def test_ctrl_c_stops_dispatching_and_the_same_command_resumes(
    presses: int, tiny_models: list[Path], tmp_path: Path
) -> None:
    """Ctrl+C once: no new model starts, the running worker finishes and writes its marker;
    twice: the running worker is terminated and leaves no marker. Either way the sweep
    exits 130, its run report says interrupted, and the same command then finishes the rest
    (exit 0) without redoing the model finished before the interrupt."""
    models = write_model_list(tmp_path / "models.csv", [(str(p), "", "") for p in tiny_models])
    out = tmp_path / "results"
    keys = [model_key(str(p)) for p in tiny_models]
    proc = _start_sweep(models, out)
    _wait_for(out / "logs" / "workers" / f"{keys[0]}.log", proc)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    started = sorted(p.stem for p in (out / "logs" / "workers").glob("*.log")
                     if not p.name.startswith("_worker-"))  # the workers' own logs
    assert started == [keys[0]]  # nothing was dispatched after the interrupt
    first_marker = out / keys[0] / "result.json"
    assert first_marker.exists() is (presses == 1)
    [report] = list((out / "runs").glob("*.json"))
    assert json.loads(report.read_text())["interrupted"] is True

    before = first_marker.read_bytes() if presses == 1 else None
    again = run_sweep(models, out)
    assert again.returncode == 0, again.stderr
    assert all((out / k / "result.json").is_file() for k in keys)
    if before is not None:
        assert first_marker.read_bytes() == before


def test_a_worker_killed_under_a_model_costs_it_one_attempt_and_the_rest_go_on(
    tiny_models: list[Path], tmp_path: Path
) -> None:
    """SIGKILL the long-lived worker while it analyses the first model (as the OOM killer
    would): the controller charges that model one attempt, starts a fresh worker, and every
    model ends done; the first model's log shows both attempts, the store no attempt note."""
    models = write_model_list(tmp_path / "models.csv", [(str(p), "", "") for p in tiny_models])
    out = tmp_path / "results"
    keys = [model_key(str(p)) for p in tiny_models]
    proc = _start_sweep(models, out)
    # The attempt note is written just before the worker says `start`; killed before that,
    # the model was only sent, not started (another error, no crash charged to it).
    _wait_for(out / "_attempts" / f"{keys[0]}.json", proc)
    time.sleep(0.3)  # `start` reaches the controller; the model takes seconds to analyse
    log_text = (out / "logs" / "esd-sweep.log").read_text()
    pid = int(log_text.split("worker 1 started on cpu pid=")[1].split()[0])
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert all((out / k / "result.json").is_file() for k in keys)
    # Killed at its first log line, seconds before its marker (transformers is still
    # importing): the retry is that model's second attempt.
    first_log = (out / "logs" / "workers" / f"{keys[0]}.log").read_text()
    assert "attempt 1 key=" in first_log and "attempt 2 key=" in first_log
    assert "WorkerCrashed: the worker was killed by SIGKILL" in stderr
    assert sorted(p.name for p in out.glob("_attempts/*")) == []
    assert sorted(p.name for p in out.glob("_failures/*")) == []


def test_custom_commands_run_under_the_same_management(tmp_path: Path) -> None:
    """--mode custom runs each command line (argv split, no shell) with the worker slots and
    records: one that exits 3 is a permanent failure (exit 1), the others succeed."""
    marker = tmp_path / "ran"
    commands = tmp_path / "commands.txt"
    commands.write_text(
        "# comment lines and blank lines are skipped\n\n"
        f"{sys.executable} -c \"open('{marker}-a', 'w').close()\"\n"
        f"{sys.executable} -c \"import sys; sys.exit(3)\"\n"
        f"{sys.executable} -c \"open('{marker}-b', 'w').close()\"\n"
    )
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "controller.cli", "run", "--mode", "custom", "--commands",
            str(commands), "--output-dir", str(out), "--device", "cpu", "--cpu-workers", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "ran-a").exists() and (tmp_path / "ran-b").exists()
    [report] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert report["mode"] == "custom"
    assert report["counts"]["done"] == 2 and report["counts"]["failed"] == 1


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing-commands", "--commands"),
        ("unbalanced-quote", "cannot split"),
        ("log-dir-blocked", "--log-dir"),
    ],
    ids=["missing-commands-file", "unbalanced-quote", "workers-log-dir-is-a-file"],
)
def test_configuration_mistakes_are_one_line_and_exit_2(
    setup: str, expected: str, tmp_path: Path
) -> None:
    """A user's mistake is a usage error (exit 2: CI must not read it as 'some models
    failed', exit 1), told in one line, never a traceback."""
    commands = tmp_path / "commands.txt"
    log_dir = tmp_path / "logs"
    if setup == "unbalanced-quote":
        commands.write_text("echo 'a\n")
    elif setup == "log-dir-blocked":
        commands.write_text(f"{sys.executable} -c pass\n")
        log_dir.mkdir()
        (log_dir / "workers").write_text("not a directory")
    argv = [sys.executable, "-m", "controller.cli", "run", "--mode", "custom", "--commands",
            str(commands), "--output-dir", str(tmp_path / "out"), "--device", "cpu",
            "--log-dir", str(log_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("esd-sweep: error")]
    assert len(errors) == 1 and expected in errors[0]


def test_a_token_in_worker_stderr_is_not_repeated_in_the_controller_log(tmp_path: Path) -> None:
    """The controller logs each failure's last stderr line (console and esd-sweep.log in
    the store's logs/): secrets in it are redacted there as in the failure record."""
    token = "hf_" + "Q" * 30
    commands = tmp_path / "commands.txt"
    # The worker gets the token from its environment, as HF_TOKEN reaches real workers.
    commands.write_text(f"{sys.executable} -c \"import os, sys; "
                        "print('401 Authorization: Bearer ' + os.environ['ESD_TEST_TOKEN'], "
                        "file=sys.stderr); sys.exit(3)\"\n")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "controller.cli", "run", "--mode", "custom", "--commands",
            str(commands), "--output-dir", str(out), "--device", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=os.environ | {"ESD_TEST_TOKEN": token})
    assert done.returncode == 1
    assert "401 Authorization" in done.stderr  # the line is logged...
    assert token not in done.stderr  # ...without the token
    assert token not in (out / "logs" / "esd-sweep.log").read_text()


def test_local_dry_run_prints_the_worker_commands_and_runs_nothing(tmp_path: Path) -> None:
    """--dry-run on this machine: one shell-quoted worker command per model still to do
    (the done one is left out), nothing analysed, no record, no run report."""
    out = tmp_path / "out"
    done = ModelRow("org/done", None, "", None)
    store = LocalStore(out)
    write_model_result(store, Marker(model=done.ref, model_key=done.key,
                                     parameters=AnalysisSettings().as_dict()),
                       layers=b"layer,alpha\nl0,3.0\n")
    odd = tmp_path / "it's a model; $(touch pwned)"
    odd.mkdir()
    models = write_model_list(tmp_path / "m.csv", [("org/done", "", ""), (str(odd), "", ""),
                                                   ("org/lora", "lora", "org/base@v1")])
    result = run_sweep(models, out, "--dry-run", "--fix-fingers", "xmin_mid")
    assert result.returncode == 0, result.stderr
    lines = [shlex.split(line) for line in result.stdout.splitlines()]
    assert [argv[argv.index("--model") + 1] for argv in lines] == [str(odd), "org/lora"]
    assert lines[1][lines[1].index("--base-model") + 1] == "org/base@v1"
    assert all(argv[argv.index("--device") + 1] == "cpu" for argv in lines)
    written = {k for k in store.list_keys() if not k.startswith("logs/")}
    assert written == {marker_key(done.key), f"{done.key}/layers.csv"}


def _output_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("a file")
    return tmp_path / "file" / "results"


def _output_is_a_file(tmp_path: Path) -> Path:
    (tmp_path / "results").write_text("a file")
    return tmp_path / "results"


def _read_only_output(tmp_path: Path) -> Path:
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("root may write to a read-only folder")
    out = tmp_path / "results"
    out.mkdir()
    out.chmod(0o500)
    return out


@pytest.mark.parametrize(
    ("make_output", "mode", "fragment"),
    [
        pytest.param(_output_under_a_file, "list", "is not a directory",
                     id="under-a-file"),
        pytest.param(_output_is_a_file, "list", "is not a directory", id="is-a-file"),
        pytest.param(_output_under_a_file, "custom", "is not a directory",
                     id="under-a-file-custom-commands"),
        pytest.param(_read_only_output, "list", "not writable", id="read-only"),
    ],
)
def test_an_output_no_worker_could_write_is_a_usage_error(
    tmp_path: Path, make_output: Callable[[Path], Path], mode: str, fragment: str
) -> None:
    """An output folder that is a file, lies under one or is read-only would fail every
    worker the same way: the controller checks it first and stops with exit 2 and one
    line naming --output-dir, before any worker starts. The log goes elsewhere
    (--log-dir): under the output, the log itself would be what fails."""
    out = make_output(tmp_path)
    log_dir = tmp_path / "logs"
    if mode == "list":
        models = write_model_list(tmp_path / "models.csv", [("org/model", "", "")])
        extra = ["--model-list", str(models)]
    else:
        commands = tmp_path / "commands.txt"
        commands.write_text(f"{sys.executable} -c pass\n")
        extra = ["--mode", "custom", "--commands", str(commands)]
    argv = [sys.executable, "-m", "controller.cli", "run", *extra, "--output-dir", str(out),
            "--device", "cpu", "--log-dir", str(log_dir)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env=os.environ | {"HF_HUB_OFFLINE": "1"})
    finally:
        if out.is_dir():
            out.chmod(0o700)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("esd-sweep: error")]
    assert len(errors) == 1, done.stderr
    assert "--output-dir" in errors[0] and str(out) in errors[0] and fragment in errors[0]
    assert not (log_dir / "workers").exists()  # no worker was started
