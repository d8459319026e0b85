"""How long analysing a model takes on one GPU, from its parameter count and matrix width.

Owns the estimate that both sides use: the controller's GPU rule (controller.gpu.gpurule:
how many GPUs a model gets) and the no-progress limit of a long-lived worker
(esd_worker.core.watchdog: when a model counts as hung). Pure arithmetic; where a model's
shape comes from is controller.weights.weightmeta's.

The estimate. Layers are independent and a layer's cost is the eigensolver on its Gram
matrix, whose width is the smaller side n of the weight matrix: cost ∝ n³. Measured on an
H100: 89 ms for a 4096² Gram (float32 Gram + eigvalsh). A model of P parameters whose
largest matrices have smaller side n holds about P / (A·n²) matrices of that width, where
A is their average area in units of n²: A ≈ 2 for transformers (Llama-2-70B: 560 matrices,
P / n² ≈ 1040 at n = 8192, so A ≈ 1.9; Llama-3.1-405B: 882 matrices, P / n² ≈ 1510 at
n = 16384, A ≈ 1.7). So

    t ≈ P / (A·n²) · 0.089 s · (n / 4096)³ = c · P · n,   c = 0.089 s / (A · 4096³)

which gives ~6 minutes for a 70B model (n = 8192) and ~72 minutes for a 405B (n = 16384)
on one H100. It counts the eigensolver only (downloads, reading and the Gram products come
on top) and is an H100 figure: replace GRAM_S_4096 with the benchmark's figure for the
GPUs you run on (benchmarks/bench_worker.py). Smaller matrices (GQA's k/v projections)
make it an overestimate, which errs towards more GPUs for the biggest models only.
"""

from __future__ import annotations

GRAM_S_4096 = 0.089  # s: one 4096x4096 float32 Gram's eigvalsh on an H100 (measured)
MATRIX_AREA = 2.0  # a transformer's matrices average ~2 n² (see the module docstring)
SECONDS_PER_PARAM_WIDTH = GRAM_S_4096 / (MATRIX_AREA * 4096**3)  # c in t ≈ c·P·n


def single_gpu_minutes(params: int, width: int) -> float:
    """The estimated eigensolver time of the whole model on one GPU, minutes (c·P·n)."""
    return SECONDS_PER_PARAM_WIDTH * params * width / 60


def width_from_params(params: int) -> int:
    """A transformer's hidden size from its parameter count alone, n ≈ 4096·(P / 7e9)^(1/3)
    (Llama: 7B 4096, 13B 5040 for 5120, 70B 8820 for 8192, 405B 15850 for 16384): used when
    no header says better."""
    return max(1, round(4096 * (max(params, 0) / 7e9) ** (1 / 3)))
