"""Secrets never leave a command, and files get the modes they should: both CLIs end to end.

What users rely on: credentials pasted into an s3:// URL are a usage error (exit 2, one
line) that never repeats them, in every command; a secret a model carries (a token in its
adapter_config.json, the HF_TOKEN value) reaches no log, record or report; results follow
the umask (a shared results folder stays readable) while logs are the owner's only (0600).
"""

from __future__ import annotations

import csv
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

KEY_ID, SECRET = "AKEYID0123", "s3cr3tPart"
PLAIN = f"s3://{KEY_ID}:{SECRET}@bucket/x"
# An AWS secret key holds '/', and pasted unencoded it ends the URL's host part early.
SLASHED = f"s3://{KEY_ID}:{SECRET}/Two@bucket/x"


def _controller(*args: str) -> list[str]:
    return [sys.executable, "-m", "controller.cli", *args]


def _worker(*args: str) -> list[str]:
    return [sys.executable, "-m", "esd_worker.cli", *args]


def _every_file(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        pytest.param(_controller("run", "--model-list", "{list}", "--output-dir", "{url}",
                                 "--report", "{report}"), PLAIN, id="run"),
        pytest.param(_controller("status", "--model-list", "{list}", "--output-dir", "{url}"),
                     PLAIN, id="status"),
        pytest.param(_controller("run", "--model-list", "{list}", "--output-dir", "{url}",
                                 "--report", "{report}"), SLASHED, id="run-slashed"),
        pytest.param(_controller("run", "--model-list", "{url}/models.csv", "--output-dir",
                                 "{out}"), SLASHED, id="run-list-url-slashed"),
        pytest.param(_controller("status", "--model-list", "{list}", "--output-dir", "{url}"),
                     SLASHED, id="status-slashed"),
        pytest.param(_controller("report", "--output-dir", "{url}"), SLASHED, id="report-slashed"),
        pytest.param(_controller("refit", "--output-dir", "{url}"), SLASHED, id="refit-slashed"),
        pytest.param(_controller("compare", "{url}", "{url}"), SLASHED, id="compare-slashed"),
        pytest.param(_worker("--model", "org/m", "--output", "{url}"), SLASHED,
                     id="worker-slashed"),
    ],
)
def test_credentials_in_an_s3_url_are_a_usage_error_never_echoed(
    argv: Sequence[str], url: str, tmp_path: Path
) -> None:
    """Exit 2 and one error line naming the problem; neither the key id nor the secret is
    on stderr, stdout, in the --report file or in any file the command wrote."""
    model_list = tmp_path / "models.csv"
    model_list.write_text("model_id\norg/m\n")
    report = tmp_path / "report.json"
    values = {"list": str(model_list), "url": url, "report": str(report),
              "out": str(tmp_path / "out")}
    done = subprocess.run([arg.format(**values) for arg in argv], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "credentials in an s3:// URL" in errors[0], done.stderr
    written = "".join(path.read_text(errors="replace") for path in _every_file(tmp_path))
    for text in (done.stderr, done.stdout, written):
        assert KEY_ID not in text and SECRET not in text
    if "--report" in argv:
        assert '"exit_code": 2' in report.read_text()


# --- a sweep whose models carry secrets, under two umasks ---------------------------------

ENV_TOKEN = "envTokenValue-0123456789"  # no token shape: only HF_TOKEN says it is a secret
SHAPED = "hf_" + "Zq9" * 12  # the shape of an HF token


def _write_list(path: Path, models: Sequence[Path]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", "base_model_relation", "source_model"])
        writer.writerows([str(model), "", ""] for model in models)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("umask", "result_mode"),
    [pytest.param(0o022, 0o644, id="umask-022"), pytest.param(0o027, 0o640, id="umask-027")],
)
def test_model_secrets_stay_out_of_logs_and_records_and_results_follow_the_umask(
    gpt2_dir: Path, tmp_path: Path, umask: int, result_mode: int
) -> None:
    """A base model analyses; two adapters name their base by a secret (a token-shaped id,
    and the HF_TOKEN value) and fail on it. The worker logs, the controller log, the failure
    records, the run report, the report page and the output hold neither secret; logs are
    0600; results (layers.csv, eigs.npz, result.json, summary.csv, runs/, _failures/,
    report/) are 0666 less the umask."""
    from tests.support.builders import GPT2_TARGETS, make_lora_adapter

    models = tmp_path / "models"
    adapters = [
        make_lora_adapter(gpt2_dir, models / name, target_modules=GPT2_TARGETS,
                          fan_in_fan_out=True, base_model_name_or_path=f"org/{secret}")
        for name, secret in (("shaped", SHAPED), ("env", ENV_TOKEN))
    ]
    model_list = _write_list(tmp_path / "models.csv", [gpt2_dir, *adapters])
    out = tmp_path / "out"
    env = os.environ | {"HF_TOKEN": ENV_TOKEN, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                        "HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        _controller("run", "--model-list", str(model_list), "--output-dir", str(out),
                    "--device", "cpu", "--report", str(out / "ci.json")),
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, umask=umask)
    assert run.returncode == 1, run.stderr  # the adapters failed, the base is done
    assert "could not be resolved" in run.stderr  # the failure is logged, its secret not
    report = subprocess.run(_controller("report", "--output-dir", str(out)), capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=600, umask=umask)
    assert report.returncode == 0, report.stderr

    files = _every_file(out)
    for path in files:
        text = path.read_bytes().decode("utf-8", "replace")
        assert SHAPED not in text and ENV_TOKEN not in text, path
    for text in (run.stderr, run.stdout, report.stderr):
        assert SHAPED not in text and ENV_TOKEN not in text

    logs = out / "logs"
    worker_logs = list((logs / "workers").glob("*.log"))
    adapter_logs = [logs / "workers" / f"{model_key(str(a))}.log" for a in adapters]
    assert set(adapter_logs) <= set(worker_logs)
    assert all("could not be resolved" in p.read_text() for p in adapter_logs)
    for path in [logs / "esd-sweep.log", *worker_logs]:
        assert _mode(path) == 0o600, path

    base = model_key(str(gpt2_dir))
    results = [out / base / "layers.csv", out / base / "eigs.npz", out / base / "result.json",
               out / "summary.csv", out / "report" / "index.html", out / "ci.json",
               *(out / "runs").glob("*.json"), *(out / "_failures").glob("*.json")]
    assert len(results) == 9  # one run report, two failure records
    for path in results:
        assert _mode(path) == result_mode, path


