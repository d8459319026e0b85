"""`esd-sweep run --backend kubernetes` end to end: CLI → kubeconfig → real client → KubeSim.

The CLI loads a kubeconfig (KUBECONFIG) whose server is the KubeSim URL, exactly as it
would load a real cluster's; JobSimulator (writing markers like the worker) plays the
cluster. Checks the exit-status contract, --report, --dry-run, --no-wait, and a controller
SIGKILLed mid-run and started again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.names import job_name
from controller.backends.local.backend import worker_argv
from controller.cli import main
from controller.settings import SweepSettings
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import MARKER_NAME
from esd_worker.core.store.opener import open_store
from tests.support import REPO_ROOT
from tests.support.cluster import NS, MarkerSimulator, wait_for, write_list
from tests.support.kubesim import K8S_VERSION, KubeSim

ROOT = REPO_ROOT
pytestmark = pytest.mark.usefixtures("restore_logging")


def run_args(models: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--backend", "kubernetes", "--shard-size", "1", "--namespace", NS,
            "--model-list", str(models), "--output-dir", str(out), "--allow-local-output",
            "--no-telemetry", "--image", "ghcr.io/example/esd-sweep:0.1.0", *extra]


IDS = ["org/alpha", "org/beta", "org/gamma"]


def test_run_reports_and_exits_by_contract(
    sim: KubeSim, kubeconfig: Path, cluster: MarkerSimulator, out: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One model fails permanently (exit 3): exit 1, its failure record and reason in the
    --report file and the run report; the others are done and in summary.csv."""
    models = write_list(tmp_path / "models.csv", IDS)
    bad = job_name(model_key("org/beta"))

    def script(job: Mapping[str, Any]) -> list[Any]:
        return [3] if job["metadata"]["name"] == bad else ["succeed"]

    report_file = tmp_path / "ci" / "report.json"
    with cluster.autopilot(script):
        code = main(run_args(models, out, "--report", str(report_file)))
    assert code == 1
    report = json.loads(report_file.read_text())
    assert report["exit_code"] == 1 and report["ok"] is False
    assert report["counts"]["done"] == 2 and report["counts"]["failed"] == 1
    (failure,) = report["failures"].values()
    assert failure["error"].startswith("PermanentModelError") and failure["exit_code"] == 3
    assert report["summary"] == f"{out}/summary.csv"
    stored = json.loads((out / "runs" / f"{report['run_id']}.json").read_text())
    assert stored["backend"] == "kubernetes"
    assert stored["kubernetes"]["jobs_created"] == 3
    assert stored["kubernetes"]["placement"] == "plain"
    record = json.loads((out / "_failures" / f"{model_key('org/beta')}.json").read_text())
    assert record["exit_code"] == 3 and record["stderr_tail"] == ["worker exited with 3"]
    assert len((out / "summary.csv").read_text().splitlines()) == 3
    assert sim.count("create", "jobs") == 3


