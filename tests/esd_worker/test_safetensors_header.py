"""esd_worker.core.models.safetensors: the one parser of a safetensors header, and that its two
users take and refuse the same files: the worker's reader (esd_worker.analysis.weights.
SafetensorsFile) and the controller's shape (controller.weights.weightmeta.read_shape). They
once parsed the header each their own way: the controller took headers without offsets, with
overlapping tensors or bytes that fit no shape, the worker took shapes of strings and floats,
and their bounds on the header's length differed (25 MB against 100 MiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.weights.weightmeta import read_shape
from esd_worker.analysis.weights import SafetensorsFile
from esd_worker.core.models.safetensors import (
    MAX_HEADER_BYTES,
    HeaderError,
    header_length,
    parse_header,
)


def f32(n: int, start: int) -> dict[str, object]:
    return {"dtype": "F32", "shape": [n], "data_offsets": [start, start + 4 * n]}


# name -> (the header's JSON, accepted). Each file holds as many data bytes as the largest
# offset claims, so that only the header decides.
HEADERS: dict[str, tuple[object, bool]] = {
    "two-tensors": ({"a": f32(2, 0), "b": f32(3, 8)}, True),
    "with-metadata": ({"__metadata__": {"format": "pt"}, "a": f32(2, 0)}, True),
    "no-tensors": ({}, True),
    "zero-size-tensor-anywhere": (
        {"a": f32(2, 0), "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [8, 8]},
         "b": f32(1, 8)}, True),
    "packed-f4": ({"x": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, True),
    "a-dtype-never-seen": ({"x": {"dtype": "Q7", "shape": [3], "data_offsets": [0, 5]}}, True),
    "not-an-object": ([1, 2], False),
    "tensor-not-an-object": ({"w": [3, 2]}, False),
    "no-offsets": ({"w": {"dtype": "F32", "shape": [2]}}, False),
    "no-dtype": ({"w": {"shape": [2], "data_offsets": [0, 8]}}, False),
    "dtype-not-a-name": ({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}}, False),
    "shape-of-strings": ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, False),
    "shape-of-floats": ({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, False),
    "negative-dim": ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, False),
    "bytes-fit-no-shape": ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                           False),
    "end-before-start": ({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, False),
    "overlapping": ({"a": f32(2, 0), "b": f32(2, 4)}, False),
    "gap-between": ({"a": f32(2, 0), "b": f32(2, 12)}, False),
    "gap-before-the-first": ({"a": f32(2, 4)}, False),
}


def write(path: Path, header: object, *, pad: int = 0) -> Path:
    raw = json.dumps(header).encode() + b" " * pad
    tensors = header.values() if isinstance(header, dict) else []
    ends = [t["data_offsets"][1] for t in tensors
            if isinstance(t, dict) and isinstance(t.get("data_offsets"), list)]
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * max([0, *ends]))
    return path


def outcome(read: object) -> str:
    try:
        read()  # type: ignore[operator]
    except ValueError as e:
        return f"refused ({type(e).__name__})"
    return "accepted"


@pytest.mark.parametrize(("header", "accepted"), HEADERS.values(), ids=HEADERS.keys())
def test_reader_and_controller_agree(tmp_path: Path, header: object, accepted: bool) -> None:
    """Both take the header, or both refuse it with a ValueError (HeaderError)."""
    path = write(tmp_path / "m.safetensors", header)

    def worker() -> None:
        SafetensorsFile(path).close()

    expected = "accepted" if accepted else f"refused ({HeaderError.__name__})"
    assert (outcome(worker), outcome(lambda: read_shape(path))) == (expected, expected)


def test_a_header_of_30_mb_is_read_by_both(tmp_path: Path) -> None:
    """Past huggingface_hub's 25 MB (the controller's old bound) but within the format's
    100 MB: the worker reads such a file, so the controller sizes it too."""
    path = write(tmp_path / "big.safetensors", {"a": f32(2, 0)}, pad=30_000_000)
    assert outcome(lambda: SafetensorsFile(path).close()) == "accepted"
    assert read_shape(path).params == 2


@pytest.mark.parametrize(("length", "file_size", "problem"), [
    (MAX_HEADER_BYTES, None, None),
    (MAX_HEADER_BYTES + 1, None, "at most"),
    (1, None, "at least 2"),
    (100, 50, "does not fit"),
    (100, 108, None),
], ids=["the-bound", "past-the-bound", "shorter-than-braces", "past-the-file", "fills-the-file"])
def test_header_length(length: int, file_size: int | None, problem: str | None) -> None:
    """One bound, the safetensors library's own (100,000,000 bytes); a file, when its size is
    known, must hold the header."""
    prefix = length.to_bytes(8, "little")
    if problem is None:
        assert header_length(prefix, file_size=file_size) == length
    else:
        with pytest.raises(HeaderError, match=problem):
            header_length(prefix, file_size=file_size)


def test_the_parsed_header() -> None:
    """Entries in the header's order, offsets as given (from the data's start), the data's
    size and where it starts."""
    raw = json.dumps({"b": f32(3, 8), "__metadata__": {}, "a": f32(2, 0)}).encode()
    header = parse_header(raw)
    assert list(header.tensors) == ["b", "a"]
    assert (header.tensors["b"].shape, header.tensors["b"].start, header.tensors["b"].end) == (
        (3,), 8, 20)
    assert (header.data_bytes, header.data_start) == (20, 8 + len(raw))
