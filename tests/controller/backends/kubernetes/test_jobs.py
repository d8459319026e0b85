"""Worker Jobs (controller.backends.kubernetes.common.jobs and .names): valid for Kubernetes 1.31
(strict schemas), safe, stable names.

Kubernetes 1.31 is the oldest version supported: podFailurePolicy (which keeps preemptions
and evictions from using up backoffLimit and stops permanent failures at once) is GA there,
and kubernetes-validate 1.37.0 ships strict schemas for it (1.25 … 1.37). Every build in the
table is also validated for the newest schemas it ships, so a field the newer API dropped
would show.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from controller.backends.kubernetes.common.errors import JobSpecError
from controller.backends.kubernetes.common.jobs import (
    JobSettings,
    build_job,
    min_kubernetes,
    pod_failure_policy,
)
from controller.backends.kubernetes.common.names import (
    is_dns_label,
    is_label_value,
    job_name,
    model_key_label,
    run_selector,
)
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from esd_worker.core.command.invocation import MODEL, WorkerInvocation
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.naming import model_key, split_model_ref

OLDEST = f"{min_kubernetes()}.0"
NEWEST = all_versions()[-1]
SECRET_VALUES = ("hf_SuperSecretToken1234567890", "AKIAABCDEFGHIJKLMNOP",
                 "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")


def make_settings(**overrides: Any) -> JobSettings:
    base = JobSettings(
        image="ghcr.io/example/esd-sweep:0.1.0", namespace="esd",
        run_id="20261123T070501Z-3fa9c2", hf_token_secret="hf-token:token",
        s3_secret="esd-s3", env={"AWS_ENDPOINT_URL": "http://minio.esd:9000"},
    )
    return replace(base, **overrides)


def make_job(
    ref: str = "openai-community/gpt2", *, relation: str = "", source: str | None = None,
    attempt: int = 0, affinity: Mapping[str, Any] | None = None, **settings: Any,
) -> dict[str, Any]:
    model_id, revision = split_model_ref(ref)
    return build_job(
        model_ref=ref, model_key=model_key(model_id, revision), relation=relation,
        source_model=source, output_url="s3://esd-results/atlas",
        settings=make_settings(**settings), attempt=attempt, affinity=affinity,
    )


GPU_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-a", "gpu-b"]}]}]}}}
LONG_ID = "some-organisation-with-a-long-name/" + "a-very-long-model-name-" * 4 + "v2"
ODD_ID = "./models/my model; rm -rf ~ $(id) `x` 'q\" \u00e9\u202e|&>x"

BUILDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "adapter-with-source": {"ref": "some-org/some-lora@3f1c2ab", "relation": "lora",
                            "source": "meta-llama/Llama-2-7b-hf"},
    "kueue": {"kueue_queue": "gpu-queue"},
    "pvc-cache": {"hf_cache_pvc": "hf-cache"},
    "placement": {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                  "priority_class": "batch-low", "service_account": "esd-worker",
                  "image_pull_secrets": ("regcred",), "affinity": GPU_AFFINITY},
    "attempt-suffix": {"attempt": 3},
    "long-model-id": {"ref": LONG_ID + "@refs/pr/12345678901234567890"},
    "odd-characters": {"ref": ODD_ID},
    "multi-gpu-limits": {"gpus_per_job": 4, "memory_limit": "64Gi",
                         "ephemeral_storage_request": "200Gi", "do_not_disrupt": True},
    "cpu-only": {"gpus_per_job": 0, "worker": WorkerInvocation(
        MODEL, log_format="json", analysis=AnalysisSettings(precision="float64"))},
    "no-secrets-no-ttl": {"hf_token_secret": None, "s3_secret": None, "env": {},
                          "ttl_after_finished_s": None},
}


def _all_strings(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in [str(k), *_all_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _all_strings(v)]
    return [str(value)]


@pytest.fixture(params=list(BUILDS), ids=list(BUILDS))
def built(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    # Credentials in the controller's own environment must never leak into the object.
    monkeypatch.setenv("HF_TOKEN", SECRET_VALUES[0])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_VALUES[1])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_VALUES[2])
    return make_job(**BUILDS[request.param])


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_job_passes_strict_schema(built: dict[str, Any], version: str) -> None:
    """kubernetes-validate strict mode rejects unknown fields and wrong types at any depth."""
    assert kubernetes_validate.validate(built, version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above has teeth: a typo deep in the pod spec fails strict validation."""
    job = make_job()
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, OLDEST, strict=True)


