"""Analysis and run settings of the worker: frozen, validated in one place, all problems at once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from esd_worker.core.echo import has_control, quoted
from esd_worker.core.errors import UsageError
from esd_worker.core.powerlaw import FIX_FINGERS

PRECISIONS = ("float32", "float64")
DEVICES = ("auto", "cpu", "cuda")
MAX_HOST_EIGENSOLVERS = 256  # host threads diagonalising layers beside the GPUs, at most


@dataclass(frozen=True)
class AnalysisSettings:
    """What is computed. Two results are comparable iff these are equal.

    fix_fingers: how xmin is chosen: xmin_mid (median, default), xmin_peak, DKS.
    evals_thresh: eigenvalues at or below this are left out of the fit (default 1e-5).
    bins: histogram bins for xmin_peak (default 100).
    min_evals: layers whose smaller side is below this get status=too_small (default 10).
    conv_norm: Conv2d slices are scaled by sqrt(conv_norm) before pooling (default 0.5).
    precision: float32 = Gram matrix + eigvalsh (fast path); float64 = float64 Gram +
        eigvalsh (alphas within ~1e-12 of float64 SVD; docs/metrics.md).
    include_embeddings: analyse Embedding layers too (default off).
    """

    fix_fingers: str = "xmin_mid"
    evals_thresh: float = 1e-5
    bins: int = 100
    min_evals: int = 10
    conv_norm: float = 0.5
    precision: str = "float32"
    include_embeddings: bool = False

    def validate(self) -> None:
        """Raise one UsageError that names every bad field."""
        problems: list[str] = []
        if self.fix_fingers not in FIX_FINGERS:
            problems.append(
                f"fix_fingers: {self.fix_fingers!r} is not one of {', '.join(FIX_FINGERS)}"
            )
        if not (math.isfinite(self.evals_thresh) and self.evals_thresh >= 0):
            problems.append(f"evals_thresh: must be finite and >= 0, got {self.evals_thresh}")
        if self.bins < 1:
            problems.append(f"bins: must be >= 1, got {self.bins}")
        if self.min_evals < 2:
            problems.append(f"min_evals: must be >= 2, got {self.min_evals}")
        if not (math.isfinite(self.conv_norm) and self.conv_norm > 0):
            problems.append(f"conv_norm: must be finite and > 0, got {self.conv_norm}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if problems:
            raise UsageError("invalid analysis settings: " + "; ".join(problems))

    def as_dict(self) -> dict[str, Any]:
        """The canonical form stored in result.json and compared for resume."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WorkerSettings:
    """One worker run.

    model: HF id with optional @revision, or a local directory in HF layout.
    base_model: base model (id[@rev] or dir) of an adapter; read from adapter_config.json if None.
    relation: base_model_relation from the model list ("" when unknown).
    output: result store URL (a directory or file:// URL).
    device: auto (CUDA when available), cpu or cuda.
    save_eigs: also write <model_key>/eigs.npz (default on).
    trust_remote_code: allow model code from the hub to build the layer map (default off).
    parallel_gpu: use every visible GPU for one model, one analysis stream each (default
        on); off: only the first (cuda:0), as the old --no-parallel-gpu.
    host_eigensolvers: host threads that diagonalise layers beside the GPUs (None: as many
        as the process's CPU quota leaves free; 0: none).
    """

    model: str
    output: str
    analysis: AnalysisSettings = AnalysisSettings()
    base_model: str | None = None
    relation: str = ""
    device: str = "auto"
    save_eigs: bool = True
    trust_remote_code: bool = False
    parallel_gpu: bool = True
    host_eigensolvers: int | None = None

    def validate(self) -> None:
        problems: list[str] = []
        if not self.model.strip():
            problems.append("model: must not be empty")
        for name, ref in (("model", self.model), ("base_model", self.base_model)):
            # A list row like it is refused (esd_worker.core.models.modellist); a raw newline would
            # print in every log line naming the model, as lines of their own.
            if ref is not None and has_control(ref):
                problems.append(f"{name}: control characters are not allowed in a model "
                                f"id: {quoted(ref)}")
        if not self.output.strip():
            problems.append("output: must not be empty")
        if self.device not in DEVICES:
            problems.append(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.host_eigensolvers is not None and not (
                0 <= self.host_eigensolvers <= MAX_HOST_EIGENSOLVERS):
            problems.append(f"host_eigensolvers: {self.host_eigensolvers} is not in 0.."
                            f"{MAX_HOST_EIGENSOLVERS}")
        try:
            self.analysis.validate()
        except UsageError as e:
            problems.append(str(e))
        if problems:
            raise UsageError("; ".join(problems))
