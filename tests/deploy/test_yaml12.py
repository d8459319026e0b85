"""The YAML esd-sweep prints for Jobs (`--dry-run`, jobs.jobs_to_yaml) reads back as the same
objects under YAML 1.2, as the API server and kubectl read it, and under YAML 1.1 (PyYAML).

PyYAML writes by YAML 1.1's rules: `1e-05`, `1E5`, `0o17` and `08` are strings there and go
out unquoted, and a YAML 1.2 reader parses them as numbers ("cannot unmarshal number into
... of type string"). `--evals-thresh 1e-05` is in every Job's args by default. The reader
here is ruamel.yaml's pure-Python safe loader, a YAML 1.2 implementation independent of the
emitter under test.
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import pytest
import yaml
from ruamel.yaml import YAML

from controller.backends.base import WorkerSpec
from controller.backends.kubernetes.common.jobs import JobSettings, build_job
from controller.backends.kubernetes.common.yamlout import jobs_to_yaml
from controller.backends.kubernetes.sharded.indexed import build_indexed_job
from esd_worker.core.models.naming import model_key, split_model_ref
from tests.support.kustomize import KUSTOMIZATIONS, kustomize_text

RUN = "20261123T070501Z-3fa9c2"
OUTPUT = "s3://esd-results/atlas"
# Strings that a YAML 1.2 or 1.1 reader takes for a number, a bool, null, a date, a
# sexagesimal, a mapping, a comment, a sequence or a reserved indicator when written plain,
# plus an empty string, a leading space, non-ASCII and a control character.
TRICKY = (
    "1e-05", "1E5", "0x1F", "0o17", "1_000", ".inf", "-.Inf", ".nan", "null", "~", "yes",
    "no", "on", "off", "y", "n", "true", "False", "08", "012", "1:30", "2026-11-23", "",
    " lead", "a: b", "#x", "- x", "@x", "`x", "日本", "\x07bell",
)
GPU_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-a"]}]}]}}}


def read_yaml12(text: str) -> list[Any]:
    return list(YAML(typ="safe", pure=True).load_all(io.StringIO(text)))


def default_settings(**overrides: Any) -> JobSettings:
    """A sweep's Job settings with the worker flags a default `esd-sweep run` passes."""
    spec = WorkerSpec(run_id=RUN, store_url=OUTPUT)
    base = JobSettings(
        image="ghcr.io/example/esd-sweep:0.1.0", namespace="esd", run_id=RUN,
        hf_token_secret="hf-token:token", s3_secret="esd-s3",
        env={"AWS_ENDPOINT_URL": "http://minio.esd:9000", "AWS_REGION": "us-east-1"},
        worker=spec.invocation(),
    )
    return replace(base, **overrides)


def per_model_job(ref: str = "openai-community/gpt2", *, relation: str = "",
                  source: str | None = None, affinity: Any = None,
                  **settings: Any) -> dict[str, Any]:
    model_id, revision = split_model_ref(ref)
    return build_job(model_ref=ref, model_key=model_key(model_id, revision), relation=relation,
                     source_model=source, output_url=OUTPUT,
                     settings=default_settings(**settings), affinity=affinity)


def indexed_job(**settings: Any) -> dict[str, Any]:
    spec = WorkerSpec(run_id=RUN, store_url=OUTPUT)
    job_settings = default_settings(**settings)
    job_settings = replace(job_settings, worker=job_settings.worker.replace(batch=spec.batch()))
    return build_indexed_job(
        run_id=RUN, class_name="gpu1", completions=12, parallelism=4,
        backoff_limit_per_index=2, shards_url=f"{OUTPUT}/_shards/{RUN}/gpu1",
        output_url=OUTPUT, settings=job_settings, models=1000, shard_bytes=10**12,
    )


