"""A whole local sweep into S3 (moto's server over HTTP, real boto3 in every process).

Users on clusters keep results in S3: the controller must plan from the markers it lists
there, the workers must write there directly, and summary.csv / runs/ must land beside them.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from tests.support import REPO_ROOT
from tests.support.builders import make_gpt2
from tests.support.s3server import S3Server, serve_s3

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def sweep(server: S3Server, models: Path, url: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "controller.cli", "run", "--model-list", str(models),
            "--output-dir", url, "--device", "cpu", "--cpu-workers", "2",
            "--retry-backoff", "0.1"]
    env = server.subprocess_env() | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_sweep_into_s3_then_resume_from_its_markers(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Both models' three files, summary.csv and a run report land under the prefix; the
    rerun lists the markers, starts no worker and rewrites no marker (same ETags)."""
    dirs = [make_gpt2(tmp_path / f"m{i}", seed=i) for i in range(2)]
    models = tmp_path / "models.csv"
    models.write_text("model_id\n" + "".join(f"{d}\n" for d in dirs))
    bucket = s3_server.new_bucket()
    url = s3_server.url(bucket, "sweeps/a")

    first = sweep(s3_server, models, url)
    assert first.returncode == 0, first.stderr
    keys = set(s3_server.keys(bucket, "sweeps/a/"))
    for d in dirs:
        key = model_key(str(d))
        expected = {f"sweeps/a/{key}/{name}" for name in ("layers.csv", "eigs.npz", "result.json")}
        assert expected <= keys
    assert "sweeps/a/summary.csv" in keys
    reports = [k for k in keys if k.startswith("sweeps/a/runs/")]
    assert len(reports) == 1
    client = s3_server.client()
    summary = client.get_object(Bucket=bucket, Key="sweeps/a/summary.csv")["Body"].read()
    assert len(list(csv.DictReader(io.StringIO(summary.decode())))) == 2
    etags = {k: client.head_object(Bucket=bucket, Key=k)["ETag"]
             for k in keys if k.endswith("result.json")}

    second = sweep(s3_server, models, url)
    assert second.returncode == 0, second.stderr
    reports = sorted(k for k in s3_server.keys(bucket, "sweeps/a/runs/"))
    latest = json.loads(client.get_object(Bucket=bucket, Key=reports[-1])["Body"].read())
    assert latest["counts"]["already_done"] == 2 and latest["counts"]["attempted"] == 0
    assert {k: client.head_object(Bucket=bucket, Key=k)["ETag"] for k in etags} == etags


def test_sweep_into_a_missing_bucket_is_an_infrastructure_error(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Exit 3 (infrastructure) with one line naming the bucket; no worker is started."""
    models = tmp_path / "models.csv"
    models.write_text(f"model_id\n{tmp_path / 'whatever'}\n")
    done = sweep(s3_server, models, "s3://no-such-bucket-esd/x")
    assert done.returncode == 3, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors and "no-such-bucket-esd" in errors[-1] and "does not exist" in errors[-1]
    assert "Traceback" not in done.stderr
    assert os.environ.get("AWS_SECRET_ACCESS_KEY", "\0") not in done.stderr