# --- endpoint URLs with a password, on the local backend --------------------------------

ENDPOINT_PASSWORD = "endpointPassW0rd"


@pytest.mark.parametrize(
    "extra", [pytest.param((), id="run"), pytest.param(("--dry-run",), id="dry-run")],
)
def test_endpoint_passwords_reach_local_workers_by_environment_only(
    tmp_path: Path, extra: Sequence[str]
) -> None:
    """The local backend's workers inherit the environment, a password in HF_ENDPOINT or
    AWS_ENDPOINT_URL included (that is how they reach a mirror that wants one), so the run
    is not refused as a Kubernetes one is. The URLs are never in a worker's argv (the dry
    run prints it), a log, a failure record or the run report: the hub double is asked
    for the model (the worker used the endpoint), the model is missing there, and the
    password is in no output."""
    from tests.support.hubserver import HubServer

    model_list = tmp_path / "models.csv"
    model_list.write_text("model_id\norg/missing\n")
    out = tmp_path / "out"
    with HubServer() as hub:
        endpoint = hub.url.replace("://", f"://user:{ENDPOINT_PASSWORD}@", 1)
        env = hub.env(tmp_path / "hf") | {
            "HF_ENDPOINT": endpoint, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
            "AWS_ENDPOINT_URL": f"http://user:{ENDPOINT_PASSWORD}@127.0.0.1:9"}
        run = subprocess.run(
            _controller("run", "--model-list", str(model_list), "--output-dir", str(out),
                        "--device", "cpu", "--max-retries", "0", *extra),
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        asked = [r for r in hub.requests if "org/missing" in r.path]
    assert run.returncode == (0 if extra else 1), run.stderr
    if not extra:
        assert asked, "the worker did not use HF_ENDPOINT"
        assert (out / "_failures").is_dir()
    else:
        assert "esd_worker.cli --model org/missing" in run.stdout
    written = [path.read_text(errors="replace") for path in _every_file(tmp_path)]
    assert ENDPOINT_PASSWORD not in "\n".join([run.stdout, run.stderr, *written])
