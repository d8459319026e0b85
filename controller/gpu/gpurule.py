"""How many GPUs a model gets: its single-GPU analysis time estimated from its weights' shape.

Owns the rule and its settings (`--gpus-per-job N|auto`, `--multi-gpu-minutes`,
`--max-gpus-per-job`): the estimate, the count, the log line that explains a count. Pure:
where a model's shape comes from (a list column, safetensors headers on disk or on the hub)
is controller.weights.weightmeta's; which GPUs a worker gets is the backends'.

The estimate t (esd_worker.core.estimate): the eigensolver time of the whole model on one
H100, c·P·n; ~6 minutes for a 70B model, ~72 for a 405B.

The count: 1 while t ≤ the threshold (`--multi-gpu-minutes`, default 20), else
ceil(t / threshold), so that each GPU gets at most about a threshold's worth of work,
capped at `--max-gpus-per-job` (default 8, one node's GPUs) and at what the backend can
give. Why 20 minutes: a sweep's throughput is best with one model per GPU (every GPU busy
with its own model, nothing serial left idle), so splitting only pays for the models that
would otherwise run long alone at the end of a sweep or hold a pod for hours; with 20, no
model up to ~90B parameters is split (a 70B takes ~6 min), a 405B gets 4 GPUs (~18 min
each). An unknown shape (no metadata, the hub offline or past its lookup limit) gets 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from controller.weights.weightmeta import WeightShape
from esd_worker.core.command.flags import (
    MAX_GPUS_PER_MODEL,
    MINUTE_S,
    WEEK_S,
    add_flag,
    add_parallel_gpu_flags,
    float_in,
    int_in,
)
from esd_worker.core.estimate import single_gpu_minutes, width_from_params

DEFAULT_MULTI_GPU_MINUTES = 20.0
DEFAULT_MAX_GPUS_PER_JOB = 8
AUTO = "auto"


# argparse type of --gpus-per-job: "auto" (None) or a whole number of GPUs.
parse_gpus_per_job = int_in(0, MAX_GPUS_PER_MODEL, word=AUTO)


def add_gpu_rule_flags(group: Any) -> None:
    """`esd-sweep run`'s flags of the rule (and --parallel-gpu / --no-parallel-gpu, which
    decide whether a worker uses more than one GPU at all)."""
    add_flag(group, "--gpus-per-job", "--num-gpus-per-job", type=parse_gpus_per_job,
             default=None, metavar="N|auto",
             help="GPUs per model (default auto: 1, or several for a model estimated above "
             "--multi-gpu-minutes on one GPU, from its parameters and largest matrix read "
             "before download); N: every model gets N")
    add_flag(group, "--multi-gpu-minutes",
             type=float_in(0, WEEK_S // MINUTE_S, above=True, unit="minutes"),
             default=DEFAULT_MULTI_GPU_MINUTES,
             metavar="M", help="auto: a model estimated above M GPU-minutes on one GPU gets "
             f"ceil(estimate / M) GPUs (default {DEFAULT_MULTI_GPU_MINUTES:g}: no model up to "
             "~90B parameters is split)")
    add_flag(group, "--max-gpus-per-job", type=int_in(1, MAX_GPUS_PER_MODEL),
             default=DEFAULT_MAX_GPUS_PER_JOB,
             metavar="N", help="auto: the most GPUs one model gets, also on Kubernetes "
             f"(default {DEFAULT_MAX_GPUS_PER_JOB}: one node's GPUs)")
    add_parallel_gpu_flags(group)


def gpu_rule_from_args(args: argparse.Namespace, problems: list[str]) -> GpuRule:
    """The GpuRule of these flags (the defaults for a command without them); its problems
    go to `problems`, each naming its flag."""
    rule = GpuRule(explicit=getattr(args, "gpus_per_job", None),
                   multi_gpu_minutes=getattr(args, "multi_gpu_minutes",
                                             DEFAULT_MULTI_GPU_MINUTES),
                   max_gpus_per_job=getattr(args, "max_gpus_per_job", DEFAULT_MAX_GPUS_PER_JOB),
                   parallel=getattr(args, "parallel_gpu", True))
    try:
        rule.validate()
    except ValueError as e:
        problems.append(str(e).replace("multi_gpu_minutes:", "--multi-gpu-minutes:").replace(
            "max_gpus_per_job:", "--max-gpus-per-job:").replace("explicit:", "--gpus-per-job:"))
    return rule


@dataclass(frozen=True)
class GpuRule:
    """GPUs per model (built in controller.cli).

    explicit: --gpus-per-job N: every model gets N (None: auto, the default: the rule).
    multi_gpu_minutes: a model estimated above this many GPU-minutes on one GPU gets several
        (default 20; see the module docstring).
    max_gpus_per_job: the most GPUs the rule gives one model (default 8, one node's GPUs;
        the local backend also caps it at the GPUs it manages).
    parallel: the worker spreads a model over its GPUs (False: --no-parallel-gpu, so auto
        gives 1: more GPUs would sit idle).
    """

    explicit: int | None = None
    multi_gpu_minutes: float = DEFAULT_MULTI_GPU_MINUTES
    max_gpus_per_job: int = DEFAULT_MAX_GPUS_PER_JOB
    parallel: bool = True

    def validate(self) -> None:
        """Raise one ValueError that names every bad field."""
        problems: list[str] = []
        if self.explicit is not None and self.explicit < 0:
            problems.append(f"explicit: must be >= 0, got {self.explicit}")
        if not (self.multi_gpu_minutes > 0 and math.isfinite(self.multi_gpu_minutes)):
            problems.append(f"multi_gpu_minutes: must be > 0, got {self.multi_gpu_minutes}")
        if self.max_gpus_per_job < 1:
            problems.append(f"max_gpus_per_job: must be >= 1, got {self.max_gpus_per_job}")
        if problems:
            raise ValueError("invalid GPU rule: " + "; ".join(problems))

    @property
    def auto(self) -> bool:
        """Whether models may get different counts (auto, and a worker that uses them)."""
        return self.explicit is None and self.parallel

    @property
    def base(self) -> int:
        """The count of a model nobody looked at: N when explicit, else 1."""
        return 1 if self.explicit is None else self.explicit

    def splits(self, cap: int) -> bool:
        """Whether any model can get more than one GPU where `cap` GPUs is the most one
        worker can have: the only case where a model's shape is worth looking up."""
        return self.auto and min(cap, self.max_gpus_per_job) > 1

    def gpus(self, shape: WeightShape | None, *, cap: int) -> int:
        """The GPUs `shape`'s model gets, at most `cap` (the backend's bound, >= 1)."""
        if not self.auto:
            return self.base
        if shape is None:
            return 1
        minutes = single_gpu_minutes(shape.params, shape.width)
        if minutes <= self.multi_gpu_minutes:
            return 1
        wanted = math.ceil(minutes / self.multi_gpu_minutes)
        return max(1, min(wanted, self.max_gpus_per_job, cap))

    def explain(self, cap: int) -> str:
        """The rule in words, for the run's log: "auto: 1, or up to 4 for a model estimated
        above 20 GPU-min on one GPU", or "2 (--gpus-per-job)"."""
        if self.explicit is not None:
            return f"{self.explicit} (--gpus-per-job)"
        if not self.splits(cap):
            why = "--no-parallel-gpu" if not self.parallel else f"at most {cap} per worker"
            return f"1 ({why})"
        return (f"auto: 1, or up to {min(cap, self.max_gpus_per_job)} for a model estimated "
                f"above {self.multi_gpu_minutes:g} GPU-min on one GPU (--multi-gpu-minutes)")

    def width_matters(self, params: int) -> bool:
        """Whether a model of `params` could pass the threshold with a width up to twice the
        one inferred from its size (width_from_params): below that, a header read to learn
        the real width would not change the answer (1 GPU), so none is made."""
        if not self.auto:
            return False
        minutes = single_gpu_minutes(params, 2 * width_from_params(params))
        return minutes > self.multi_gpu_minutes


def describe(label: str, shape: WeightShape, gpus: int) -> str:
    """The log line of a model's count: "model=X: ~405.0B params, largest matrix 16384, est
    ~72 GPU-min on one GPU → 4 GPUs"."""
    inferred = " (inferred)" if shape.width_inferred else ""
    return (f"model={label}: ~{_count(shape.params)} params, largest matrix "
            f"{shape.width}{inferred}, est ~{single_gpu_minutes(shape.params, shape.width):.0f}"
            f" GPU-min on one GPU → {gpus} GPU{'s' if gpus != 1 else ''}")


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
