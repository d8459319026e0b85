"""Tests of controller.gpu.gpurule: the single-GPU estimate, the count it gives, the flag's values.

The estimate's anchors are the issue's figures (an H100 eigensolves a 4096² Gram in 89 ms;
a 70B Llama is ~6 GPU-minutes, a 405B ~72), recomputed here from the measured 89 ms and the
stated matrix-area factor rather than copied from the module, so a changed constant fails.
"""

from __future__ import annotations

import argparse
import math

import pytest

from controller.gpu.gpurule import (
    GpuRule,
    WeightShape,
    describe,
    parse_gpus_per_job,
)
from esd_worker.core.estimate import single_gpu_minutes, width_from_params

LLAMA_70B = WeightShape(70 * 10**9, 8192)
LLAMA_405B = WeightShape(405 * 10**9, 16384)
SMALL = WeightShape(125 * 10**6, 768)


def test_the_estimate_is_the_measured_gram_time_per_matrix_of_the_model() -> None:
    """P / (2·n²) matrices of width n, each 0.089 s · (n/4096)³ on an H100."""
    for shape in (LLAMA_70B, LLAMA_405B, SMALL):
        matrices = shape.params / (2 * shape.width**2)
        expected = matrices * 0.089 * (shape.width / 4096) ** 3 / 60
        assert single_gpu_minutes(shape.params, shape.width) == pytest.approx(expected)
    assert 5.5 < single_gpu_minutes(LLAMA_70B.params, LLAMA_70B.width) < 7
    assert 65 < single_gpu_minutes(LLAMA_405B.params, LLAMA_405B.width) < 80


@pytest.mark.parametrize(("rule", "shape", "cap", "expected"), [
    (GpuRule(), SMALL, 8, 1),
    (GpuRule(), LLAMA_70B, 8, 1),  # ~6 min: under the 20 min threshold
    (GpuRule(), LLAMA_405B, 8, 4),  # ~72 min: ceil(72 / 20)
    (GpuRule(), LLAMA_405B, 3, 3),  # the backend's cap
    (GpuRule(max_gpus_per_job=2), LLAMA_405B, 8, 2),  # --max-gpus-per-job
    (GpuRule(multi_gpu_minutes=5), LLAMA_70B, 8, 2),  # ~6.2 min over 5: ceil(1.24)
    (GpuRule(multi_gpu_minutes=10), LLAMA_405B, 8, 8),  # ceil(7.2) = 8
    (GpuRule(multi_gpu_minutes=1), LLAMA_405B, 16, 8),  # the rule's own cap, 8
    (GpuRule(), None, 8, 1),  # unknown shape
    (GpuRule(parallel=False), LLAMA_405B, 8, 1),  # --no-parallel-gpu: auto gives 1
    (GpuRule(explicit=2), SMALL, 8, 2),  # --gpus-per-job 2: every model
    (GpuRule(explicit=2), LLAMA_405B, 8, 2),
    (GpuRule(explicit=3, parallel=False), None, 8, 3),  # explicit N wins, as before
    (GpuRule(explicit=0), LLAMA_405B, 8, 0),  # CPU Jobs on Kubernetes
], ids=["small", "70b", "405b", "405b-capped-by-backend", "405b-max-flag", "70b-low-threshold",
        "405b-threshold-10", "405b-rule-cap", "unknown", "no-parallel", "explicit-small",
        "explicit-big", "explicit-no-parallel", "explicit-zero"])
def test_gpus(rule: GpuRule, shape: WeightShape | None, cap: int, expected: int) -> None:
    assert rule.gpus(shape, cap=cap) == expected


@pytest.mark.parametrize(("rule", "cap", "splits"), [
    (GpuRule(), 8, True), (GpuRule(), 1, False), (GpuRule(max_gpus_per_job=1), 8, False),
    (GpuRule(parallel=False), 8, False), (GpuRule(explicit=4), 8, False),
], ids=["auto", "one-gpu-box", "max-one", "no-parallel", "explicit"])
def test_splits_only_when_a_model_could_get_several(rule: GpuRule, cap: int,
                                                    splits: bool) -> None:
    """No shape is worth looking up when every model gets the same count anyway."""
    assert rule.splits(cap) is splits


def test_width_matters_only_near_or_over_the_threshold() -> None:
    """Below ~95B parameters even twice the inferred width stays under 20 min: no header read
    can change the answer; the 405B can pass it."""
    rule = GpuRule()
    assert not rule.width_matters(70 * 10**9)
    assert rule.width_matters(405 * 10**9)
    boundary = next(p for p in range(10, 400) if rule.width_matters(p * 10**9))
    minutes = single_gpu_minutes(boundary * 10**9, 2 * width_from_params(boundary * 10**9))
    assert 80 <= boundary <= 110 and minutes > 20
    assert not GpuRule(explicit=1).width_matters(10**12)


@pytest.mark.parametrize(("params", "hidden"), [
    (7 * 10**9, 4096), (13 * 10**9, 5120), (70 * 10**9, 8192), (405 * 10**9, 16384),
], ids=["7b", "13b", "70b", "405b"])
def test_width_from_params_is_near_llamas_hidden_size(params: int, hidden: int) -> None:
    assert abs(width_from_params(params) - hidden) / hidden < 0.1


@pytest.mark.parametrize(("text", "expected"), [("auto", None), ("AUTO", None), ("1", 1),
                                                ("0", 0), ("8", 8)])
def test_parse_gpus_per_job(text: str, expected: int | None) -> None:
    assert parse_gpus_per_job(text) == expected


@pytest.mark.parametrize("text", ["-1", "two", "1.5", ""])
def test_parse_gpus_per_job_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_gpus_per_job(text)


def test_validate_names_every_bad_field() -> None:
    with pytest.raises(ValueError) as e:
        GpuRule(explicit=-1, multi_gpu_minutes=math.nan, max_gpus_per_job=0).validate()
    for name in ("explicit", "multi_gpu_minutes", "max_gpus_per_job"):
        assert name in str(e.value)
    GpuRule().validate()


def test_describe_says_the_estimate_and_the_count() -> None:
    line = describe("meta-llama/Llama-3.1-405B", LLAMA_405B, 4)
    assert line.startswith("model=meta-llama/Llama-3.1-405B: ~405.0B params, largest matrix "
                           "16384, est ~72 GPU-min on one GPU")
    assert line.endswith("→ 4 GPUs")
    inferred = WeightShape(405 * 10**9, 15850, "hub", width_inferred=True)
    assert "largest matrix 15850 (inferred)" in describe("x", inferred, 4)


@pytest.mark.parametrize(("rule", "cap", "expected"), [
    (GpuRule(explicit=2), 8, "2 (--gpus-per-job)"),
    (GpuRule(parallel=False), 8, "1 (--no-parallel-gpu)"),
    (GpuRule(), 1, "1 (at most 1 per worker)"),
    (GpuRule(max_gpus_per_job=4), 8, "auto: 1, or up to 4 for a model estimated above 20 "
     "GPU-min on one GPU (--multi-gpu-minutes)"),
    (GpuRule(multi_gpu_minutes=5), 3, "auto: 1, or up to 3 for a model estimated above 5 "
     "GPU-min on one GPU (--multi-gpu-minutes)"),
])
def test_explain_says_the_rule_the_run_uses(rule: GpuRule, cap: int, expected: str) -> None:
    assert rule.explain(cap) == expected
