"""Quantized checkpoints read as float weights (issue 41).

Owns recognising a quantized weight by the tensors stored beside it and by config.json's
`quantization_config`, and dequantizing it in torch on the CPU, one weight at a time: the
analysis never sees raw quantized values. The schemes, family by family, are
esd_worker.analysis.quant's. Does not decide which weights are layers
(esd_worker.analysis.layers) or read files (esd_worker.analysis.weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from esd_worker.analysis.quant.plan import QuantConfig
from esd_worker.analysis.quant.view import QuantizedView, plans
from esd_worker.analysis.weights import Tensors


def dequantized(tensors: Tensors, config: Mapping[str, Any] | None, directory: Path) -> Tensors:
    """`tensors` as float weights: each quantized weight under its own key (`x.weight`, its
    logical shape, dtype F32), its scales and zero points folded into it (`folded`), its
    scheme said by `scheme`, a scheme that cannot be dequantized said by `refusal`.
    `config`: the component's config.json (None: none). Unquantized: `tensors` as they are
    (the same object). `directory`: the component's folder (named in errors)."""
    found = plans(tensors, QuantConfig.of(config))
    if not found:
        return tensors
    return QuantizedView(tensors, found, directory)
