"""An endpoint URL with a password never goes into a Job: the sweep refuses it (exit 2), says
how credentials reach the pods instead, and never repeats the password.

The controller passes AWS_ENDPOINT_URL, HF_ENDPOINT and a few other non-secret variables to
every worker as plain `env: value` (kubernetes/settings.py PASSTHROUGH_ENV): anyone who can
read a Job or a pod (`kubectl get job -o yaml`, a dry run's YAML) reads its values. The
paths a value takes to a Job: per-model Jobs and sharded Indexed Jobs, each created or
printed by --dry-run; a controller running in a pod gets the same environment (its
ConfigMap) and is refused the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from controller.backends.kubernetes.common.errors import JobSpecError
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from controller.cli import main
from tests.support.cluster import NS, write_list
from tests.support.kubesim import KubeSim

pytestmark = pytest.mark.usefixtures("restore_logging")

PASSWORD = "PASSW0RD-xyz"


def make_settings(**env: str) -> JobSettings:
    return JobSettings(image="ghcr.io/example/esd-sweep:0.1.0", namespace=NS,
                       run_id="20261123T070501Z-3fa9c2", s3_secret="esd-s3",
                       hf_token_secret="hf-token:token", env=env)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("AWS_ENDPOINT_URL", f"http://user:{PASSWORD}@minio.esd:9000", id="s3"),
        pytest.param("AWS_ENDPOINT_URL_S3", f"https://user:{PASSWORD}@s3.example",
                     id="s3-service"),
        pytest.param("HF_ENDPOINT", f"https://user:{PASSWORD}@hf-mirror.example", id="hub"),
        pytest.param("HF_ENDPOINT", f"https://{PASSWORD}@hf-mirror.example", id="token-as-user"),
        pytest.param("AWS_ENDPOINT_URL", f"http://user:{PASSWORD}/x@minio:9000",
                     id="slash-in-password"),
        pytest.param("AWS_ENDPOINT_URL", f"http://user:{PASSWORD}@x@minio:9000",
                     id="at-in-password"),
    ],
)
def test_an_env_url_with_userinfo_is_a_job_problem(name: str, value: str) -> None:
    """Every Job is checked by JobSettings.problems (build_job and build_indexed_job call
    it): a URL holding '@' after its scheme carries a user name, a password or a token. The
    problem names the variable and the Secrets to use, not the value."""
    problems = make_settings(**{name: value}).problems()
    (problem,) = problems
    assert problem.startswith(f"env: {name} ") and "--s3-secret" in problem
    assert "--hf-token-secret" in problem and PASSWORD not in problem


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("AWS_ENDPOINT_URL", "http://minio.esd:9000", id="s3"),
        pytest.param("HF_ENDPOINT", "https://hf-mirror.example/path", id="hub"),
        pytest.param("AWS_REGION", "us-east-1", id="region"),
    ],
)
def test_an_env_url_without_userinfo_is_fine(name: str, value: str) -> None:
    assert make_settings(**{name: value}).problems() == []


def test_no_job_of_either_kind_is_built_with_a_password() -> None:
    """A caller that skips the CLI's check (a test, a library user) still gets no Job:
    both builders refuse, and their error holds no password."""
    settings = make_settings(AWS_ENDPOINT_URL=f"http://user:{PASSWORD}@minio:9000")
    with pytest.raises(JobSpecError) as per_model:
        build_job(model_ref="org/m", model_key="org--m-1234567890", relation="",
                  source_model=None, output_url="s3://b/out", settings=settings)
    with pytest.raises(JobSpecError) as indexed:
        build_indexed_job(run_id=settings.run_id, class_name="gpu1", completions=1,
                          parallelism=1, backoff_limit_per_index=0,
                          shards_url="s3://b/out/_shards", output_url="s3://b/out",
                          settings=replace(settings))
    for raised in (per_model, indexed):
        assert "AWS_ENDPOINT_URL" in str(raised.value) and PASSWORD not in str(raised.value)


RUN = ("run", "--backend", "kubernetes", "--namespace", NS, "--allow-local-output",
       "--no-telemetry", "--image", "ghcr.io/example/esd-sweep:0.1.0")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("AWS_ENDPOINT_URL", f"http://user:{PASSWORD}@minio.esd:9000", id="s3"),
        pytest.param("HF_ENDPOINT", f"https://user:{PASSWORD}@hf-mirror.example", id="hub"),
    ],
)
@pytest.mark.parametrize(
    "mode",
    [
        # --no-wait: where Jobs are created (before the fix) the run returns, not waits.
        pytest.param(("--shard-size", "1", "--no-wait"), id="per-model"),
        pytest.param(("--shard-size", "1", "--dry-run"), id="per-model-dry-run"),
        pytest.param(("--poll-interval", "0.05", "--no-wait"), id="sharded"),
        pytest.param(("--dry-run",), id="sharded-dry-run"),
    ],
)
def test_a_sweep_with_a_password_in_an_endpoint_exits_2_and_creates_nothing(
    sim: KubeSim, kubeconfig: Path, out: Path, tmp_path: Path, name: str, value: str,
    mode: Sequence[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`esd-sweep run --backend kubernetes` with the variable set as a user would: exit 2
    (a setting to fix) before any Job is created or printed, one error line that names the
    variable and --s3-secret / --hf-token-secret; the password is in no output, no file
    and no object of the cluster."""
    monkeypatch.setenv(name, value)
    models = write_list(tmp_path / "models.csv", ["org/a", "org/b"])
    code = main([*RUN, "--model-list", str(models), "--output-dir", str(out), *mode,
                 "--report", str(tmp_path / "report.json")])
    printed = capsys.readouterr()
    assert code == 2
    (error,) = [line for line in printed.err.splitlines() if ": error:" in line]
    assert name in error and "--s3-secret" in error and "--hf-token-secret" in error
    assert sim.count("create", "jobs") == 0 and not sim.objects("jobs", NS)
    written = [path.read_text(errors="replace") for path in tmp_path.rglob("*")
               if path.is_file()]
    assert json.loads((tmp_path / "report.json").read_text())["exit_code"] == 2
    assert PASSWORD not in "\n".join([printed.out, printed.err, *written])
