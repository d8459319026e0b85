"""Checkpoint files of one model: which tensors exist, their shapes, reading them one by one.

Which files are the weights (esd_worker.core.models.weightfiles) and what a safetensors header
holds (esd_worker.core.models.safetensors) are the shared core's, the controller's rules too;
here they are read with torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from esd_worker.core.errors import PermanentModelError
from esd_worker.core.models.safetensors import PREFIX_BYTES, header_length, parse_header
from esd_worker.core.models.weightfiles import ADAPTER_SAFETENSORS, SAFETENSORS_INDEX, weight_files

log = logging.getLogger(__name__)


def find_weight_files(directory: Path, *, adapter: bool = False) -> tuple[str, list[Path]]:
    """The weight files of a model directory, and their format: the top-level files that
    esd_worker.core.models.weightfiles picks (the download's rule: safetensors preferred, an
    adapter's own files for an adapter), the shards an index names when there is one.
    """
    try:
        names = [p.name for p in directory.iterdir() if p.is_file()]
    except OSError:
        names = []  # no directory: no weights, said below
    chosen = weight_files(names, adapter=adapter)
    if chosen is None and adapter:
        raise PermanentModelError(
            f"no adapter weights in {directory} (looked for {ADAPTER_SAFETENSORS}/.bin)"
        )
    if chosen is None:
        raise PermanentModelError(
            f"no weights in {directory} (looked for *.safetensors, {SAFETENSORS_INDEX}, "
            "pytorch_model*.bin): unsupported format"
        )
    if chosen.index is None:
        return chosen.format, [directory / name for name in chosen.names]
    # The index, not the names that look like shards, says which files hold the tensors.
    index = directory / chosen.index
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PermanentModelError(f"corrupt checkpoint index {index}: {e}") from e
    files = [directory / name for name in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise PermanentModelError(
            f"checkpoint index {index.name} names missing shards: {', '.join(missing[:3])}"
        )
    return chosen.format, files


class Tensors(Protocol):
    """What the analysis reads a model's weights through: a Checkpoint (files as stored), a
    view that dequantizes one (esd_worker.analysis.quantized), a GGUF file, or several
    components under prefixes (esd_worker.analysis.checkpoints). Thread-safe reads."""

    directory: Path

    def keys(self) -> list[str]: ...

    def __contains__(self, key: object) -> bool: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> str: ...

    def read(self, key: str) -> torch.Tensor: ...

    def read_row(self, key: str, index: int) -> torch.Tensor:
        """tensor[index] of a tensor of 3 or more dimensions (one expert of a stack), reading
        no more of it than needed where the format allows."""
        ...

    def nbytes(self, key: str) -> int: ...

    def in_memory(self, key: str) -> bool: ...

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor: ...

    def scheme(self, key: str) -> str | None:
        """The quantization scheme `key` was dequantized from (recorded in its layer row);
        None: read as stored."""
        ...

    def refusal(self, key: str) -> str | None:
        """Why `key` (a quantized weight) cannot be read as floats, or None when it can."""
        ...

    def folded(self) -> Mapping[str, str]:
        """Stored tensors that are part of another key's weight (a quantized weight's scales,
        zero points, group indices, ...): stored key -> the key they are folded into."""
        ...

    def close(self) -> None: ...


class Checkpoint:
    """Lazy view of a model's tensors; `read` loads one tensor into CPU memory.

    safetensors files are read tensor by tensor into buffers of their own (SafetensorsFile),
    not memory-mapped: a mapped checkpoint's pages stay in the worker's resident set until
    the file is closed (13.5 GiB for a 7B model), these go with each tensor.
    `.bin` files are loaded with `weights_only=True` (no code from the file runs) and
    memory-mapped where the file format allows it.
    """

    def __init__(self, directory: Path, *, adapter: bool = False,
                 beat: Callable[[], None] | None = None) -> None:
        """`beat`: called once each weight file is open (a sign of progress for the worker's
        heartbeat: a checkpoint of hundreds of .bin shards loads for a while)."""
        self.directory = directory
        self.format, self.files = find_weight_files(directory, adapter=adapter)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        try:
            for path in self.files:
                self._open(path)
                if beat is not None:
                    beat()
        except BaseException:
            self._stack.close()
            raise

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, torch.Tensor], *, name: str) -> Checkpoint:
        """A checkpoint of tensors already in memory (a model's state dict; `name` says whose
        in errors): `read` hands each over as a loaded .bin's, never copied up front and
        never modified (the analysis copies before it merges)."""
        self = cls.__new__(cls)
        self.directory = Path(name)
        self.format, self.files = "memory", []
        self._stack = contextlib.ExitStack()
        state = {key: value.detach() for key, value in tensors.items()
                 if isinstance(value, torch.Tensor)}
        self._where = dict.fromkeys(state, state)
        self._shapes = {key: tuple(value.shape) for key, value in state.items()}
        self._dtypes = {key: str(value.dtype).removeprefix("torch.")
                        for key, value in state.items()}
        return self

    def _open(self, path: Path) -> None:
        if self.format == "safetensors":
            try:
                handle = SafetensorsFile(path)
            except (OSError, ValueError) as e:
                raise PermanentModelError(f"corrupt safetensors file {path.name}: {e}") from e
            self._stack.callback(handle.close)
            for key in sorted(handle.entries):  # by name, as safetensors' own keys() lists them
                entry = handle.entries[key]
                self._once(key, path)
                self._where[key] = handle
                self._shapes[key] = entry.shape
                self._dtypes[key] = entry.dtype_name
            return
        state = _load_bin(path)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                self._once(key, path)
                self._where[key] = state
                self._shapes[key] = tuple(value.shape)
                self._dtypes[key] = str(value.dtype).removeprefix("torch.")

    def _once(self, key: str, path: Path) -> None:
        """A tensor stored by two of the weight files (two copies of one checkpoint, a broken
        shard split): which is the model's cannot be told, so the model fails."""
        if key in self._where:
            raise PermanentModelError(
                f"tensor {key!r} is stored twice, the second time in {path.name}: the weight "
                "files are two copies of the checkpoint, or a broken split")

    def close(self) -> None:
        self._stack.close()
        self._where.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        return self._dtypes[key]

    def read_row(self, key: str, index: int) -> torch.Tensor:
        """tensor[index] along its first dimension; from a safetensors file only its bytes."""
        source = self._where[key]
        if isinstance(source, dict):
            held: torch.Tensor = source[key]
            return held[index]
        try:
            tensor: torch.Tensor = source.read_row(key, index)
        except (OSError, ValueError) as e:
            raise PermanentModelError(f"corrupt tensor {key!r} in {self.directory}: {e}") from e
        return tensor

    def scheme(self, key: str) -> str | None:
        return None  # stored as is: a quantized checkpoint is esd_worker.analysis.quantized's

    def refusal(self, key: str) -> str | None:
        return None

    def folded(self) -> Mapping[str, str]:
        return {}

    def read(self, key: str) -> torch.Tensor:
        source = self._where[key]
        if isinstance(source, dict):
            return source[key]
        try:
            tensor: torch.Tensor = source.read(key)
        except (OSError, ValueError) as e:
            raise PermanentModelError(f"corrupt tensor {key!r} in {self.directory}: {e}") from e
        return tensor

    def nbytes(self, key: str) -> int:
        """The tensor's bytes as stored."""
        source = self._where[key]
        if isinstance(source, dict):
            tensor: torch.Tensor = source[key]
            return tensor.numel() * tensor.element_size()
        entry = source.entries[key]
        return int(entry.end - entry.start)

    def in_memory(self, key: str) -> bool:
        """Whether the tensor is held already (a .bin checkpoint, loaded or mapped): `read`
        hands it over, there is nothing to read into a buffer."""
        return isinstance(self._where[key], dict)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The tensor read into `out` (a uint8 buffer of at least nbytes(key)), a view of it;
        for a tensor held in memory (in_memory), a copy into it."""
        source = self._where[key]
        if isinstance(source, dict):
            held: torch.Tensor = source[key]
            n = held.numel() * held.element_size()
            return out[:n].view(held.dtype).reshape(held.shape).copy_(held)
        try:
            return source.read_into(key, out)
        except (OSError, ValueError) as e:
            raise PermanentModelError(f"corrupt tensor {key!r} in {self.directory}: {e}") from e

    def iter_tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            yield key, self.read(key)


# safetensors dtype names (what Checkpoint.dtype reports for these files) → torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# What the analysis upcasts exactly, by the name Checkpoint.dtype gives: safetensors' codes,
# and torch's names for .bin checkpoints. Integers and float8 get a status row instead.
_FLOATS: dict[str, torch.dtype] = {
    **{code: _DTYPES[code] for code in ("F16", "BF16", "F32", "F64")},
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64,
}


def float_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a checkpoint dtype name (Checkpoint.dtype) the analysis computes on;
    None for the others (integers, float8: a status row, nothing on the device). The one
    answer for the memory bound (streams), speculation and the analysis."""
    return _FLOATS.get(name)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype | None  # None: a dtype torch here cannot hold (reported, never read)
    dtype_name: str
    shape: tuple[int, ...]
    start: int  # in the file
    end: int


