"""The safetensors header: the one parser of it, for the worker's reader and the controller.

The format: 8 bytes of little-endian header length N, N bytes of a JSON object
{name: {"dtype": …, "shape": […], "data_offsets": [start, end]}, "__metadata__": {…}}, then the
tensors' data, the offsets counted from its start. Owns the length prefix and its bound, the
JSON's parse and every check of it that the safetensors loader makes on a header: each
entry's fields, a byte count that fits its dtype and shape, ranges that tile the data exactly
(header_length, parse_header), and the check of those ranges against a file's size
(Header.check_file_size). Torch-free: dtypes are names here; esd_worker.analysis.weights
maps them to torch's and reads the tensors, controller.weights.weightmeta sums the shapes
(from a local file or bytes read over HTTP). Does not read tensor data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

PREFIX_BYTES = 8
# The safetensors library's own bound (MAX_HEADER_SIZE, 100_000_000 bytes): past it, no
# loader opens the file, so the worker could never read it and the controller need not size
# it. It is kept over the two bounds this replaces: the worker's 100 MiB let through files the
# loader refuses, and huggingface_hub's 25 MB (a client's choice for metadata over HTTP)
# refused files the worker reads, giving such a model one GPU for no reason.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
# Bits per element of the safetensors dtypes (F4 and F6 pack elements across bytes). A dtype
# not here is listed with its tensor but its byte count is not checked: the reader refuses
# to read it (a dtype this code has never seen).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
    "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
    "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class HeaderError(ValueError):
    """Not a safetensors header (or not one of this file): too short or too long, cut off,
    not a JSON object of tensors, or tensors whose bytes do not fit their shapes or the
    data."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: its dtype name, shape, and byte range in the data section
    (start, end: from the start of the data, as the header gives them)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A parsed header: `length` bytes of JSON (after the 8-byte prefix) and its tensors by
    name, in the header's order. The tensors tile bytes 0..data_bytes of the data."""

    length: int
    tensors: dict[str, TensorEntry]

    @property
    def data_start(self) -> int:
        """Where the data begins in the file."""
        return PREFIX_BYTES + self.length

    @property
    def data_bytes(self) -> int:
        """The bytes the tensors take: the data section's size the header claims."""
        return sum(t.nbytes for t in self.tensors.values())

    def check_file_size(self, size: int) -> None:
        """HeaderError unless the data section fills a `size`-byte file exactly: a tensor past
        the end is a cut-off download, bytes after the last tensor are read by nobody."""
        room = size - self.data_start
        for name, tensor in self.tensors.items():
            if tensor.end > room:
                raise HeaderError(f"tensor {name!r} lies outside the file")
        if self.data_bytes != room:
            raise HeaderError(f"{room - self.data_bytes} bytes of data after the last tensor")


def header_length(prefix: bytes, *, file_size: int | None = None) -> int:
    """The JSON header's length, from a file's first 8 bytes; `file_size`, when known, must
    hold it."""
    if len(prefix) < PREFIX_BYTES:
        raise HeaderError(f"{len(prefix)} bytes, fewer than the 8 of the header length "
                          "(shorter than a safetensors header)")
    length = int.from_bytes(prefix[:PREFIX_BYTES], "little")
    if file_size is not None and length > file_size - PREFIX_BYTES:
        raise HeaderError(f"header length {length} does not fit a {file_size}-byte file")
    if not 2 <= length <= MAX_HEADER_BYTES:  # 2: "{}", the least JSON object
        raise HeaderError(f"a header length of {length} bytes (at least 2, at most "
                          f"{MAX_HEADER_BYTES})")
    return length


def parse_header(raw: bytes) -> Header:
    """The header whose JSON is `raw` (the `length` bytes after the prefix), checked as the
    safetensors loader checks it; HeaderError otherwise."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HeaderError(f"the header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise HeaderError("the header is not a JSON object")
    tensors = {str(name): _entry(str(name), info) for name, info in doc.items()
               if name != METADATA_KEY}
    _check_tiling(tensors)
    return Header(len(raw), tensors)


def read_header(path: Path) -> Header:
    """A local file's header, reading only the header (OSError, HeaderError); its data is
    not looked at (Header.check_file_size is the reader's)."""
    with open(path, "rb") as f:
        length = header_length(f.read(PREFIX_BYTES))
        raw = f.read(length)
    if len(raw) < length:
        raise HeaderError(f"the header is cut off ({len(raw)} of {length} bytes)")
    return parse_header(raw)


def _entry(name: str, info: object) -> TensorEntry:
    shown = repr(name[:80])
    if not isinstance(info, dict):
        raise HeaderError(f"bad header entry {shown}: not a JSON object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in info]
    if missing:
        raise HeaderError(f"bad header entry {shown}: no {', '.join(missing)}")
    dtype, dims, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise HeaderError(f"bad header entry {shown}: dtype {dtype!r} is not a name")
    if not (isinstance(dims, list) and all(_whole(d) for d in dims)):
        raise HeaderError(f"bad header entry {shown}: no shape of whole numbers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise HeaderError(f"bad header entry {shown}: data_offsets {str(offsets)[:40]} are "
                          "not a start and an end")
    entry = TensorEntry(dtype, tuple(dims), offsets[0], offsets[1])
    bits = DTYPE_BITS.get(dtype)
    if bits is not None and math.prod(entry.shape) * bits != 8 * entry.nbytes:
        raise HeaderError(f"tensor {shown}: {entry.nbytes} bytes for shape {entry.shape} "
                          f"{dtype}")
    return entry


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(tensors: dict[str, TensorEntry]) -> None:
    """The tensors' byte ranges, sorted, must tile the data from its start without a gap
    (the safetensors loader's rule): an overlap would let one tensor's bytes be analysed
    under two names, a gap hides bytes nobody reads. Zero-size tensors sit anywhere in the
    sequence. Where the data ends is the file's business (Header.check_file_size)."""
    at = 0
    for start, end, name in sorted((t.start, t.end, n) for n, t in tensors.items()):
        if start != at:
            how = "overlaps the tensor before it" if start < at else "leaves a gap before it"
            raise HeaderError(f"tensor {name[:80]!r} {how} in the data (offset {start}, "
                              f"expected {at})")
        at = end
