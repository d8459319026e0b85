"""The Indexed Job of a sharded run (controller.backends.kubernetes.sharded.indexed): valid for
Kubernetes 1.31 and 1.37 (strict schemas), named to leave room for its pods' hostnames,
failing an index only when its shard cannot run, and never carrying a credential.

kubernetes-validate checks the schema; the API server's own rules that the schema does not
hold (Indexed mode for backoffLimitPerIndex, FailIndex only with it, sorted exit codes,
completions ≤ 100000, pod hostnames of 63 chars) are checked here one by one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from controller.backends.kubernetes.common.errors import JobSpecError
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.names import (
    is_dns_label,
    is_label_value,
    per_model_selector,
    run_selector,
    sharded_selector,
    sweep_selector,
)
from controller.backends.kubernetes.common.wiring import server_too_old
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from controller.backends.kubernetes.sharded.indexed import (
    MAX_CLASS,
    MAX_COMPLETIONS,
    build_indexed_job,
    indexed_job_name,
    shard_failure_policy,
)
from esd_worker.core.command.invocation import MODEL, BatchOptions, WorkerInvocation
from esd_worker.core.errors import (
    EXIT_DEVICE,
    EXIT_GPU_OOM,
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    EXIT_USAGE,
)
from esd_worker.core.models.naming import model_key
from tests.support.kubesim import K8S_VERSIONS

RUN = "20261123T070501Z-3fa9c2"
OUTPUT = "s3://esd-results/atlas"
SHARDS = f"{OUTPUT}/_shards/{RUN}/gpu1"
# The default analysis flags as a shard pod's argv has held them.
ANALYSIS = ("--fix-fingers", "xmin_mid", "--evals-thresh", "1e-05", "--bins", "100",
            "--min-evals", "10", "--conv-norm", "0.5", "--precision", "float32")
BATCH = BatchOptions(run_id=RUN)
BATCH_ARGV = ("--run-id", RUN, "--max-retries", "2", "--prefetch", "1")
# Kubernetes names an Indexed Job's pods <job>-<index>-<5 random> with hostname
# <job>-<index>; indexes run up to completions - 1.
LAST_INDEX = str(MAX_COMPLETIONS - 1)


def make_settings(**overrides: Any) -> JobSettings:
    base = JobSettings(
        image="ghcr.io/example/esd-sweep:0.1.0", namespace="esd", run_id=RUN,
        sweep_name="out-0123456789ab", hf_token_secret="hf-token:token", s3_secret="esd-s3",
        env={"AWS_ENDPOINT_URL": "http://minio.esd:9000"},
        worker=WorkerInvocation(MODEL, log_format="json"),
    )
    return replace(base, **overrides)


def make_indexed(
    *, class_name: str = "gpu1", completions: int = 12, parallelism: int = 4,
    backoff_limit_per_index: int = 3, shards_url: str = SHARDS, output_url: str = OUTPUT,
    batch: BatchOptions = BATCH, active_deadline_s: int | None = None,
    models: int | None = None, shard_bytes: int | None = None,
    avoid_nodes: tuple[str, ...] = (), **settings: Any,
) -> dict[str, Any]:
    job_settings = make_settings(**settings)
    job_settings = replace(job_settings, worker=job_settings.worker.replace(batch=batch))
    return build_indexed_job(
        run_id=job_settings.run_id, class_name=class_name, completions=completions,
        parallelism=parallelism, backoff_limit_per_index=backoff_limit_per_index,
        shards_url=shards_url, output_url=output_url, settings=job_settings,
        active_deadline_s=active_deadline_s, models=models,
        shard_bytes=shard_bytes, avoid_nodes=avoid_nodes,
    )


def pod_of(job: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def args_of(job: Mapping[str, Any]) -> list[str]:
    (container,) = pod_of(job)["containers"]
    args: list[str] = container["args"]
    return args


BUILDS: dict[str, dict[str, Any]] = {
    "gpu": {},
    "cpu-class": {"class_name": "cpu", "gpus_per_job": 0},
    "multi-gpu": {"class_name": "gpu4", "gpus_per_job": 4, "memory_limit": "256Gi"},
    "kueue-do-not-disrupt": {"kueue_queue": "gpu-queue", "do_not_disrupt": True},
    "disk-limited": {"ephemeral_storage_request": "200Gi"},
    "pvc-cache": {"hf_cache_pvc": "hf-cache", "ephemeral_storage_request": "20Gi"},
    "deadline-and-counts": {"active_deadline_s": 7 * 24 * 3600, "models": 12345,
                            "shard_bytes": 500 * 10**9},
    "one-shard": {"completions": 1, "parallelism": 64},
    "most-shards": {"completions": MAX_COMPLETIONS, "parallelism": 256},
    "no-retries-no-ttl": {"backoff_limit_per_index": 0, "ttl_after_finished_s": None},
    "long-odd-run-id": {"run_id": "Nightly_Sweep.of.all.the.Models-" + "x" * 30,
                        "class_name": "a" * MAX_CLASS},
    "placement": {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                  "priority_class": "batch-low", "service_account": "esd-sweep-worker",
                  "image_pull_secrets": ("regcred",)},
    "replacement-off-bad-nodes": {"class_name": "gpu-small-r2", "avoid_nodes": ("n7", "n3")},
}


@pytest.fixture(params=list(BUILDS), ids=list(BUILDS))
def built(request: pytest.FixtureRequest) -> dict[str, Any]:
    return make_indexed(**BUILDS[request.param])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_passes_strict_schema(built: dict[str, Any], version: str) -> None:
    """Strict mode rejects unknown fields and wrong types at any depth."""
    assert kubernetes_validate.validate(built, version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_catches_a_misspelt_index_field() -> None:
    """The check above has teeth for the fields this builder adds."""
    job = make_indexed()
    job["spec"]["backoffLimitPerIndx"] = job["spec"].pop("backoffLimitPerIndex")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def test_api_server_rules_the_schema_does_not_hold(built: dict[str, Any]) -> None:
    """backoffLimitPerIndex needs completionMode Indexed and ≤ 100000 completions; FailIndex
    needs backoffLimitPerIndex; the policy needs restartPolicy Never, exit codes sorted,
    unique, without 0, in a container that exists; parallelism never exceeds completions;
    no backoffLimit (the per-index limit is the one that counts)."""
    spec = built["spec"]
    assert spec["completionMode"] == "Indexed"
    assert 1 <= spec["completions"] <= MAX_COMPLETIONS
    assert 1 <= spec["parallelism"] <= spec["completions"]
    assert spec["backoffLimitPerIndex"] >= 0 and "backoffLimit" not in spec
    assert pod_of(built)["restartPolicy"] == "Never"
    names = {c["name"] for c in pod_of(built)["containers"]}
    for rule in spec["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            values = rule["onExitCodes"]["values"]
            assert values == sorted(set(values)) and 0 not in values
            assert rule["onExitCodes"]["containerName"] in names


def test_names_labels_and_hostnames_fit(built: dict[str, Any]) -> None:
    """The Job name and its last pod's hostname are DNS labels; label values are valid;
    the pods carry the Job's labels except Kueue's queue (Kueue admits the Job)."""
    name = built["metadata"]["name"]
    assert len(name) <= 50 and is_dns_label(name)
    assert is_dns_label(f"{name}-{LAST_INDEX}")
    job_labels = built["metadata"]["labels"]
    pod_labels = built["spec"]["template"]["metadata"]["labels"]
    for key, value in job_labels.items():
        assert is_label_value(value), (key, value)
    assert {k: v for k, v in job_labels.items() if k != "kueue.x-k8s.io/queue-name"} \
        == pod_labels
    assert job_labels["esd-sweep/mode"] == "sharded"
    assert name.endswith("-" + job_labels["esd-sweep/shard-class"])
    assert "esd-sweep/model-key" not in job_labels and "esd-sweep/attempt" not in job_labels


def _matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics for the terms esd-sweep uses: k=v and !k."""
    for term in selector.split(","):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        else:
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
    return True