def read_exactly(fd: int, view: memoryview, start: int, short: str) -> None:
    """Fill `view` from the file at `start` with positioned reads (threads may read one file
    at once); OSError(`short`) when the file ends first."""
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], start + done)
        if got <= 0:
            raise OSError(short)
        done += got


class SafetensorsFile:
    """One .safetensors file: its header parsed once (esd_worker.core.models.safetensors,
    the controller's parser too, with the file's size checked against the data), each
    tensor read on demand into a buffer of its own. Thread-safe: reads are positioned
    (os.pread), so the read-ahead and the speculation threads may read at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.entries = self._header()
        except BaseException:
            os.close(self._fd)
            raise

    def _header(self) -> dict[str, _Entry]:
        size = os.fstat(self._fd).st_size
        length = header_length(os.pread(self._fd, PREFIX_BYTES, 0), file_size=size)
        header = parse_header(os.pread(self._fd, length, PREFIX_BYTES))
        header.check_file_size(size)
        base = header.data_start
        return {name: _Entry(_DTYPES.get(t.dtype), t.dtype, t.shape, base + t.start, base + t.end)
                for name, t in header.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        entry, dtype = self._readable(key)
        n = entry.end - entry.start
        buffer = bytearray(n)
        self._pread(key, memoryview(buffer), entry.start)
        if n == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape)

    def read_row(self, key: str, index: int) -> torch.Tensor:
        """tensor[index] along the first dimension, reading only its bytes."""
        entry, dtype = self._readable(key)
        if not entry.shape or not 0 <= index < entry.shape[0]:
            raise ValueError(f"tensor {key!r} of shape {entry.shape} has no row {index}")
        row = (entry.end - entry.start) // entry.shape[0]
        buffer = bytearray(row)
        self._pread(key, memoryview(buffer), entry.start + index * row)
        if row == 0:
            return torch.empty(entry.shape[1:], dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape[1:])

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The tensor read into the front of `out` (a contiguous uint8 CPU tensor, page-locked
        or not: esd_worker.analysis.staging), as a view of it."""
        entry, dtype = self._readable(key)
        n = entry.end - entry.start
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < n:
            raise ValueError(f"a buffer of {out.numel()} bytes cannot hold {key!r} ({n} bytes)")
        if n == 0:
            return torch.empty(entry.shape, dtype=dtype)
        self._pread(key, out.numpy().data[:n], entry.start)
        return out[:n].view(dtype).reshape(entry.shape)

    def _readable(self, key: str) -> tuple[_Entry, torch.dtype]:
        entry = self.entries[key]
        if entry.dtype is None:
            raise ValueError(f"tensor {key!r} has dtype {entry.dtype_name}, which torch "
                             f"{torch.__version__} cannot hold")
        return entry, entry.dtype

    def _pread(self, key: str, view: memoryview, start: int) -> None:
        read_exactly(self._fd, view, start, f"{self.path.name} ended inside tensor {key!r}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _load_bin(path: Path) -> dict[str, Any]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # Legacy (pre-zip) files cannot be memory-mapped.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise PermanentModelError(_load_error(path.name, e)) from e
    except OSError as e:
        raise PermanentModelError(f"cannot read weights file {path.name}: {e}") from e
    if not isinstance(state, dict):
        raise PermanentModelError(f"{path.name} holds {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    return state


# torch.load's reason comes wrapped in advice: load with weights_only=False, or allowlist
# the class or function the file names. Either would run code from a file nobody vetted:
# never to be suggested here, so every sentence of it goes.
_ADVICE = re.compile(
    r"weights.only|trust|safe_globals|allowlist|file an issue|two options|^\(\d\)",
    re.IGNORECASE,
)
_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")


def _load_error(name: str, e: BaseException) -> str:
    """The one line for a .bin file torch.load refused: the code it holds, or the reason."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split())  # no terminal colours
    code = _GLOBAL.search(text)
    if code:
        return (f"unsafe weights file {name}: it holds code ({code.group(1)}), which is not "
                "loaded: only tensors are read from weights files")
    text = text.split(" Check the documentation", 1)[0].split("WeightsUnpickler error:", 1)[-1]
    sentences = re.split(r"(?<=[.!?:])\s+", text)
    reason = " ".join(s for s in sentences if s and not _ADVICE.search(s)).strip(" .")
    return f"corrupt or unsafe weights file {name}: {reason[:300] or 'not a plain state dict'}"
