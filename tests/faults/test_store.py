"""The S3 store dies mid-sweep (moto's server over HTTP, stopped dead right after the first
layers.csv it stores): nothing half-written counts as done, and the rerun, with the store back,
finishes every model, each once.

The dead sweep could not release its lease, so the rerun waits for it to expire
(`--wait-lock`), as an operator's rerun after an outage does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from esd_worker.core.store.layout import read_marker
from esd_worker.core.store.marker import LAYERS_NAME
from esd_worker.core.store.s3 import S3Store
from tests.faults.conftest import esd_sweep, run_args, whole
from tests.support.s3server import S3Server

pytestmark = pytest.mark.slow


def test_the_store_dies_mid_sweep_and_the_rerun_finishes(
    model_list: Path, keys: list[str]
) -> None:
    dying = S3Server().start()
    try:
        bucket = dying.new_bucket()
        url = f"s3://{bucket}/results"
        dying.stop_after(lambda method, path: method == "PUT" and path.endswith(
            "/" + LAYERS_NAME))
        down = esd_sweep(*run_args(model_list, url, "--max-retries", "0"),
                         env=dying.subprocess_env(AWS_MAX_ATTEMPTS="1"))
    finally:
        dying.stop()
    assert down.returncode in (1, 3), down.stderr
    assert "Traceback" not in down.stderr

    back = S3Server().start()  # moto's state lives in this process: the bucket is still there
    try:
        store = S3Store(bucket, "results", client=back.client())
        tables = [key for key in keys if store.exists(f"{key}/{LAYERS_NAME}")]
        assert len(tables) == 1 and read_marker(store, tables[0]) is None  # half-written
        again = esd_sweep(*run_args(model_list, url, "--wait-lock", "180"),
                          env=back.subprocess_env())
        assert again.returncode == 0, again.stderr
        assert "took over the expired lease" in again.stderr  # the dead sweep's, and says so
        assert all(whole(store, key) for key in keys)
        (run,) = store.list_keys("runs")  # the dead sweep could not write its report
        report = json.loads(store.get_bytes(run) or b"")
        assert report["counts"]["done"] == 3
    finally:
        back.stop()
