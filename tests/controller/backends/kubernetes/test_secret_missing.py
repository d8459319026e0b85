"""A worker pod that can never start ends the run at once: the HF token Secret (required)
missing, or its key, leaves the pod Waiting in CreateContainerConfigError, which no
--pending-timeout mends. Both modes end with exit 3 and one line naming the Secret, the
flag and the namespace; the Jobs whose pods cannot start are deleted (a later run must not
adopt them). The kubelet is kubesim's JobSimulator.start_container, which resolves the
pod's secretKeyRefs against the Secrets in the API (v1/secrets over HTTP).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from controller.backends.kubernetes.common.client import KubeClient
from controller.backends.kubernetes.common.diagnosis import config_error
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.errors import EXIT_INFRA, describe_error
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.stores import Store
from tests.controller.backends.kubernetes.test_sharded import backend_for, rows
from tests.controller.backends.kubernetes.test_sharded_stuck import Background
from tests.support.cluster import NS, make_backend, make_rows, run_in_thread, wait_for
from tests.support.kubesim import JobSimulator, KubeSim

TOKEN = "hf-token:token"
NOT_FOUND = "Secret hf-token (--hf-token-secret) not found in namespace esd"
NO_KEY = "Secret hf-token (--hf-token-secret) in namespace esd has no key token"


def waiting(message: str, reason: str = "CreateContainerConfigError") -> dict[str, Any]:
    return {"metadata": {"name": "p", "creationTimestamp": "2026-11-26T17:00:00Z"},
            "status": {"phase": "Pending", "containerStatuses": [
                {"name": "worker", "state": {"waiting": {"reason": reason,
                                                         "message": message}}}]}}


CASES = {
    "no-secret": (waiting('secret "hf-token" not found'), NOT_FOUND),
    "no-key": (waiting("couldn't find key token in Secret esd/hf-token"), NO_KEY),
    "other-secret": (waiting('secret "other" not found'),
                     'pod p cannot start: CreateContainerConfigError: secret "other" not found'),
    "run-as-root": (waiting("container has runAsNonRoot and image will run as root"),
                    "pod p cannot start: CreateContainerConfigError: container has "
                    "runAsNonRoot and image will run as root"),
    "creating": (waiting("", reason="ContainerCreating"), None),
    "image-pull": (waiting("Back-off pulling image", reason="ImagePullBackOff"), None),
    "no-status": ({"metadata": {"name": "p"}, "status": {"phase": "Pending"}}, None),
}


@pytest.mark.parametrize(("pod", "line"), CASES.values(), ids=CASES.keys())
def test_config_error(pod: dict[str, Any], line: str | None) -> None:
    """Only CreateContainerConfigError never mends itself; the HF token Secret's is worded
    for --hf-token-secret, with the way out."""
    found = config_error([pod], namespace="esd", hf_token_secret=TOKEN)
    assert found == line or (line is not None and found is not None and found.startswith(line))
    if line == NOT_FOUND:
        assert found is not None and found.endswith(
            "create it (docs/kubernetes.md), or drop --hf-token-secret if no model in the "
            "list is gated")


SECRETS = {
    "missing": (None, NOT_FOUND),
    "wrong-key": ({"hf_token": "aGY="}, NO_KEY),
}


def create_secret(sim: KubeSim, data: dict[str, str]) -> None:
    JobSimulator(sim, namespace=NS)._core.create_namespaced_secret(NS, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}, "data": data})


@pytest.mark.parametrize(("data", "line"), SECRETS.values(), ids=SECRETS.keys())
def test_sharded_run_ends_at_once(sim: KubeSim, kube: KubeClient, store: Store,
                                  data: dict[str, str] | None, line: str) -> None:
    """--pending-timeout 600, yet the run ends within a few polls of the pod's
    CreateContainerConfigError: exit 3, one line, the Job deleted."""
    if data is not None:
        create_secret(sim, data)
    backend = backend_for(kube, store, hf_token_secret=TOKEN, pending_timeout_s=600)
    background = Background(backend, rows(["a", "b"]), store)
    (name,) = wait_for(lambda: [j["metadata"]["name"] for j in sim.objects("jobs", NS)])
    started = time.monotonic()
    JobSimulator(sim, namespace=NS).start_container(name)
    background.join()
    assert background.ended_at is not None and background.ended_at - started < 5
    status, message = describe_error(background.error or Exception()) or (0, "")
    assert status == EXIT_INFRA and message.startswith(line) and "\n" not in message
    assert f"Job {name} deleted" in message
    assert sim.objects("jobs", NS) == []


@pytest.mark.parametrize(("data", "line"), SECRETS.values(), ids=SECRETS.keys())
def test_per_model_run_ends_at_once(sim: KubeSim, kube: KubeClient, store: Store,
                                    data: dict[str, str] | None, line: str) -> None:
    """One Job per model: the oldest waiting Job's pod says it; every waiting Job is
    deleted and the run ends with exit 3 before the pending timeout."""
    if data is not None:
        create_secret(sim, data)
    backend = make_backend(kube, store, hf_token_secret=TOKEN, pending_timeout_s=4)
    thread = run_in_thread(backend, make_rows(2))
    names = wait_for(lambda: [j["metadata"]["name"] for j in sim.objects("jobs", NS)
                              ] if len(sim.objects("jobs", NS)) == 2 else None)
    started = time.monotonic()
    JobSimulator(sim, namespace=NS).start_container(names[0])
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 4
    (error,) = thread.errors  # type: ignore[attr-defined]
    status, message = describe_error(error) or (0, "")
    assert status == EXIT_INFRA and message.startswith(line)
    assert "2 Job(s) not started deleted" in message
    assert sim.objects("jobs", NS) == []


def test_a_secret_with_its_key_starts_the_pod(sim: KubeSim) -> None:
    """The simulated kubelet has teeth both ways: with the Secret and its key the container
    runs."""
    create_secret(sim, {"token": "aGY="})
    job = build_job(model_ref="org/m", model_key=model_key("org/m", None), relation="",
                    source_model=None, output_url="s3://b/o", settings=JobSettings(
                        image="img:1", namespace=NS, run_id="r1", hf_token_secret=TOKEN))
    JobSimulator(sim, namespace=NS)._batch.create_namespaced_job(NS, job)
    started = JobSimulator(sim, namespace=NS).start_container(job["metadata"]["name"])
    assert started["status"]["ready"] == 1