def test_selectors_tell_sharded_from_per_model_jobs() -> None:
    """The sweep and run selectors find both kinds; sharded_selector only the Indexed Job,
    per_model_selector only the per-model Job (whose adoption reads a model key)."""
    indexed = make_indexed()["metadata"]["labels"]
    settings = make_settings()
    per_model = build_job(model_ref="a/b", model_key=model_key("a/b"), relation="",
                          source_model=None, output_url=OUTPUT,
                          settings=settings)["metadata"]["labels"]
    instance = settings.instance
    table = [
        (sweep_selector(instance), True, True),
        (run_selector(RUN), True, True),
        (sharded_selector(instance), True, False),
        (per_model_selector(instance), False, True),
        (sharded_selector("out-another"), False, False),
    ]
    for selector, finds_indexed, finds_per_model in table:
        assert _matches(selector, indexed) is finds_indexed, selector
        assert _matches(selector, per_model) is finds_per_model, selector


RUN_IDS = {
    # run id: its readable part when it fits (None: cut or hashed, whatever the class)
    "generated": (RUN, RUN.lower()),
    "short": ("r", "r"),
    "odd-chars": ("Nightly_Sweep.2026", None),
    "longest": ("a" * 63, None),
    "long": (RUN + "-with-a-much-longer-label-suffix-x", None),
}