def test_rbac_denied_exits_3_naming_the_verb(
    sim: KubeSim, kubeconfig: Path, out: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No RBAC permission to list Jobs: exit 3, one line naming the verb and the rule to add;
    --report is written with the error."""
    sim.forbid("list", "jobs", namespace=NS)
    report_file = tmp_path / "report.json"
    code = main(run_args(write_list(tmp_path / "m.csv", IDS), out, "--report",
                         str(report_file)))
    err = capsys.readouterr().err
    assert code == 3
    assert "RBAC" in err and "cannot list jobs.batch" in err and "add verb list" in err
    report = json.loads(report_file.read_text())
    assert report["exit_code"] == 3 and "RBAC" in report["error"] and report["run_id"] is None


def test_local_output_is_refused(kubeconfig: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    models = write_list(tmp_path / "m.csv", IDS)
    code = main(["run", "--backend", "kubernetes", "--shard-size", "1", "--model-list", str(models),
                 "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert "s3://" in capsys.readouterr().err


def test_bad_kubernetes_flags_are_all_reported(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    models = write_list(tmp_path / "m.csv", IDS)
    code = main(run_args(models, tmp_path / "o", "--cpu-request", "lots", "--node-selector",
                         "nolabel", "--max-pending", "3"))  # without --allow-pending
    err = capsys.readouterr().err
    assert code == 2
    assert "--cpu-request" in err and "--node-selector" in err and "--max-pending" in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--toleration", "dedicated"], "--toleration"),
    (["--toleration", "dedicated=gpu:Sometimes"], "--toleration"),
    (["--toleration", "bad key!=x:NoSchedule"], "--toleration"),
    (["--image-pull-secret", "Not_A_Name"], "--image-pull-secret"),
    (["--ttl-after-finished", "5"], "--ttl-after-finished"),
    (["--active-deadline", "0"], "--active-deadline"),
    (["--job-deadline", "0"], "--active-deadline"),
    (["--memory-request", "lots"], "--memory-request"),
    (["--ephemeral-storage-request", "big"], "--ephemeral-storage-request"),
    (["--memory-request", "1e999"], "--memory-request"),
    (["--memory-request", "16Ei"], "--memory-request"),
    (["--cpu-request", "1e16"], "--cpu-request"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_bad_pod_flags_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str,
) -> None:
    models = write_list(tmp_path / "m.csv", IDS)
    code = main(run_args(models, tmp_path / "o", *flags))
    err = capsys.readouterr().err
    assert code == 2 and named in err
    assert err.count(named) == 1  # one problem, said once (not by two layers of checks)
    assert "Traceback" not in err


def _read_yaml12(text: str) -> list[Any]:
    """As the API server reads it: YAML 1.2 (ruamel.yaml's pure-Python safe loader)."""
    import io

    from ruamel.yaml import YAML

    return list(YAML(typ="safe", pure=True).load_all(io.StringIO(text)))


@pytest.mark.parametrize("shard_size", ["1", "0"], ids=["per-model", "sharded"])
def test_pod_flags_and_sized_requests_reach_every_pod(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shard_size: str,
) -> None:
    """A private registry, a GPU pool's own taint, a TTL and a deadline reach the pods; the
    memory and disk requests are sized from the weights (the size_bytes column here): a
    7B model in bf16 fits a 16 GiB single-GPU node, an adapter's pod has room for its
    base. Read back as YAML 1.2 and valid for the oldest and newest Kubernetes supported."""
    models = tmp_path / "m.csv"
    models.write_text(
        "model_id,base_model_relation,source_model,size_bytes\n"
        "org/small,,,1000000000\n"
        "org/seven-b,,,14000000000\n"
        "org/seven-b-lora,adapter,org/seven-b,50000000\n")
    code = main(["run", "--backend", "kubernetes", "--shard-size", shard_size, "--dry-run",
                 "--model-list", str(models), "--output-dir", str(tmp_path / "out"),
                 "--image-pull-secret", "regcred", "--image-pull-secret", "mirror",
                 "--toleration", "dedicated=gpu:NoSchedule",
                 "--toleration", "nvidia.com/gpu.product:PreferNoSchedule",
                 "--ttl-after-finished", "3600", "--active-deadline", "7200",
                 "--node-selector", "pool=gpu"])
    assert code == 0
    docs = _read_yaml12(capsys.readouterr().out)
    assert docs
    requests = {}
    for doc in docs:
        for version in (K8S_VERSION, "1.37.0"):
            kubernetes_validate.validate(doc, version, strict=True)
        pod = doc["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu.product", "operator": "Exists",
             "effect": "PreferNoSchedule"}]
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert doc["spec"]["ttlSecondsAfterFinished"] == 3600
        assert pod["activeDeadlineSeconds"] == 7200
        assert "activeDeadlineSeconds" not in doc["spec"]
        (container,) = pod["containers"]
        res = container["resources"]["requests"]
        (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
        assert cache["emptyDir"]["sizeLimit"] == res["ephemeral-storage"]
        name = doc["metadata"]["annotations"].get("esd-sweep/model-ref") or \
            doc["metadata"]["labels"]["esd-sweep/shard-class"]
        requests[name] = (res["memory"], res["ephemeral-storage"])
    if shard_size == "1":
        assert requests == {
            "org/small": ("5Gi", "9Gi"),
            "org/seven-b": ("10Gi", "22Gi"),
            "org/seven-b-lora": ("10Gi", "22Gi"),  # its base is downloaded and read too
        }
    else:  # a class per band, sized for its largest model: two of them on disk (one
        # prefetched) for -small, one for gpu, so both fit a 100 GB boot disk
        assert requests == {"gpu-small": ("7Gi", "23Gi"), "gpu": ("16Gi", "36Gi")}


def test_dry_run_prints_valid_jobs_and_creates_nothing(
    sim: KubeSim, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--dry-run needs no cluster: the YAML is one Job per model, strict-valid for 1.31,
    secrets by reference only."""
    models = write_list(tmp_path / "m.csv", IDS)
    code = main(["run", "--backend", "kubernetes", "--shard-size", "1", "--dry-run",
                 "--model-list", str(models),
                 "--output-dir", str(tmp_path / "out"), "--hf-token-secret", "hf",
                 "--s3-secret", "s3-creds", "--node-selector", "pool=gpu",
                 "--kueue-queue", "team-a"])
    assert code == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["name"] for d in docs] == [job_name(model_key(i)) for i in IDS]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
        token = next(e for e in env if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token",
                                                      "optional": False}
        assert doc["spec"]["suspend"] is True
    assert sim.count("create", "jobs") == 0


def test_dry_run_passes_the_store_endpoint_but_no_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers must reach the same S3-compatible store as the controller: AWS_ENDPOINT_URL
    and the region go into each Job as plain env; the access keys never do (Secrets only)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.minio:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE00")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak-this-secret")
    models = write_list(tmp_path / "m.csv", IDS[:1])
    code = main(["run", "--backend", "kubernetes", "--shard-size", "1", "--dry-run",
                 "--model-list", str(models),
                 "--output-dir", str(tmp_path / "out"), "--s3-secret", "s3-creds"])
    assert code == 0
    out = capsys.readouterr().out
    [doc] = list(yaml.safe_load_all(out))
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    env = {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.minio:9000"
    assert env["AWS_REGION"]["value"] == "eu-west-1"
    assert "valueFrom" in env["AWS_SECRET_ACCESS_KEY"]
    assert "do-not-leak-this-secret" not in out and "AKIAEXAMPLEEXAMPLE00" not in out


def test_cluster_worker_flags_match_the_local_ones(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The Job's container args are the local worker's flags with `esd-worker` as program."""
    models = write_list(tmp_path / "m.csv", ["org/alpha"])
    main(["run", "--backend", "kubernetes", "--shard-size", "1", "--dry-run",
          "--model-list", str(models),
          "--output-dir", str(tmp_path / "out"), "--fix-fingers", "DKS", "--no-eigs",
          "--log-format", "json"])
    (doc,) = yaml.safe_load_all(capsys.readouterr().out)
    args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
    row = ModelRow("org/alpha", None, "", None)
    spec = WorkerSpec(run_id="r", store_url=str(tmp_path / "out"), log_format="json",
                      save_eigs=False, analysis=AnalysisSettings(fix_fingers="DKS"))
    local = worker_argv(("esd-worker",), row, spec, "cuda")

    def pairs(argv: Sequence[str]) -> set[tuple[str, str]]:
        out, i = set(), 1
        while i < len(argv):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") \
                else ""
            out.add((argv[i], value))
            i += 2 if value else 1
        return out

    assert args[0] == "esd-worker" == local[0]
    assert pairs(args) == pairs(local)


def test_no_wait_leaves_jobs_and_the_next_run_adopts_them(
    sim: KubeSim, kubeconfig: Path, cluster: MarkerSimulator, out: Path, tmp_path: Path,
) -> None:
    """--no-wait: exit 0 with two Jobs running (the cap); a later run adopts them, submits
    the third, and every model has exactly one Job."""
    models = write_list(tmp_path / "m.csv", IDS)
    report_file = tmp_path / "r1.json"
    assert main(run_args(models, out, "--no-wait", "--max-active-jobs", "2",
                         "--report", str(report_file))) == 0
    first = json.loads(report_file.read_text())
    assert first["counts"]["running"] == 2
    assert len(first["report"]["kubernetes"]["jobs_left_running"]) == 2
    with cluster.autopilot():
        assert main(run_args(models, out, "--report", str(report_file))) == 0
    second = json.loads(report_file.read_text())
    assert second["counts"]["done"] == 3
    assert second["report"]["kubernetes"]["jobs_adopted"] == 2
    assert sim.count("create", "jobs") == 3
    assert sorted(j["metadata"]["name"] for j in sim.objects("jobs", NS)) == sorted(
        job_name(model_key(i)) for i in IDS)


def test_controller_killed_mid_run_and_restarted(
    sim: KubeSim, kubeconfig: Path, cluster: MarkerSimulator, out: Path, tmp_path: Path,
) -> None:
    """A controller process is SIGKILLed with Jobs in flight; one Job finishes while none
    runs. The next controller creates no Job twice, loses no result, and the failure the
    first one saw is on record."""
    ids = ["org/m0", "org/m1", "org/m2", "org/m3"]
    models = write_list(tmp_path / "m.csv", ids)
    names = [job_name(model_key(i)) for i in ids]
    env = os.environ | {"KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", *run_args(models, out, "--max-active-jobs",
                                                           "2")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        store = open_store(str(out))
        wait_for(lambda: len(sim.objects("jobs", NS)) == 2, timeout_s=30)
        cluster.fail(names[0], 3, log="model not found\n")
        cluster.succeed(names[1])
        wait_for(lambda: store.exists(f"_failures/{model_key(ids[0])}.json"))
        wait_for(lambda: len(sim.objects("jobs", NS)) == 4)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    cluster.succeed(names[2])  # finishes while no controller watches
    creates_before = sim.count("create", "jobs")
    assert creates_before == 4

    with cluster.autopilot():
        code = main(run_args(models, out))
    assert code == 0
    jobs = sorted(j["metadata"]["name"] for j in sim.objects("jobs", NS))
    # Only the model that failed (retried, since --skip-failed is not given) got a new Job.
    assert jobs == sorted([*names, job_name(model_key(ids[0]), 1)])
    assert sim.count("create", "jobs") == 5
    for i in ids:
        assert store.exists(f"{model_key(i)}/{MARKER_NAME}")
    assert not store.exists(f"_failures/{model_key(ids[0])}.json")  # cleared on success


def test_local_backend_does_not_import_kubernetes() -> None:
    """The kubernetes client is an optional extra: the CLI, the sweep, the backend module,
    its settings and its errors import without it (only KubernetesBackend.from_settings
    pulls controller.backends.kubernetes.common.client in)."""
    code = ("import sys; sys.modules['kubernetes'] = None\n"
            "import controller.cli, controller.run.sweep\n"
            "import controller.backends.kubernetes.per_model.backend\n"
            "import controller.backends.kubernetes.common.settings\n"
            "import controller.backends.kubernetes.common.errors\n"
            "assert 'controller.backends.kubernetes.common.client' not in sys.modules\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_wait_timing_is_bounded(sim: KubeSim, kubeconfig: Path, cluster: MarkerSimulator,
                                out: Path, tmp_path: Path) -> None:
    """--wait returns promptly once the last Job ends (no watch timeout to sit out)."""
    models = write_list(tmp_path / "m.csv", IDS[:1])
    started = time.monotonic()
    with cluster.autopilot():
        assert main(run_args(models, out)) == 0
    assert time.monotonic() - started < 10


def test_report_is_written_for_the_local_backend_on_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--report works for both backends and also when the run never started."""
    report_file = tmp_path / "report.json"
    code = main(["run", "--model-list", str(write_list(tmp_path / "m.csv", IDS)),
                 "--output-dir", str(tmp_path / "out"), "--limit", "0",
                 "--report", str(report_file)])
    assert code == 2
    report = json.loads(report_file.read_text())
    assert report == {"exit_code": 2, "ok": False, "error": report["error"], "run_id": None,
                      "counts": {}, "failures": {}, "summary": None, "run_report": None}
    assert "--limit" in report["error"]


def test_api_unreachable_after_retries_is_an_infrastructure_error(
    sim: KubeSim, tmp_path: Path,
) -> None:
    """The API server stays down longer than the client's retry deadline: the sweep stops
    with InfrastructureError (exit 3) saying the API is unreachable."""
    from controller.backends.kubernetes.common.client import KubeClient, RetryPolicy
    from controller.backends.kubernetes.common.settings import ClusterSettings
    from controller.backends.kubernetes.per_model.backend import KubernetesBackend
    from controller.errors import EXIT_INFRA, InfrastructureError
    from controller.run.sweep import run_sweep

    settings = SweepSettings(
        output=str(tmp_path / "out"), single_model="org/alpha", backend="kubernetes",
        cluster=ClusterSettings(namespace=NS, allow_local_output=True, telemetry=False))
    sim.api_down(30)
    retry = RetryPolicy(attempts=3, base_s=0.01, max_s=0.02, deadline_s=0.5)
    with KubeClient(sim.configuration(), retry=retry) as kube, \
            pytest.raises(InfrastructureError, match="unreachable") as raised:
        run_sweep(settings, opener=lambda s, spec: KubernetesBackend.from_settings(
            s, spec, kube=kube))
    assert raised.value.exit_code == EXIT_INFRA
