"""The S3 lease and a whole sweep on Google Cloud Storage's XML API dialect: real boto3
through tests/support/gcsproxy.py (GCS's checksum refusals and generation preconditions,
S3's If-None-Match / If-Match on writes ignored) in front of moto's server.

On a store that ignored the lease's conditions two sweeps would both "win"; these tests
hold the lease to GCS's own precondition header (esd_worker.core.store.s3dialect).
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.output.lease import (
    observe,
)
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import LEASE_KEY
from tests.support import REPO_ROOT
from tests.support.builders import make_gpt2
from tests.support.gcsproxy import GcsProxy, serve_gcs
from tests.support.leasechecks import (
    overwritten_behind_its_back,
    race_for_the_lease,
    renewal_keeps_the_lease,
)
from tests.support.s3server import make_store


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsProxy]:
    yield from serve_gcs()


def test_the_lease_is_taken_renewed_and_released(gcs: GcsProxy) -> None:
    """As on S3 (tests/support/leasechecks.py), with nothing GCS refuses."""
    renewal_keeps_the_lease(make_store(gcs.upstream))
    assert gcs.refused == []


def test_two_sweeps_racing_for_a_free_lease_exactly_one_wins(gcs: GcsProxy) -> None:
    """Both see the lease free, then both write at once: GCS's generation-0 precondition
    lets one through; the other, looking again, finds it held by the winner."""
    store = make_store(gcs.upstream)
    winner = race_for_the_lease(store, None, renew=False)
    winner.release()
    assert observe(store) is None


def test_a_lease_replaced_behind_its_back_is_lost_and_left_alone(gcs: GcsProxy) -> None:
    """Another holder's write replaces the lease: the renewal's generation no longer
    matches, so the sweep learns it lost the lease, and its release deletes nothing."""
    store = make_store(gcs.upstream)
    stale, other_token = overwritten_behind_its_back(store)
    stale.release()
    seen = observe(store)
    assert seen is not None and seen.owner is not None and seen.owner.token == other_token


@pytest.mark.slow
def test_a_sweep_runs_into_gcs(gcs: GcsProxy, tmp_path: Path) -> None:
    """`esd-sweep run` (local backend, one tiny GPT-2) with AWS_ENDPOINT_URL at GCS and
    AWS_REGION=auto: the model's files, summary.csv and a run report land under the
    prefix, nothing is refused, and the lease is gone afterwards."""
    model = make_gpt2(tmp_path / "m0", seed=0)
    models = tmp_path / "models.csv"
    models.write_text(f"model_id\n{model}\n")
    server = gcs.upstream
    bucket = server.new_bucket()
    url = server.url(bucket, "sweeps/g")
    argv = [sys.executable, "-m", "controller.cli", "run", "--model-list", str(models),
            "--output-dir", url, "--device", "cpu", "--cpu-workers", "1",
            "--retry-backoff", "0.1"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
                          env=gcs.env(HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    assert gcs.refused == []
    keys = set(server.keys(bucket, "sweeps/g/"))
    key = model_key(str(model))
    assert {f"sweeps/g/{key}/{name}" for name in ("layers.csv", "eigs.npz", "result.json")} <= keys
    assert f"sweeps/g/{LEASE_KEY}" not in keys
    assert any(k.startswith("sweeps/g/runs/") for k in keys)
    summary = server.client().get_object(Bucket=bucket, Key="sweeps/g/summary.csv")
    assert len(list(csv.DictReader(io.StringIO(summary["Body"].read().decode())))) == 1