@pytest.mark.parametrize("run_id", list(RUN_IDS), ids=list(RUN_IDS))
@pytest.mark.parametrize("class_name", ["cpu", "gpu1", "gpu8", "a" * MAX_CLASS],
                         ids=["cpu", "gpu1", "gpu8", "longest-class"])
def test_indexed_job_name(run_id: str, class_name: str) -> None:
    """Every name is a ≤ 50-char DNS label ending in the whole class. The run id shows as
    itself (lowercased) when it fits and needed no replaced characters; otherwise what is
    left of it ends in a hex hash, after as much of its readable start as fits."""
    run, readable = RUN_IDS[run_id]
    name = indexed_job_name(run, class_name)
    assert len(name) <= 50 and is_dns_label(name)
    assert name.startswith("esd-") and name.endswith(f"-{class_name}")
    assert name == indexed_job_name(run, class_name)  # a restart finds the same Job
    run_part = name[len("esd-"):-len(class_name) - 1]
    fits = readable is not None and len(f"esd-{readable}-{class_name}") <= 50
    if fits:
        assert run_part == readable
    else:
        start, _, digest = run_part.rpartition("-")
        assert re.fullmatch(r"[0-9a-f]{8}", digest), run_part
        sanitized = re.sub(r"[^a-z0-9-]", "-", run.lower())
        assert sanitized.startswith(start)


def test_generated_run_id_keeps_its_readable_name() -> None:
    """Golden: a controller restarted by a later version must find the same Job."""
    assert indexed_job_name(RUN, "gpu1") == "esd-20261123t070501z-3fa9c2-gpu1"


@pytest.mark.parametrize(("first", "second"), [
    ("x" * 62 + "a", "x" * 62 + "b"),
    (RUN + "-" + "y" * 30 + "1", RUN + "-" + "y" * 30 + "2"),
    ("nightly_1", "nightly.1"),
    ("nightly_1", "nightly-1"),
], ids=["long-differ-at-end", "long-generated-prefix", "replaced-chars", "replaced-vs-exact"])
def test_run_ids_that_read_alike_get_different_names(first: str, second: str) -> None:
    for class_name in ("cpu", "a" * MAX_CLASS):
        assert indexed_job_name(first, class_name) != indexed_job_name(second, class_name)


@pytest.mark.parametrize("class_name", ["", "GPU", "-gpu", "gpu-", "gpu_1", "a" * (MAX_CLASS + 1)])
def test_indexed_job_name_refuses_bad_classes(class_name: str) -> None:
    with pytest.raises(JobSpecError, match="class_name"):
        indexed_job_name(RUN, class_name)


