"""`esd-sweep run --backend kubernetes` in its default, sharded mode, end to end.

CLI → kubeconfig → real client → KubeSim; tests.support.indexed.IndexedJobSimulator plays
the Job controller, and its pods run the worker's real batch loop (tests.support
.shardworker). Checks the exit-status contract and the --report JSON from the store's
outcomes, `status` afterwards, and a controller process SIGKILLed mid-run then started
again: every model done exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.cli import main
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import list_failure_keys, list_markers, run_report_key
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from tests.support import REPO_ROOT
from tests.support.cluster import NS, wait_for, write_list
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim
from tests.support.s3server import S3Server, serve_s3
from tests.support.shardworker import ShardWorker

pytestmark = pytest.mark.usefixtures("restore_logging")


def run_args(models: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--backend", "kubernetes", "--namespace", NS, "--model-list", str(models),
            "--output-dir", str(out), "--allow-local-output", "--no-telemetry",
            "--image", "ghcr.io/example/esd-sweep:0.1.0", "--poll-interval", "0.05",
            "--max-parallel", "3", *extra]


def test_exit_status_report_and_status_come_from_the_store(
    sim: KubeSim, kubeconfig: Path, out: Path, store: Store, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ids = [f"org/ok-{i}" for i in range(9)] + ["org/bad-missing"]
    models = write_list(tmp_path / "models.csv", ids)
    worker = ShardWorker(store)
    report_file = tmp_path / "ci" / "report.json"
    with IndexedJobSimulator(sim, namespace=NS).autopilot(worker):
        code = main(run_args(models, out, "--report", str(report_file)))
    assert code == 1  # one model failed for good
    report = json.loads(report_file.read_text())
    assert report["counts"]["done"] == 9 and report["counts"]["failed"] == 1
    (failure,) = report["failures"].values()
    assert failure["error"].startswith("PermanentModelError") and failure["retryable"] is False
    section = report["report"]["kubernetes"]
    assert section["mode"] == "sharded" and len(section["jobs"]) == 1
    assert section["jobs"][0]["state"] == "Complete"
    assert len((out / "summary.csv").read_text().splitlines()) == 10  # header + 9 done
    assert sim.count("create", "jobs") == 1
    capsys.readouterr()
    assert main(["status", "--model-list", str(models), "--output-dir", str(out)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["done"], status["todo"], status["failed_permanent"]) == (9, 0, 1)
    assert "bad_nodes" not in status  # no broken GPU met: nothing to quarantine


def test_a_broken_gpu_node_is_named_in_the_report_and_costs_no_model(
    sim: KubeSim, kubeconfig: Path, out: Path, store: Store, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One of 3 nodes fails every pod with exit 6: the run still exits 0 (every model
    done, none charged), and the --report JSON and the run report in the store name the
    node under kubernetes.bad_nodes, with its count and the worker's last line; `status`
    afterwards names it too."""
    models = write_list(tmp_path / "models.csv", [f"org/ok-{i}" for i in range(24)])
    worker = ShardWorker(store, broken_nodes=frozenset({"gpu-node-1"}))
    report_file = tmp_path / "report.json"
    indexed = IndexedJobSimulator(sim, namespace=NS, nodes=["gpu-node-0", "gpu-node-1",
                                                            "gpu-node-2"])
    with indexed.autopilot(worker):
        code = main(run_args(models, out, "--shard-size", "2", "--report", str(report_file)))
    assert code == 0
    report = json.loads(report_file.read_text())
    assert report["counts"]["done"] == 24 and report["failures"] == {}
    (bad,) = report["report"]["kubernetes"]["bad_nodes"]
    assert bad["node"] == "gpu-node-1" and bad["device_faults"] >= 1
    assert "DeviceError" in bad["error"]
    stored = json.loads(store.get_bytes(run_report_key(report["run_id"])) or b"{}")
    assert stored["kubernetes"]["bad_nodes"] == [bad]
    assert not list_failure_keys(store)
    capsys.readouterr()
    assert main(["status", "--model-list", str(models), "--output-dir", str(out)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["bad_nodes"] == {"run_id": report["run_id"], "nodes": ["gpu-node-1"]}


def test_a_controller_killed_mid_run_and_started_again_runs_every_model_once(
    sim: KubeSim, kubeconfig: Path, out: Path, store: Store, tmp_path: Path,
) -> None:
    ids = [f"org/ok-{i}" for i in range(24)]
    models = write_list(tmp_path / "m.csv", ids)
    indexed = IndexedJobSimulator(sim, namespace=NS)
    worker = ShardWorker(store)
    env = os.environ | {"KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen([sys.executable, "-m", "controller.cli", *run_args(models, out)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(lambda: indexed.jobs(), timeout_s=60)
        for _ in range(5):  # some shards finish while the first controller watches
            indexed.tick(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    assert 0 < len(list_markers(store)) < len(ids)

    report_file = tmp_path / "report.json"
    with indexed.autopilot(worker):
        assert main(run_args(models, out, "--report", str(report_file))) == 0
    report = json.loads(report_file.read_text())
    assert report["counts"]["done"] + report["counts"]["already_done"] == len(ids)
    assert report["report"]["kubernetes"]["attached"][0]["state"] == "Complete"
    assert set(worker.analysed) == {model_key(i) for i in ids}
    assert set(worker.analysed.values()) == {1}  # nothing analysed twice
    assert sim.count("create", "jobs") == 1  # the second controller had nothing to shard


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_the_model_list_and_the_results_in_s3(
    sim: KubeSim, kubeconfig: Path, s3_server: S3Server,
) -> None:
    """The documented cluster path: the list in the store (no ConfigMap to outgrow: 1 MiB,
    or 256 KiB through client-side apply), read by the controller from S3 through moto's
    server, sharded into the same store, every model analysed once by the shard pods."""
    bucket = s3_server.new_bucket()
    ids = [f"org/ok-{i}" for i in range(12)]
    rows = "".join(f"{i},,,{10**9}\n" for i in ids)
    s3_server.client().put_object(
        Bucket=bucket, Key="lists/models.csv",
        Body=("model_id,base_model_relation,source_model,size_bytes\n" + rows).encode())
    out_url = s3_server.url(bucket, "sweeps/atlas")
    store = open_store(out_url)
    worker = ShardWorker(store)
    with IndexedJobSimulator(sim, namespace=NS).autopilot(worker):
        code = main(["run", "--backend", "kubernetes", "--namespace", NS,
                     "--model-list", s3_server.url(bucket, "lists/models.csv"),
                     "--output-dir", out_url, "--no-telemetry", "--poll-interval", "0.05",
                     "--image", "ghcr.io/example/esd-sweep:0.1.0", "--max-parallel", "3"])
    assert code == 0
    assert set(worker.analysed) == {model_key(i) for i in ids}
    assert set(worker.analysed.values()) == {1}
    assert len(list_markers(store)) == len(ids)
    keys = s3_server.keys(bucket)
    assert any(k.startswith("sweeps/atlas/_shards/") for k in keys)

