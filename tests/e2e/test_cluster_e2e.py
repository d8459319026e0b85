"""Opt-in tests against a real cluster: skipped unless KUBECONFIG is set.

ESD_E2E_NAMESPACE (default esd-sweep): the namespace from `kubectl apply -k manifests/`.
ESD_E2E_OUTPUT (s3://bucket/prefix, required): a one-model sweep runs for real with
ESD_E2E_MODEL (default sentence-transformers/all-MiniLM-L6-v2) in ESD_IMAGE, and
ESD_E2E_S3_SECRET / ESD_E2E_HF_SECRET name the Secrets the pods read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("KUBECONFIG"),
                                reason="needs a real cluster: set KUBECONFIG")

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = os.environ.get("ESD_E2E_NAMESPACE", "esd-sweep")


def test_rbac_allows_what_the_controller_calls() -> None:
    """The controller's reads work in the namespace (list jobs, pods, events)."""
    from controller.backends.kubernetes.common.client import load_client
    from controller.backends.kubernetes.common.names import managed_selector

    with load_client() as kube:
        kube.list_jobs(NAMESPACE, managed_selector())
        kube.list_pods(NAMESPACE, "app.kubernetes.io/name=esd-gpu-exporter")
        kube.list_events(NAMESPACE, "involvedObject.kind=Job")


def test_dry_run_is_accepted_by_the_server(tmp_path: Path) -> None:
    """What --dry-run prints passes the real API server's validation (server-side dry run)."""
    models = tmp_path / "models.csv"
    models.write_text("model_id\nopenai-community/gpt2\n")
    printed = subprocess.run(
        [sys.executable, "-m", "controller.cli", "run", "--backend", "kubernetes",
         "--dry-run", "--namespace", NAMESPACE, "--model-list", str(models),
         "--output-dir", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    applied = subprocess.run(
        ["kubectl", "apply", "--dry-run=server", "-f", "-"], input=printed.stdout,
        capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr


def test_one_model_sweep_on_the_cluster(tmp_path: Path) -> None:
    if not os.environ.get("ESD_E2E_OUTPUT"):
        pytest.fail("set ESD_E2E_OUTPUT=s3://bucket/prefix (a store the pods can write)")
    models = tmp_path / "models.csv"
    models.write_text("model_id\n" + os.environ.get(
        "ESD_E2E_MODEL", "sentence-transformers/all-MiniLM-L6-v2") + "\n")
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "controller.cli", "run", "--backend", "kubernetes",
            "--namespace", NAMESPACE, "--model-list", str(models),
            "--output-dir", os.environ["ESD_E2E_OUTPUT"], "--wait", "--report", str(report),
            "--pending-timeout", "300"]
    if os.environ.get("ESD_E2E_S3_SECRET"):
        argv += ["--s3-secret", os.environ["ESD_E2E_S3_SECRET"]]
    if os.environ.get("ESD_E2E_HF_SECRET"):
        argv += ["--hf-token-secret", os.environ["ESD_E2E_HF_SECRET"]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-4000:]
    outcome = json.loads(report.read_text())
    assert outcome["counts"]["done"] + outcome["counts"]["already_done"] == 1