@pytest.mark.parametrize(("settings", "batch", "expected"), [
    ({}, BATCH, ["--log-format", "json", "--device", "cuda", *BATCH_ARGV]),
    ({"gpus_per_job": 0}, BATCH, ["--log-format", "json", "--device", "cpu", *BATCH_ARGV]),
    ({"worker": WorkerInvocation(MODEL, log_format="json", device="cpu")}, BatchOptions(),
     ["--log-format", "json", "--device", "cpu", "--max-retries", "2", "--prefetch", "1"]),
    ({"worker": WorkerInvocation(MODEL, log_format="text", device="cuda", hub_rate=0.75)},
     BatchOptions(run_id=RUN, cache_dir="/cache/models", cache_budget=10**9),
     ["--log-format", "text", "--device", "cuda", *BATCH_ARGV, "--hub-rate", "0.75",
      "--cache-dir", "/cache/models", "--cache-budget", "1000000000"]),
], ids=["gpu", "cpu", "device-given", "device-given-text-logs-cache"])
def test_shard_pod_argv(settings: dict[str, Any], batch: BatchOptions,
                        expected: list[str]) -> None:
    """esd-worker, the shard lists and the store, the log format, the device the run gave
    (else the pod's: cuda with GPUs), the batch flags, the hub rate and download folder,
    then the analysis flags (argv, no shell): byte for byte what a cluster has held."""
    job = make_indexed(batch=batch, **settings)
    assert args_of(job) == ["esd-worker", "--shards", SHARDS, "--output", OUTPUT,
                            *expected, *ANALYSIS]
    assert "command" not in pod_of(job)["containers"][0]


def _action(policy: Mapping[str, Any], exit_code: int, disrupted: bool) -> str:
    """What the Job controller does with a failed pod: the first matching rule's action,
    Count when none matches (Kubernetes' podFailurePolicy semantics)."""
    for rule in policy["rules"]:
        if "onPodConditions" in rule:
            if disrupted and {"type": "DisruptionTarget", "status": "True"} \
                    in rule["onPodConditions"]:
                return str(rule["action"])
        else:
            codes = rule["onExitCodes"]
            hit = exit_code in codes["values"]
            if hit == (codes["operator"] == "In"):
                return str(rule["action"])
    return "Count"


@pytest.mark.parametrize(("exit_code", "disrupted", "action"), [
    (EXIT_USAGE, False, "FailIndex"),
    (EXIT_PERMANENT, False, "FailIndex"),
    (EXIT_DEVICE, False, "FailIndex"),
    (EXIT_TRANSIENT, False, "Count"),
    (EXIT_GPU_OOM, False, "Count"),
    (137, False, "Count"),
    (139, False, "Count"),
    (1, False, "Count"),
    (137, True, "Ignore"),
    (EXIT_PERMANENT, True, "Ignore"),
    (EXIT_DEVICE, True, "Ignore"),
], ids=["usage", "permanent", "broken-gpu", "transient", "gpu-oom", "oomkilled", "segfault",
        "crash", "evicted", "permanent-while-evicted", "broken-gpu-while-evicted"])
def test_shard_failure_policy(exit_code: int, disrupted: bool, action: str) -> None:
    """A disruption never uses a retry (checked first, whatever the exit code); a shard that
    cannot run fails its index at once, and so does a broken GPU (exit 6: the controller
    reruns it in a Job off that node); the rest counts against backoffLimitPerIndex."""
    policy = make_indexed()["spec"]["podFailurePolicy"]
    assert policy == shard_failure_policy()
    assert [r["action"] for r in policy["rules"]] == ["Ignore", "FailIndex"]
    assert _action(policy, exit_code, disrupted) == action


@pytest.mark.parametrize(("gpus", "tolerates"), [(0, False), (1, True), (4, True)])
def test_gpu_and_cpu_classes(gpus: int, tolerates: bool) -> None:
    """A GPU class requests (= limits) its GPUs and tolerates the GPU taint; a CPU class
    asks for neither."""
    job = make_indexed(class_name="cpu" if gpus == 0 else f"gpu{gpus}", gpus_per_job=gpus)
    pod = pod_of(job)
    resources = pod["containers"][0]["resources"]
    if gpus:
        assert resources["requests"]["nvidia.com/gpu"] == str(gpus)
        assert resources["limits"]["nvidia.com/gpu"] == str(gpus)
    else:
        assert "nvidia.com/gpu" not in json.dumps(pod)
    assert ("tolerations" in pod) is tolerates


