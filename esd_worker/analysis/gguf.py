"""A GGUF file set (llama.cpp's format) read as a model's tensors (issue 41).

Owns reading one GGUF file, or the parts of a split (x-00001-of-00003.gguf ...), through the
`gguf` package: the header parsed by its GGUFReader (memory-mapped, then let go: only the
header's pages are touched), each tensor read on demand with positioned reads into a buffer of
its own, and quantized block types dequantized to float32 by `gguf.quants.dequantize`, one
tensor (or one row of a stack) at a time. Shapes are in torch's order (GGUF lists ne0, the
fastest-varying dimension, first), names are GGUF's own (blk.0.attn_q.weight, ...). Which GGUF
file set stands for a repo is esd_worker.core.models.weightfiles' rule; which tensors are
layers is esd_worker.analysis.layers'.

llama.cpp's converters permute the rows of Q and K (to interleave rotary halves): a row
permutation changes no singular value, so the spectra are the model's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from esd_worker.analysis.weights import read_exactly
from esd_worker.core.errors import PermanentModelError

# GGUF's unquantized types: read as stored, under safetensors' dtype names (the names
# esd_worker.analysis.weights.float_dtype knows; integers get a status row there).
_STORED: dict[str, tuple[str, torch.dtype]] = {
    "F32": ("F32", torch.float32), "F16": ("F16", torch.float16),
    "BF16": ("BF16", torch.bfloat16), "F64": ("F64", torch.float64),
    "I8": ("I8", torch.int8), "I16": ("I16", torch.int16), "I32": ("I32", torch.int32),
    "I64": ("I64", torch.int64),
}
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class _Entry:
    file: int  # index into GgufTensors._fds
    type_name: str  # GGML's name of the block type: F16, Q8_0, Q4_K, ...
    quant: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    start: int  # in the file
    nbytes: int
    refusal: str | None  # why a quantized type cannot be read as floats


class GgufTensors:
    """The tensors of one GGUF file set (the Tensors protocol of esd_worker.analysis.weights).

    dtype: F32/F16/BF16/F64 (and I8...I64) as stored; "F32" for a quantized tensor, which
    `read` dequantizes (`scheme`: "gguf-<type>", e.g. gguf-Q4_K; `refusal`: why not, for a
    type the gguf package cannot dequantize or a row not whole blocks). `directory` is the
    first file (the set's name in errors: a GGUF file is its own config). Thread-safe reads
    (os.pread)."""

    def __init__(self, paths: Sequence[Path], *, beat: Callable[[], None] | None = None
                 ) -> None:
        if not paths:
            raise PermanentModelError("no GGUF files to read")
        self.directory = paths[0]
        self.files = list(paths)
        self._fds: list[int] = []
        self._entries: dict[str, _Entry] = {}
        try:
            _check_parts(self.files)
            for path in self.files:
                self._open(path)
                if beat is not None:
                    beat()
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise PermanentModelError(f"{path.name} is a GGUF file, and reading GGUF needs "
                                      f"the gguf package, which this worker lacks ({e})") from e
        try:
            reader = GGUFReader(path, "r")
        except (OSError, ValueError, KeyError, IndexError) as e:  # a bad magic, version, type
            raise PermanentModelError(f"corrupt or unsupported GGUF file {path.name}: {e}") from e
        if reader.byte_order != "I":
            raise PermanentModelError(f"GGUF file {path.name} is big-endian: not read here")
        file = len(self._fds)
        self._fds.append(os.open(path, os.O_RDONLY))
        size = os.fstat(self._fds[-1]).st_size
        for tensor in reader.tensors:
            if tensor.name in self._entries:
                raise PermanentModelError(f"GGUF tensor {tensor.name!r} is stored twice "
                                          f"(again in {path.name})")
            start, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
            if start + nbytes > size:
                raise PermanentModelError(f"corrupt GGUF file {path.name}: it ends inside "
                                          f"tensor {tensor.name!r}")
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            quant = tensor.tensor_type
            self._entries[tensor.name] = _Entry(file, quant.name, quant, shape, start, nbytes,
                                                _refusal(quant, shape))
        del reader  # its map goes with it: tensors are read with pread

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._entries.clear()

    def __enter__(self) -> GgufTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def dtype(self, key: str) -> str:
        entry = self._entries[key]
        stored = _STORED.get(entry.type_name)
        return stored[0] if stored else "F32"

    def scheme(self, key: str) -> str | None:
        entry = self._entries[key]
        return None if entry.type_name in _STORED else f"gguf-{entry.type_name}"

    def refusal(self, key: str) -> str | None:
        return self._entries[key].refusal

    def folded(self) -> Mapping[str, str]:
        return {}  # a GGUF block holds its own scales

    def nbytes(self, key: str) -> int:
        """The tensor's bytes as stored (quantized: its blocks)."""
        return self._entries[key].nbytes

    def in_memory(self, key: str) -> bool:
        """A quantized tensor is made by `read` (dequantized): nothing to read into a buffer."""
        return self._entries[key].type_name not in _STORED

    def read(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        return self._decode(key, entry, entry.shape, entry.start, entry.nbytes)

    def read_row(self, key: str, index: int) -> torch.Tensor:
        """tensor[index] along its first dimension, reading (and dequantizing) only its bytes."""
        entry = self._entries[key]
        if len(entry.shape) < 2 or not 0 <= index < entry.shape[0]:
            raise PermanentModelError(f"GGUF tensor {key!r} of shape {entry.shape} has no "
                                      f"row {index}")
        row = entry.nbytes // entry.shape[0]
        return self._decode(key, entry, entry.shape[1:], entry.start + index * row, row)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The tensor read into the front of `out` (a contiguous uint8 buffer, nbytes(key)
        for a stored type), a view of it; a dequantized one is copied in (it needs its float32
        bytes)."""
        entry = self._entries[key]
        stored = _STORED.get(entry.type_name)
        if stored is None:
            tensor = self.read(key)
            n = tensor.numel() * tensor.element_size()
            if out.dtype != torch.uint8 or out.numel() < n:
                raise PermanentModelError(f"a buffer of {out.numel()} bytes cannot hold "
                                          f"{key!r} ({n} bytes)")
            return out[:n].view(tensor.dtype).reshape(tensor.shape).copy_(tensor)
        n = entry.nbytes
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < n:
            raise PermanentModelError(f"a buffer of {out.numel()} bytes cannot hold {key!r} "
                                      f"({n} bytes)")
        if n == 0:
            return torch.empty(entry.shape, dtype=stored[1])
        self._pread(key, entry, out.numpy().data[:n], entry.start)
        return out[:n].view(stored[1]).reshape(entry.shape)

    def _decode(self, key: str, entry: _Entry, shape: tuple[int, ...], start: int,
                n: int) -> torch.Tensor:
        """`n` bytes at `start` of `entry`'s file as a tensor of `shape`: as stored, or
        dequantized to float32."""
        buffer = bytearray(n)
        self._pread(key, entry, memoryview(buffer), start)
        stored = _STORED.get(entry.type_name)
        if stored is not None:
            if n == 0:
                return torch.empty(shape, dtype=stored[1])
            return torch.frombuffer(buffer, dtype=stored[1]).reshape(shape)
        if entry.refusal is not None:
            raise PermanentModelError(f"GGUF tensor {key!r}: {entry.refusal}")
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        blocks = np.frombuffer(buffer, dtype=np.uint8).reshape(
            quant_shape_to_byte_shape(shape, entry.quant))
        try:
            values = dequantize(blocks, entry.quant)
        except (ValueError, NotImplementedError) as e:
            raise PermanentModelError(f"GGUF tensor {key!r} ({entry.type_name}) cannot be "
                                      f"dequantized: {e}") from e
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)

    def _pread(self, key: str, entry: _Entry, view: memoryview, start: int) -> None:
        short = f"{self.files[entry.file].name} ended inside GGUF tensor {key!r}"
        try:
            read_exactly(self._fds[entry.file], view, start, short)
        except OSError as e:
            raise PermanentModelError(str(e)) from e


_DEQUANTIZABLE: dict[str, str | None] = {}  # GGML type name -> why not (None: it can be)


def _refusal(quant: Any, shape: tuple[int, ...]) -> str | None:
    """Why a tensor of GGML type `quant` and `shape` cannot be read as floats; None if it can."""
    name = quant.name
    if name in _STORED:
        return None
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[quant]
    if name not in _DEQUANTIZABLE:
        try:  # one block of zeros: whether this gguf can dequantize the type at all
            dequantize(np.zeros((1, size), dtype=np.uint8), quant)
            _DEQUANTIZABLE[name] = None
        except NotImplementedError:
            _DEQUANTIZABLE[name] = (f"the gguf package cannot dequantize {name} blocks "
                                    "(a newer gguf may)")
    if _DEQUANTIZABLE[name] is not None:
        return _DEQUANTIZABLE[name]
    if not shape or shape[-1] % block:
        return f"its rows ({shape[-1] if shape else 0} values) are not whole {name} blocks"
    return None


def _check_parts(paths: Sequence[Path]) -> None:
    """A split's parts must all be there: each part holds only its own tensors."""
    splits = [_SPLIT.search(p.name) for p in paths]
    if not any(splits):
        return
    totals = {int(m.group(2)) for m in splits if m}
    parts = sorted(int(m.group(1)) for m in splits if m)
    if len(totals) != 1 or None in splits or parts != list(range(1, max(totals) + 1)):
        names = ", ".join(p.name for p in paths[:4])
        raise PermanentModelError(f"GGUF split is incomplete or mixed: {names} "
                                  f"(parts {parts} of {sorted(totals)})")


def open_gguf(directory: Path, names: Sequence[str], *,
              beat: Callable[[], None] | None = None) -> GgufTensors:
    """The GGUF file set `names` (relative to `directory`) opened as one Tensors."""
    return GgufTensors([directory / name for name in names], beat=beat)
