"""Rows of stacked tensors as tensors of their own: the key `x[i]` is row i of the stored
tensor `x` (one expert of a MoE stored 3-D, a position table stored (1, n, d)), read alone.

Owns reading a layer key that may name such a slice (esd_worker.analysis.accounting names
them): the stored tensor is never read whole for one expert where its format allows
(Tensors.read_row: a safetensors file reads only that expert's bytes), and never copied
whole to the device. Keys without a slice pass through to the Tensors as they are.
"""

from __future__ import annotations

import re
from math import prod

import torch

from esd_worker.analysis.weights import Tensors

_SLICE = re.compile(r"^(?P<base>.*?)(?P<rows>(?:\[\d+\])+)$")


def row_key(key: str, *rows: int) -> str:
    """The layer key that reads row `rows[0]` (then `rows[1]` of that, ...) of stored `key`."""
    return key + "".join(f"[{i}]" for i in rows)


def split(key: str) -> tuple[str, list[int]]:
    """The stored key and the row indices a layer key reads (none: the whole tensor)."""
    m = _SLICE.match(key)
    if m is None:
        return key, []
    return m["base"], [int(i) for i in re.findall(r"\d+", m["rows"])]


class Sliced:
    """The reader of a model's layers over its Tensors (the staging's Reader, the dtype and
    quantization of each layer key). Owns the `key[i]` syntax (row_key, split)."""

    def __init__(self, tensors: Tensors) -> None:
        self.tensors = tensors

    def read(self, key: str) -> torch.Tensor:
        base, rows = split(key)
        if not rows:
            return self.tensors.read(key)
        tensor = self.tensors.read_row(base, rows[0])
        for i in rows[1:]:
            tensor = tensor[i]
        return tensor

    def dtype(self, key: str) -> str:
        return self.tensors.dtype(split(key)[0])

    def nbytes(self, key: str) -> int:
        base, rows = split(key)
        if not rows:
            return self.tensors.nbytes(key)
        shape = self.tensors.shape(base)
        return self.tensors.nbytes(base) * prod(shape[len(rows):]) // max(1, prod(shape))

    def in_memory(self, key: str) -> bool:
        rows = split(key)[1]
        # A slice is read as a tensor of its own (read_row), not into a staging buffer.
        return bool(rows) or self.tensors.in_memory(key)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        return self.tensors.read_into(key, out)  # never a slice: in_memory says so

    def quantization(self, key: str) -> tuple[str | None, str | None]:
        """The scheme the stored tensor was dequantized from, and why it cannot be read as
        floats (modellayers.Quantization)."""
        base = split(key)[0]
        return self.tensors.scheme(base), self.tensors.refusal(base)