def test_same_pod_as_per_model_jobs() -> None:
    """The pod is the per-model Jobs' (security context, secrets by reference, volumes),
    with the sharded worker's argv and the cache's size limit."""
    settings = make_settings(ephemeral_storage_request="200Gi", do_not_disrupt=True)
    per_model = build_job(model_ref="a/b", model_key=model_key("a/b"), relation="",
                          source_model=None, output_url=OUTPUT, settings=settings)
    indexed = make_indexed(ephemeral_storage_request="200Gi", do_not_disrupt=True)
    expected = json.loads(json.dumps(pod_of(per_model)))
    expected["containers"][0]["args"] = args_of(indexed)
    for volume in expected["volumes"]:
        if volume["name"] == "cache":
            volume["emptyDir"]["sizeLimit"] = "200Gi"
    assert pod_of(indexed) == expected
    assert indexed["spec"]["template"]["metadata"]["annotations"] == \
        per_model["spec"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize(("settings", "cache"), [
    ({}, {"name": "cache", "emptyDir": {}}),
    ({"ephemeral_storage_request": "200Gi"},
     {"name": "cache", "emptyDir": {"sizeLimit": "200Gi"}}),
    ({"ephemeral_storage_request": "200Gi", "hf_cache_pvc": "hf-cache"},
     {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}),
], ids=["no-disk-request", "disk-request", "pvc"])
def test_cache_size_limit(settings: dict[str, Any], cache: dict[str, Any]) -> None:
    """The download cache's emptyDir is capped at the disk request (the kubelet evicts a pod
    that outgrows it); /tmp has its own small cap, and a PVC is not an emptyDir."""
    volumes = {v["name"]: v for v in pod_of(make_indexed(**settings))["volumes"]}
    assert volumes["cache"] == cache
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}


def test_kueue() -> None:
    """Kueue: the queue label on the Job and suspend: true (Kueue admits by unsuspending);
    without a queue neither."""
    queued = make_indexed(kueue_queue="gpu-queue")
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert queued["spec"]["suspend"] is True
    # Partial admission: Kueue may start the Workload with fewer pods than parallelism.
    assert queued["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"] == "1"
    plain = make_indexed()
    assert "suspend" not in plain["spec"]
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    assert "kueue.x-k8s.io/job-min-parallelism" not in plain["metadata"]["annotations"]


@pytest.mark.parametrize(("parallelism", "completions", "expected"), [
    (4, 12, 4), (64, 12, 12), (12, 12, 12), (1, 1, 1), (256, MAX_COMPLETIONS, 256),
])
def test_parallelism_capped_by_completions(parallelism: int, completions: int,
                                           expected: int) -> None:
    spec = make_indexed(parallelism=parallelism, completions=completions)["spec"]
    assert (spec["parallelism"], spec["completions"]) == (expected, completions)


def test_deadline_ttl_and_annotations() -> None:
    """The per-model Jobs' deadline is not the sharded Job's: none unless given. The TTL is
    the settings'. Counts are string annotations, absent when not given."""
    plain = make_indexed(active_deadline_s=None)
    assert "activeDeadlineSeconds" not in plain["spec"]
    assert plain["spec"]["ttlSecondsAfterFinished"] == make_settings().ttl_after_finished_s
    assert "esd-sweep/models" not in plain["metadata"]["annotations"]
    assert "esd-sweep/shard-bytes" not in plain["metadata"]["annotations"]
    given = make_indexed(active_deadline_s=3 * 86400, models=40, shard_bytes=123456789)
    assert given["spec"]["activeDeadlineSeconds"] == 3 * 86400
    notes = given["metadata"]["annotations"]
    assert (notes["esd-sweep/models"], notes["esd-sweep/shard-bytes"]) == ("40", "123456789")
    assert (notes["esd-sweep/output"], notes["esd-sweep/shards"]) == (OUTPUT, SHARDS)