def with_tricky_values(job: dict[str, Any]) -> dict[str, Any]:
    """The job with every tricky string as an arg, an env value and an annotation (put in
    the dict directly: the builders rightly refuse control characters, the emitter must
    still carry them)."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["args"] += list(TRICKY)
    container["env"] += [{"name": f"TRICKY_{i}", "value": v} for i, v in enumerate(TRICKY)]
    job["metadata"]["annotations"].update(
        {f"esd-sweep/tricky-{i}": v for i, v in enumerate(TRICKY)})
    return job


JOBS = {
    "per-model": lambda: with_tricky_values(per_model_job()),
    "indexed": lambda: with_tricky_values(indexed_job()),
}


@pytest.mark.parametrize("kind", list(JOBS))
def test_tricky_strings_read_back_the_same_in_yaml_12_and_11(kind: str) -> None:
    job = JOBS[kind]()
    text = jobs_to_yaml([job])
    assert read_yaml12(text) == [job]
    assert list(yaml.safe_load_all(text)) == [job]
    assert text.isascii()  # escapes: no control or bidi characters on a reviewer's terminal


def test_pyyaml_default_output_is_misread_by_yaml_12() -> None:
    """Why the emitter needed changing (and that the reader above tells): PyYAML's own
    safe_dump writes these plain, and a YAML 1.2 reader turns them into numbers."""
    text = yaml.safe_dump(list(TRICKY), allow_unicode=False)
    misread = [v for v, back in zip(TRICKY, read_yaml12(text)[0], strict=True) if back != v]
    assert {"1e-05", "1E5", "0o17", "08"} <= set(misread)
    assert read_yaml12(jobs_to_yaml([{"values": list(TRICKY)}])) == [{"values": list(TRICKY)}]


DEFAULT_BUILDS: dict[str, Any] = {
    "gpu": lambda: per_model_job(),
    "cpu": lambda: per_model_job(gpus_per_job=0),
    "adapter": lambda: per_model_job("some-org/some-lora@3f1c2ab", relation="lora",
                                     source="meta-llama/Llama-2-7b-hf"),
    "kueue-karpenter": lambda: per_model_job(kueue_queue="gpu-queue", do_not_disrupt=True,
                                             ephemeral_storage_request="100Gi"),
    "placement": lambda: per_model_job(affinity=GPU_AFFINITY,
                                       node_selector={"pool": "gpu"}, memory_limit="64Gi"),
    "indexed-gpu": lambda: indexed_job(ephemeral_storage_request="100Gi"),
    "indexed-cpu": lambda: indexed_job(gpus_per_job=0, kueue_queue="cpu-queue"),
}


def test_default_worker_args_hold_a_yaml_12_trap() -> None:
    """The check below is about something real: the default flags hold `1e-05`."""
    assert "1e-05" in per_model_job()["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("name", list(DEFAULT_BUILDS))
def test_every_default_job_reads_back_the_same(name: str) -> None:
    """Each Job the builders make for a default sweep, alone and in one stream."""
    job = DEFAULT_BUILDS[name]()
    text = jobs_to_yaml([job])
    assert read_yaml12(text) == [job]
    assert list(yaml.safe_load_all(text)) == [job]


def test_a_stream_of_jobs_reads_back_in_order() -> None:
    jobs = [build() for build in DEFAULT_BUILDS.values()]
    text = jobs_to_yaml(jobs)
    assert text.count("\n---") + text.startswith("---") == len(jobs)
    assert read_yaml12(text) == jobs


def test_keys_and_plain_words_stay_readable() -> None:
    """Only what needs quotes is quoted: keys, names and words read as written."""
    text = jobs_to_yaml([per_model_job()])
    for line in ("apiVersion: batch/v1", "kind: Job", "  namespace: esd",
                 "    app.kubernetes.io/managed-by: esd-sweep", "        - esd-worker",
                 '        - "--evals-thresh"', '        - "1e-05"', "  backoffLimit: 3",
                 "      automountServiceAccountToken: false"):
        assert f"\n{line}\n" in text, line


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_rendered_manifests_read_the_same_in_yaml_12_and_11(name: str) -> None:
    """What `kubectl apply -k` sends (kustomize's output) means the same to a YAML 1.2 reader
    and to PyYAML: no label value (the version), annotation ("true", "9090") or priority
    that one reader takes for a number or a bool and the other for a string."""
    text = kustomize_text(str(KUSTOMIZATIONS[name]))
    assert read_yaml12(text) == [d for d in yaml.safe_load_all(text) if d is not None]
