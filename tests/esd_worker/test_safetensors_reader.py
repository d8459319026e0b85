"""esd_worker.analysis.weights.SafetensorsFile: the worker's own reader of .safetensors files (read
per
tensor, not memory-mapped), checked against the safetensors package's loader on every dtype,
on broken files, and under concurrent reads."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from esd_worker.analysis.weights import Checkpoint, SafetensorsFile, float_dtype

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
])
def test_every_dtype_reads_as_the_safetensors_loader_reads_it(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    base = torch.randn(7, 5, 3, generator=GEN) * 4
    tensors = {"x": base.to(dtype), "row": base[0, 0].to(dtype).clone(),
               "empty": base[:0].to(dtype).clone()}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    reader = SafetensorsFile(path)
    try:
        assert sorted(reader.entries) == sorted(expected)
        for key, want in expected.items():
            got = reader.read(key)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    finally:
        reader.close()


def raw_file(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize(("header", "data", "length", "problem"), [
    pytest.param({}, b"", 10**9, "does not fit", id="length-past-the-end"),
    pytest.param([1, 2], b"", None, "not a JSON object", id="not-an-object"),
    pytest.param({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4,
                 None, "outside the file", id="truncated"),
    pytest.param({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8,
                 None, "8 bytes for shape", id="size-mismatch"),
    pytest.param({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "bad header entry",
                 id="no-offsets"),
])
def test_broken_files_are_refused_with_the_reason(
    tmp_path: Path, header: object, data: bytes, length: int | None, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        SafetensorsFile(raw_file(tmp_path / "bad.safetensors", header, data, length=length))


# Two F32 tensors of 2 elements (8 bytes each) laid out in the 16 data bytes in ways the
# format forbids: the safetensors loader requires the ranges, sorted, to tile the data
# exactly (each starts where the previous ends, the last ends at the end of the file).
@pytest.mark.parametrize(("offsets", "data"), [
    pytest.param([[0, 8], [4, 12]], 16, id="overlapping"),
    pytest.param([[0, 8], [0, 8]], 16, id="same-bytes"),
    pytest.param([[0, 8], [12, 20]], 20, id="gap-between"),
    pytest.param([[4, 12], [12, 20]], 20, id="gap-before-the-first"),
    pytest.param([[0, 8], [8, 16]], 24, id="bytes-after-the-last"),
])
def test_tensors_must_tile_the_data_exactly_as_the_official_loader_requires(
    tmp_path: Path, offsets: list[list[int]], data: int
) -> None:
    """An overlapping range would let one tensor's bytes be analysed under two names (a
    forged file passing as a model); the official loader refuses each of these layouts, so
    a file it cannot load is never marked done here."""
    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": where}
              for name, where in zip("ab", offsets, strict=True)}
    path = raw_file(tmp_path / "layout.safetensors", header, b"\0" * data)
    with pytest.raises(Exception):  # noqa: B017 (its error types vary by version)
        load_file(str(path))
    with pytest.raises(ValueError, match="data"):
        SafetensorsFile(path)


def test_a_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 9) + b"{not json" + b"\0" * 8)
    with pytest.raises(ValueError, match="not JSON"):
        SafetensorsFile(path)


def test_a_dtype_torch_cannot_hold_is_listed_and_refused_on_read(tmp_path: Path) -> None:
    header = {"x": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
              "y": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}
    reader = SafetensorsFile(raw_file(tmp_path / "f4.safetensors", header, b"\0" * 6))
    assert reader.entries["x"].dtype_name == "F4"
    with pytest.raises(ValueError, match="dtype F4"):
        reader.read("x")
    assert reader.read("y").tolist() == [0.0]
    reader.close()


def test_concurrent_reads_get_their_own_tensors(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.randn(64, 32, generator=GEN) for i in range(16)}
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    reader = SafetensorsFile(path)
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(tensors, pool.map(reader.read, tensors), strict=True))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    got["t0"].add_(1)  # a tensor of its own: writable, and the next read is unchanged
    assert torch.equal(reader.read("t0"), tensors["t0"])
    reader.close()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize(("dtype", "analysed"), [
    (torch.float16, True), (torch.bfloat16, True), (torch.float32, True),
    (torch.float64, True), (torch.int8, False), (torch.float8_e4m3fn, False),
])
def test_the_name_a_checkpoint_gives_a_dtype_says_whether_it_is_analysed(
        tmp_path: Path, fmt: str, dtype: torch.dtype, analysed: bool) -> None:
    """float_dtype reads both spellings Checkpoint.dtype gives (safetensors' codes, torch's
    names for .bin files) the same way: the memory bound, speculation and the analysis ask it."""
    tensor = torch.ones(4, 4).to(dtype)
    if fmt == "safetensors":
        save_file({"w": tensor}, str(tmp_path / "model.safetensors"))
    else:
        torch.save({"w": tensor}, tmp_path / "pytorch_model.bin")
    with Checkpoint(tmp_path) as ckpt:
        assert float_dtype(ckpt.dtype("w")) == (dtype if analysed else None)