KEY, SECRET = "AKIAABCDEFGHIJKLMNOP", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(("output", "shards"), [
    (f"s3://{KEY}:{SECRET}@esd-results/atlas", SHARDS),
    (OUTPUT, f"s3://{KEY}:{SECRET}@esd-results/atlas/_shards/{RUN}/gpu1"),
    (f"s3://{KEY}:{SECRET}@esd-results/atlas",
     f"s3://{KEY}:{SECRET}@esd-results/atlas/_shards/{RUN}/gpu1"),
], ids=["output", "shards", "both"])
def test_credentials_in_urls_appear_nowhere(output: str, shards: str) -> None:
    """user:password@ in a store URL goes neither into argv nor annotations (anyone who can
    get Jobs reads both): the worker gets the plain URL and its credentials from the
    Secret; the rest of the URL is unchanged."""
    job = make_indexed(output_url=output, shards_url=shards)
    text = json.dumps(job) + jobs_to_yaml([job])
    assert KEY not in text and SECRET not in text
    args = args_of(job)
    assert args[args.index("--output") + 1] == OUTPUT
    assert args[args.index("--shards") + 1] == SHARDS


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"completions": 0}, "completions"),
    ({"completions": MAX_COMPLETIONS + 1}, "completions"),
    ({"completions": True}, "completions"),
    ({"parallelism": 0}, "parallelism"),
    ({"backoff_limit_per_index": -1}, "backoff_limit_per_index"),
    ({"active_deadline_s": 0}, "active_deadline_s"),
    ({"models": -1}, "models"),
    ({"class_name": "GPU"}, "class_name"),
    ({"shards_url": "--output=s3://elsewhere"}, "shards_url"),
    ({"output_url": "s3://b/x\n--device"}, "output_url"),
    ({"output_url": ""}, "output_url"),
    ({"output_url": "s3://[bad/x"}, "output_url"),
    ({"batch": BatchOptions(cache_dir="/x\n--y")}, "batch.cache_dir"),
    ({"namespace": "ESD"}, "namespace"),
], ids=lambda v: json.dumps(v, default=str) if isinstance(v, dict) else str(v))
def test_bad_inputs_are_refused(overrides: dict[str, Any], problem: str) -> None:
    with pytest.raises(JobSpecError, match=problem):
        make_indexed(**overrides)


def test_refusals_do_not_echo_credentials() -> None:
    """A URL refused for a control character is quoted without its user:password@."""
    with pytest.raises(JobSpecError, match="output_url") as caught:
        make_indexed(output_url=f"s3://{KEY}:{SECRET}@esd-results/atlas\n--device")
    assert KEY not in str(caught.value) and SECRET not in str(caught.value)


def test_every_problem_at_once_and_run_ids_agree() -> None:
    """One error names every problem (the CLI shows them together); the name's run id is
    the settings' (labels and name must point at the same run)."""
    with pytest.raises(JobSpecError) as caught:
        make_indexed(completions=0, parallelism=0, class_name="X", output_url="",
                     namespace="ESD")
    for field in ("completions", "parallelism", "class_name", "output_url", "namespace"):
        assert field in str(caught.value)
    with pytest.raises(JobSpecError, match="run_id"):
        build_indexed_job(run_id="another-run", class_name="gpu1", completions=1,
                          parallelism=1, backoff_limit_per_index=0, shards_url=SHARDS,
                          output_url=OUTPUT, settings=make_settings())


@pytest.mark.parametrize(("version", "too_old"), [
    ("v1.28.3-eks-abc1234", True),
    ("v1.27.16+k3s1", True),
    ("v1.9.11", True),
    ("1.28", True),
    ("v1.29.0", True),
    ("v1.30.5-gke.1014001", True),
    ("v1.31.0+k3s1", False),
    ("v1.33.1", False),
    ("v2.0.0", False),
    ("v1.100.0", False),
    ("", False),
    ("unknown", False),
    ("vX.Y", False),
])
def test_server_too_old(version: str, too_old: bool) -> None:
    """Versions compare as numbers (1.9 < 1.31 < 1.100); what does not parse never blocks a
    run. The message names the version, the minimum (jobs.MIN_KUBERNETES) and the way out."""
    message = server_too_old(version)
    assert (message is not None) is too_old
    if message is not None:
        assert version in message and "needs Kubernetes 1.31 or newer" in message
        assert "upgrade" in message
        assert "\n" not in message