def test_security_context(built: dict[str, Any]) -> None:
    """Pod Security "restricted": non-root, no escalation, no capabilities, RuntimeDefault
    seccomp, read-only root with writable emptyDir/PVC only at /tmp and /cache."""
    pod = built["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 1000
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/tmp": "tmp", "/cache": "cache"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/cache/hf"
    # The Downward API gives the worker its node's name, which its log and errors name.
    assert env["NODE_NAME"] == {"name": "NODE_NAME",
                                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert "hostPath" not in json.dumps(pod) and "privileged" not in json.dumps(pod)


def test_no_secret_values_anywhere(built: dict[str, Any]) -> None:
    """Credentials only by reference: HF_TOKEN / AWS_* come from secretKeyRef, never a value,
    and none of the controller's own secret env values appears in the object or its YAML."""
    text = json.dumps(built) + jobs_to_yaml([built])
    for secret in SECRET_VALUES:
        assert secret not in text
    assert not re.search(r"\bhf_[A-Za-z0-9]{8,}", text)
    assert not re.search(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b", text)
    for container in built["spec"]["template"]["spec"]["containers"]:
        for entry in container["env"]:
            if entry["name"] in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                 "AWS_SESSION_TOKEN"):
                assert "value" not in entry
                assert set(entry["valueFrom"]) == {"secretKeyRef"}
                # The token is required (a misnamed Secret must stop the pod, not hide as
                # "no token"); the S3 keys optional (IRSA / pod identity stand in).
                optional = entry["valueFrom"]["secretKeyRef"]["optional"]
                assert optional is (entry["name"] != "HF_TOKEN")
        assert not any(a.startswith(("hf_", "AKIA")) for a in container["args"])


def test_names_and_labels_are_valid(built: dict[str, Any]) -> None:
    """Job name: DNS-1123 label ≤ 63 (it becomes the pods' job-name label). Every label
    value: ≤ 63, alphanumeric ends (the API server rejects anything else)."""
    name = built["metadata"]["name"]
    assert len(name) <= 63 and is_dns_label(name) and name.startswith("esd-")
    for labels in (built["metadata"]["labels"], built["spec"]["template"]["metadata"]["labels"]):
        for key, value in labels.items():
            assert is_label_value(value), (key, value)
        assert labels["app.kubernetes.io/managed-by"] == "esd-sweep"
        assert labels["esd-sweep/run"] == "20261123T070501Z-3fa9c2"


def test_model_id_is_one_argv_element_and_an_annotation(built: dict[str, Any]) -> None:
    """Untrusted ids: the container gets args as a list (no command, no shell); the ref is
    exactly the element after --model and the annotation holds it verbatim."""
    (container,) = built["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "command" not in container
    assert args[0] == "esd-worker" and "sh" not in args and "-c" not in args
    ref = built["metadata"]["annotations"]["esd-sweep/model-ref"]
    assert args[args.index("--model") + 1] == ref
    assert args.count(ref) == 1
    key = built["metadata"]["annotations"]["esd-sweep/model-key"]
    assert args[args.index("--model-key") + 1] == key
    assert built["metadata"]["labels"]["esd-sweep/model-key"] == model_key_label(key)


def test_odd_model_id_survives_yaml_verbatim() -> None:
    """The --dry-run YAML round-trips to the same objects; the odd id stays one string."""
    jobs = [make_job(ODD_ID), make_job("openai-community/gpt2@main", attempt=1)]
    text = jobs_to_yaml(jobs)
    assert text.count("---") == 2
    assert list(yaml.safe_load_all(text)) == jobs
    assert jobs[0]["metadata"]["annotations"]["esd-sweep/model-id"] == ODD_ID
    assert text.isascii()  # escapes: no bidi override characters on a reviewer's terminal


@pytest.mark.parametrize(("ref", "expected"), [
    # Golden names: a controller restarted by a later version must find the same Jobs.
    ("openai-community/gpt2", "esd-openai-community--gpt2-198df6d678"),
    ("meta-llama/Llama-2-7b-hf@main", "esd-meta-llama--llama-2-7b-hf--main-5237ac215d"),
], ids=["gpt2", "llama-at-main"])
def test_job_name_golden(ref: str, expected: str) -> None:
    model_id, revision = split_model_ref(ref)
    assert job_name(model_key(model_id, revision)) == expected


def test_job_names_deterministic_distinct_and_short() -> None:
    """Same key → same name (restart safety); the hash survives truncation, so ids sharing
    a long prefix still get distinct names; attempts share the prefix and fit 63 chars."""
    keys = [model_key(LONG_ID + suffix) for suffix in ("", "-b", "-c")]
    names = [job_name(k) for k in keys]
    assert names == [job_name(k) for k in keys]
    assert len(set(names)) == 3
    for key in keys:
        for attempt in (0, 1, 42, 9999):
            name = job_name(key, attempt)
            assert len(name) <= 63 and is_dns_label(name)
            assert name.startswith(job_name(key))
            assert name.endswith(f"-a{attempt}") == (attempt > 0)
        assert key[-10:] in job_name(key)
        label = model_key_label(key)
        assert len(label) <= 63 and is_label_value(label) and label.endswith(key[-10:])
    assert len({model_key_label(k) for k in keys}) == 3


@pytest.mark.parametrize("bad", ["", "Gpt2-0123456789", "gpt2", "gpt2-012345678Z", "-x-0123456789"])
def test_job_name_rejects_what_is_not_a_model_key(bad: str) -> None:
    with pytest.raises(JobSpecError):
        job_name(bad)


@pytest.mark.parametrize("attempt", [-1, 10000, True])
def test_job_name_rejects_bad_attempts(attempt: Any) -> None:
    with pytest.raises(JobSpecError):
        job_name(model_key("a/b"), attempt)


def test_pod_failure_policy() -> None:
    """Disruptions are ignored first (retried without counting); exit 2/3 fail the Job at
    once; the retryable codes, 4 (transient), 5 (GPU OOM) and 6 (the node's GPU broken),
    count against backoffLimit: the next pod may land elsewhere, and a Job failed by 6 is
    retryable (another Job attempt), never a permanent failure of the model."""
    job = make_job()
    assert job["spec"]["podFailurePolicy"] == pod_failure_policy()
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["Ignore", "FailJob", "Count"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[1]["onExitCodes"] == {"containerName": "worker", "operator": "In",
                                       "values": [2, 3]}
    assert rules[2]["onExitCodes"]["values"] == [4, 5, 6]
    # Apiserver rules the schema does not check: sorted, no duplicates, no 0 with In,
    # the named container exists, restartPolicy Never.
    names = {c["name"] for c in job["spec"]["template"]["spec"]["containers"]}
    for rule in rules:
        if "onExitCodes" in rule:
            values = rule["onExitCodes"]["values"]
            assert values == sorted(set(values)) and 0 not in values
            assert rule["onExitCodes"]["containerName"] in names
    assert job["spec"]["backoffLimit"] == 3
    # The deadline is the pod's: time spent pending for a node or Kueue does not count.
    assert "activeDeadlineSeconds" not in job["spec"]
    assert job["spec"]["template"]["spec"]["activeDeadlineSeconds"] == 6 * 3600
    assert job["spec"]["ttlSecondsAfterFinished"] == 24 * 3600


def test_resources_and_gpu_toleration() -> None:
    """GPU requests equal limits (extended resources cannot be overcommitted) and the pod
    tolerates the nvidia.com/gpu taint; a CPU-only Job asks for neither."""
    gpu = make_job(gpus_per_job=2, cpu_request="4", memory_request="32Gi")
    spec = gpu["spec"]["template"]["spec"]
    res = spec["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "2"}
    assert res["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "2"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    args = spec["containers"][0]["args"]
    assert args[args.index("--device") + 1] == "cuda"
    cpu = make_job(gpus_per_job=0)["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert "tolerations" not in cpu
    args = cpu["containers"][0]["args"]
    assert args[args.index("--device") + 1] == "cpu"


@pytest.mark.parametrize(("settings", "limit"), [
    ({}, "16Gi"),
    ({"memory_request": "7Gi", "gpus_per_job": 0}, "7Gi"),
    ({"memory_request": "7Gi", "memory_limit": "12Gi"}, "12Gi"),
], ids=["default", "cpu-class", "explicit-limit"])
def test_every_pod_has_a_memory_limit(settings: dict[str, Any], limit: str) -> None:
    """Every worker pod's container has limits.memory (the request unless a limit was
    given), so a model that leaks host memory has its own container OOM-killed, charged to
    that model, rather than pressing the node into evicting its neighbours; the Job stays
    strict-valid."""
    job = make_job(**settings)
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["memory"] == limit
    assert kubernetes_validate.validate(job, OLDEST, strict=True)


def test_kueue_and_karpenter() -> None:
    """Kueue: the queue label and suspend: true (Kueue unsuspends on admission); without a
    queue the Job is not suspended. do_not_disrupt annotates the pods, not the Job."""
    queued = make_job(kueue_queue="gpu-queue", do_not_disrupt=True)
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert queued["spec"]["suspend"] is True
    annotations = queued["spec"]["template"]["metadata"]["annotations"]
    assert annotations["karpenter.sh/do-not-disrupt"] == "true"
    assert "annotations" in queued["metadata"] and \
        "karpenter.sh/do-not-disrupt" not in queued["metadata"]["annotations"]
    plain = make_job()
    assert "suspend" not in plain["spec"]
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    assert "annotations" not in plain["spec"]["template"]["metadata"]


def test_placement_and_cache_options() -> None:
    """nodeSelector, priority class, service account and affinity go to the pod spec (the
    affinity copied, not shared); a PVC replaces the cache emptyDir."""
    job = make_job(node_selector={"pool": "gpu"}, priority_class="batch-low",
                   service_account="esd-worker", hf_cache_pvc="hf-cache",
                   affinity=GPU_AFFINITY)
    spec = job["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["priorityClassName"] == "batch-low"
    assert spec["serviceAccountName"] == "esd-worker"
    assert spec["affinity"] == GPU_AFFINITY and spec["affinity"] is not GPU_AFFINITY
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in spec["volumes"]


def test_adapter_args_and_annotations() -> None:
    job = make_job("some-org/some-lora@3f1c2ab", relation="lora",
                   source="meta-llama/Llama-2-7b-hf", attempt=2)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--relation") + 1] == "lora"
    assert args[args.index("--base-model") + 1] == "meta-llama/Llama-2-7b-hf"
    notes = job["metadata"]["annotations"]
    assert notes["esd-sweep/model-id"] == "some-org/some-lora"
    assert notes["esd-sweep/revision"] == "3f1c2ab"
    assert notes["esd-sweep/attempt"] == "2"
    assert notes["esd-sweep/source-model"] == "meta-llama/Llama-2-7b-hf"
    assert job["metadata"]["name"].endswith("-a2")


def test_output_annotation_drops_credentials() -> None:
    job = build_job(model_ref="a/b", model_key=model_key("a/b"), relation="", source_model=None,
                    output_url="https://user:pw@store.example/x?X-Amz-Signature=abc",
                    settings=make_settings())
    assert job["metadata"]["annotations"]["esd-sweep/output"] == "https://store.example/x"


@pytest.mark.parametrize(("ref", "problem"), [
    ("--output=s3://elsewhere", "starts with '-'"),
    ("org/model\n--output", "control characters"),
    ("", "empty"),
], ids=["leading-dash", "newline", "empty"])
def test_refs_that_could_inject_are_refused(ref: str, problem: str) -> None:
    with pytest.raises(JobSpecError, match=re.escape(problem)):
        build_job(model_ref=ref, model_key=model_key("x/y"), relation="", source_model=None,
                  output_url="s3://b/p", settings=make_settings())


def test_settings_problems_name_every_field() -> None:
    """Every problem at once, each by field name (the CLI shows them together)."""
    settings = make_settings(
        image="", namespace="ESD", run_id="bad run", gpus_per_job=-1, cpu_request="two",
        memory_limit="16 GB", backoff_limit=-1, node_selector={"pool": "a b"},
        priority_class="Low", hf_token_secret="no-colon", s3_secret="S3!",
        gpu_resource="gpu",
        env={"HF_TOKEN": "x", "MY_API_KEY": "y", "OK": "multi\nline", "NODE_NAME": "n"},
        kueue_queue="",
        worker=WorkerInvocation(MODEL, log_format="xml"),
    )
    text = "\n".join(settings.problems())
    for name in ("image", "namespace", "run_id", "gpus_per_job", "cpu_request",
                 "memory_limit", "backoff_limit", "node_selector", "priority_class",
                 "hf_token_secret", "s3_secret", "gpu_resource", "env: HF_TOKEN", "env: MY_API_KEY",
                 "env: the value of OK", "env: NODE_NAME", "kueue_queue", "log_format"):
        assert name in text, name
    with pytest.raises(JobSpecError, match="namespace"):
        make_job(namespace="ESD")
    assert make_settings().problems() == []


def test_run_selector_matches_labels() -> None:
    job = make_job()
    labels = job["metadata"]["labels"]
    for term in run_selector("20261123T070501Z-3fa9c2").split(","):
        key, value = term.split("=")
        assert labels[key] == value
