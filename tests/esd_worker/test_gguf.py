"""esd_worker.analysis.gguf: a GGUF file read as a model's tensors, checked tensor by tensor
against the gguf package's own reader and dequantizer, on files its GGUFWriter writes here
(F32, F16, BF16, Q8_0 and Q4_0 quantized by gguf.quants.quantize, a Q6_K K-quant block built
byte by byte: the package cannot quantize K-quants, only dequantize them); and a GGUF-only
folder analysed end to end (spectral norms of the dequantized weights)."""

from __future__ import annotations

import math
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from esd_worker.analysis.checkpoints import combined, open_components
from esd_worker.analysis.gguf import GgufTensors
from esd_worker.core.errors import PermanentModelError
from tests.support.builders import run_analysis

RNG_SEED = 41


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q6_K bytes of a (rows, cols) tensor: random quants and scales, a finite d per block
    (ql[128], qh[64], scales[16] int8, d f16: 210 bytes a block of 256)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full(len(blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * 210)


def write_gguf(path: Path, *, split_max_tensors: int = 0, refused: bool = True,
               experts: bool = True) -> dict[str, Q]:
    """A tiny llama-shaped GGUF file (or split set); returns tensor name -> its GGML type.
    experts: with a 3-D stack of experts (llama.cpp's blk.N.ffn_gate_exps)."""
    rng = np.random.default_rng(RNG_SEED)
    writer = GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    types: dict[str, Q] = {}

    def add(name: str, data: np.ndarray, qtype: Q) -> None:
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
        types[name] = qtype

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    add("blk.0.attn_norm.weight", normal(64), Q.F32)
    add("blk.0.attn_q.weight", normal(48, 64), Q.F32)
    add("blk.0.attn_k.weight", normal(32, 64).astype(np.float16), Q.F16)
    add("blk.0.attn_v.weight", quantize(normal(32, 64), Q.BF16), Q.BF16)
    add("blk.0.attn_output.weight", quantize(normal(64, 64), Q.Q8_0), Q.Q8_0)
    add("blk.0.ffn_up.weight", quantize(normal(96, 64), Q.Q4_0), Q.Q4_0)
    add("blk.0.ffn_down.weight", q6_k_blocks(rng, 64, 256), Q.Q6_K)
    if experts:
        add("blk.0.ffn_gate_exps.weight", quantize(normal(4, 16, 64), Q.Q8_0), Q.Q8_0)
    if refused:  # Q8_1: a block type gguf 0.19 cannot dequantize
        add("blk.0.ffn_gate.weight", rng.integers(0, 255, (16, 80), dtype=np.uint8), Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def reference(path: Path) -> dict[str, tuple[Q, tuple[int, ...], np.ndarray | None]]:
    """gguf's own view of each tensor: type, shape in torch order, float32 values (None: gguf
    cannot dequantize it)."""
    out: dict[str, tuple[Q, tuple[int, ...], np.ndarray | None]] = {}
    for tensor in GGUFReader(path).tensors:
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        except NotImplementedError:
            values = None
        out[tensor.name] = (tensor.tensor_type, shape,
                            None if values is None else values.reshape(shape))
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf"
    write_gguf(path)
    return path


def test_every_tensor_as_gguf_reads_it(gguf_file: Path) -> None:
    """Names in file order, torch-order shapes, float types as stored, quantized ones
    dequantized to F32 exactly as gguf.quants.dequantize does; scheme names the block type."""
    expected = reference(gguf_file)
    with GgufTensors([gguf_file]) as tensors:
        assert tensors.keys() == list(expected)
        for key, (qtype, shape, values) in expected.items():
            assert tensors.shape(key) == shape, key
            assert key in tensors
            if qtype in (Q.F32, Q.F16, Q.BF16):
                assert tensors.dtype(key) == qtype.name
                assert tensors.scheme(key) is None and not tensors.in_memory(key)
            else:
                assert tensors.dtype(key) == "F32"
                assert tensors.scheme(key) == f"gguf-{qtype.name}"
                assert tensors.in_memory(key)
            if values is None:
                assert tensors.refusal(key) == ("the gguf package cannot dequantize Q8_1 "
                                                "blocks (a newer gguf may)")
                with pytest.raises(PermanentModelError, match="cannot dequantize Q8_1"):
                    tensors.read(key)
                continue
            assert tensors.refusal(key) is None
            read = tensors.read(key)
            assert tuple(read.shape) == shape
            np.testing.assert_array_equal(read.float().numpy(), values, err_msg=key)
            if qtype == Q.BF16:
                assert read.dtype == torch.bfloat16
            if qtype == Q.F16:
                assert read.dtype == torch.float16
        assert tensors.folded() == {}


def test_stored_bytes_and_reads_into_a_buffer(gguf_file: Path) -> None:
    reader = {t.name: t for t in GGUFReader(gguf_file).tensors}
    with GgufTensors([gguf_file]) as tensors:
        buffer = torch.empty(1 << 16, dtype=torch.uint8)
        for key in tensors.keys():  # noqa: SIM118 - not a Mapping
            assert tensors.nbytes(key) == int(reader[key].n_bytes)
            if tensors.refusal(key) is None:
                into = tensors.read_into(key, buffer)
                assert torch.equal(into, tensors.read(key)), key


def test_one_row_of_a_stack(gguf_file: Path) -> None:
    """read_row dequantizes one expert of a stacked tensor: the same as the whole one's row."""
    with GgufTensors([gguf_file]) as tensors:
        key = "blk.0.ffn_gate_exps.weight"
        assert tensors.shape(key) == (4, 16, 64)
        whole = tensors.read(key)
        for i in range(4):
            assert torch.equal(tensors.read_row(key, i), whole[i])
        with pytest.raises(PermanentModelError, match="no row 4"):
            tensors.read_row(key, 4)


def test_a_split_set_is_one_model(tmp_path: Path) -> None:
    """gguf's own split (x-00001-of-0000N.gguf) read as one: every tensor once, in order;
    the folder's components are that one set, under no prefix."""
    whole = tmp_path / "whole" / "m-F32.gguf"
    whole.parent.mkdir()
    write_gguf(whole)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_gguf(split_dir / "m-F32.gguf", split_max_tensors=4)
    parts = sorted(p.name for p in split_dir.iterdir())
    assert parts == ["m-F32-00001-of-00003.gguf", "m-F32-00002-of-00003.gguf",
                     "m-F32-00003-of-00003.gguf"]
    components = open_components(split_dir)
    assert [c.prefix for c in components] == [""]
    with closing(combined(components)) as split, GgufTensors([whole]) as one:
        assert split.keys() == one.keys()
        for key in one.keys():  # noqa: SIM118 - not a Mapping
            if one.refusal(key) is None:
                assert torch.equal(split.read(key), one.read(key))
    (split_dir / parts[1]).unlink()
    # The rule passes over an incomplete split when there is another set; alone, it is read
    # and refused for the missing part.
    with pytest.raises(PermanentModelError, match="incomplete"):
        open_components(split_dir)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "m-F16.gguf"
    bad.write_bytes(b"GGUX" + b"\0" * 60)
    with pytest.raises(PermanentModelError, match="corrupt or unsupported GGUF file"):
        open_components(tmp_path)


def svd_norm(values: np.ndarray) -> float:
    """The spectral_norm the analysis reports: the largest eigenvalue of W Wᵀ, in float64."""
    s = torch.linalg.svdvals(torch.from_numpy(values.astype(np.float64)))
    return float(s.max()) ** 2


def test_a_gguf_folder_analysed(tmp_path: Path) -> None:
    """A folder with only GGUF files: the highest-precision file is analysed (the Q4_0 one
    beside it is not read), layers named as GGUF names them, each spectral norm that of the
    weight gguf dequantizes, its scheme recorded."""
    folder = tmp_path / "tiny-gguf"
    folder.mkdir()
    write_gguf(folder / "tiny-Q8_0.gguf", refused=False)
    (folder / "tiny-Q4_0.gguf").write_bytes(b"not read: a lower precision than Q8_0")
    (folder / "mmproj-tiny-f32.gguf").write_bytes(b"never read: a vision projector")
    expected = reference(folder / "tiny-Q8_0.gguf")
    result = run_analysis(folder, tmp_path / "out", precision="float64")
    layers = {"blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_output",
              "blk.0.ffn_up", "blk.0.ffn_down"}
    experts = {f"blk.0.ffn_gate_exps.{i}" for i in range(4)}  # llama.cpp's expert stack
    assert set(result.layers) == layers | experts
    stack = expected["blk.0.ffn_gate_exps.weight"][2]
    assert stack is not None
    for i in range(4):
        row = result.row(f"blk.0.ffn_gate_exps.{i}")
        assert row["layer_type"] == "Expert" and row["quantization"] == "gguf-Q8_0"
        assert math.isclose(float(row["spectral_norm"]), svd_norm(stack[i]), rel_tol=1e-6)
    for name in layers:
        row = result.row(name)
        qtype, _, values = expected[f"{name}.weight"]
        assert values is not None
        assert math.isclose(float(row["spectral_norm"]), svd_norm(values), rel_tol=1e-6), name
        quantized = qtype not in (Q.F32, Q.F16, Q.BF16)
        assert row.get("quantization", "") == (f"gguf-{qtype.name}" if quantized else "")
