"""Tests of controller.weights.weightmeta: weight shapes before download, and the GPU count from
them.

Safetensors files are written here, by hand (a header that claims big tensors with no data
behind it: only the header is ever read) and once with the safetensors package (the real
format). The hub is tests.support.hubserver's double over HTTP: its model info (with the
`safetensors` parameter count the hub reports) and Range requests through resolve and its
CDN redirect; waits go through an injected clock (FakeTime), so the rate limit is checked by
the waits asked for.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from controller.gpu.counts import GpuCounts
from controller.gpu.gpurule import GpuRule
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import (
    FIRST_READ_BYTES,
    ShapeFinder,
    ShapeStats,
    WeightShape,
    header_shape,
    local_shape,
    read_shape,
)
from esd_worker.core.estimate import width_from_params
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import parse_ref
from esd_worker.core.models.safetensors import HeaderError, parse_header
from tests.controller.test_sizing import FakeTime, clean_env  # noqa: F401  (autouse fixture)
from tests.support.hubserver import HubServer

B = 10**9


def write_st(path: Path, tensors: Mapping[str, tuple[str, list[int]]], *,
             pad_to: int = 0) -> Path:
    """A safetensors file whose header lists `tensors` (name -> (dtype, shape)) with their
    data offsets, and no data (or `pad_to` bytes of header padding, as writers align it)."""
    size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * max(0, pad_to - len(raw))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    return path


def llama_layers(hidden: int, inter: int, layers: range, *, vocab: int = 0,
                 kv: int = 0) -> dict[str, tuple[str, list[int]]]:
    """A Llama-like checkpoint's tensors (BF16): q, k, v, o, gate, up, down, norms."""
    kv = kv or hidden
    out: dict[str, tuple[str, list[int]]] = {}
    if vocab:
        out["model.embed_tokens.weight"] = ("BF16", [vocab, hidden])
    for i in layers:
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": ("BF16", [hidden, hidden]),
                p + "self_attn.k_proj.weight": ("BF16", [kv, hidden]),
                p + "self_attn.v_proj.weight": ("BF16", [kv, hidden]),
                p + "self_attn.o_proj.weight": ("BF16", [hidden, hidden]),
                p + "mlp.gate_proj.weight": ("BF16", [inter, hidden]),
                p + "mlp.up_proj.weight": ("BF16", [inter, hidden]),
                p + "mlp.down_proj.weight": ("BF16", [hidden, inter]),
                p + "input_layernorm.weight": ("BF16", [hidden])}
    return out


def count(tensors: Mapping[str, tuple[str, list[int]]]) -> int:
    total = 0
    for _, shape in tensors.values():
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total


def make_row(ref: str, relation: str = "", source: str | None = None, line: int = 0,
             **metadata: str) -> ModelRow:
    model_id, revision, problem = parse_ref(ref)
    assert problem is None, problem
    return ModelRow(model_id, revision, relation, source, line=line, metadata=metadata)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


_org = iter(range(10**6))


@pytest.fixture
def org() -> str:
    return f"w{next(_org)}"


def make_finder(hub: HubServer | None, clock: FakeTime, *, rule: GpuRule | None = None,
                **kwargs: Any) -> ShapeFinder:
    options: dict[str, Any] = dict(endpoint=hub.url if hub else "http://127.0.0.1:9",
                                   offline=hub is None, rate_per_s=1000.0, clock=clock.clock,
                                   sleep=clock.sleep)
    return ShapeFinder(Sizer(**(options | kwargs)), rule or GpuRule())


def hub_calls(hub: HubServer, org: str, at_least: int = 0) -> list[tuple[str, str, int]]:
    """(kind, file, status) of the double's requests about `org`'s repos, in arrival order,
    once at least `at_least` are logged (it logs a request after answering it)."""
    deadline = time.monotonic() + 10
    while True:
        calls = sorted((r for r in hub.requests if (r.repo or "").startswith(f"{org}/")),
                       key=lambda r: r.started)
        if len(calls) >= at_least or time.monotonic() > deadline:
            return [(r.kind, r.file or "", r.status) for r in calls]
        time.sleep(0.01)


# --- headers --------------------------------------------------------------------------------

HEADER_CASES = {
    "matrix-smaller-side": ({"w": ("F32", [300, 100]), "b": ("F32", [300])}, 30300, 100),
    "conv-out-by-in": ({"conv": ("F16", [64, 3, 7, 7]), "fc": ("F16", [10, 64])}, 10048, 10),
    "3d-not-a-matrix": ({"experts": ("BF16", [8, 512, 512]), "w": ("BF16", [16, 32])},
                        8 * 512 * 512 + 512, 16),
    "only-vectors": ({"norm": ("F32", [4096])}, 4096, 0),
    "empty-dim": ({"w": ("F32", [0, 10])}, 0, 0),
}


@pytest.mark.parametrize(("tensors", "params", "width"), HEADER_CASES.values(),
                         ids=HEADER_CASES.keys())
def test_header_shape(tmp_path: Path, tensors: dict[str, tuple[str, list[int]]],
                      params: int, width: int) -> None:
    """Params count every tensor; width is the largest smaller side among the 2-D weights and
    the out x in of the 4-D ones (the worker's matrices), never a 1-D or 3-D tensor's."""
    shape = read_shape(write_st(tmp_path / "m.safetensors", tensors))
    assert (shape.params, shape.width) == (params, width)


def test_a_file_written_by_the_safetensors_package_is_read(tmp_path: Path) -> None:
    save_file({"a": np.zeros((6, 4), np.float32), "b": np.zeros((5,), np.float16)},
              str(tmp_path / "m.safetensors"))
    shape = read_shape(tmp_path / "m.safetensors")
    assert (shape.params, shape.width, shape.data_bytes) == (29, 4, 6 * 4 * 4 + 5 * 2)


def framed(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw


BAD_HEADERS = {
    "empty-file": b"",
    "short-length": b"\x05\x00",
    "length-past-the-end": (1000).to_bytes(8, "little") + b"{}",
    "huge-length": (10**12).to_bytes(8, "little") + b"{}",
    "not-json": (4).to_bytes(8, "little") + b"\xff\xfe{{",
    "a-list": (2).to_bytes(8, "little") + b"[]",
    "shape-of-strings": framed({"w": {"dtype": "F32", "shape": ["a", 2]}}),
    "tensor-not-an-object": framed({"w": [3, 2]}),
}


@pytest.mark.parametrize("data", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_a_bad_header_is_a_header_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "m.safetensors").write_bytes(data)
    with pytest.raises(HeaderError):
        read_shape(tmp_path / "m.safetensors")


def test_parse_header_skips_the_metadata() -> None:
    raw = json.dumps({"__metadata__": {"format": "pt"},
                      "w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]}})
    assert header_shape(parse_header(raw.encode())).params == 6


# --- local directories and columns ----------------------------------------------------------


def test_a_sharded_local_checkpoint_sums_its_files(tmp_path: Path) -> None:
    """Every shard's header is read (the index names them; weight_files finds them): P sums,
    width is the largest; the tensor data is never there."""
    first = llama_layers(8192, 28672, range(0, 2), vocab=128256, kv=1024)
    second = llama_layers(8192, 28672, range(2, 4), kv=1024)
    write_st(tmp_path / "model-00001-of-00002.safetensors", first)
    write_st(tmp_path / "model-00002-of-00002.safetensors", second)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "consolidated.safetensors").write_bytes(b"not read")
    shape = local_shape(tmp_path)
    assert shape == WeightShape(count(first) + count(second), 8192, "local")


def test_a_local_bin_checkpoint_is_estimated_from_its_bytes(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 2000)
    assert local_shape(tmp_path) == WeightShape(1000, width_from_params(1000), "local",
                                                width_inferred=True)


COLUMN_CASES = {
    "both": ({"num_params": "405e9", "matrix_dim": "16384"},
             WeightShape(405 * B, 16384, "column")),
    "suffix": ({"Num-Params": " 70B "}, WeightShape(70 * B, width_from_params(70 * B),
                                                      "column", width_inferred=True)),
    "plain": ({"num_params": "1500000", "matrix_dim": "512"}, WeightShape(1_500_000, 512)),
    "trillion": ({"num_params": "1.5T", "matrix_dim": "16k"},
                 WeightShape(1_500 * B, 16_000, "column")),
}


@pytest.mark.parametrize(("metadata", "expected"), COLUMN_CASES.values(),
                         ids=COLUMN_CASES.keys())
def test_columns_need_no_lookup(hub: HubServer, org: str, metadata: dict[str, str],
                                expected: WeightShape) -> None:
    finder = make_finder(hub, FakeTime())
    row = make_row(f"{org}/model", **metadata)
    assert not finder.needs_hub(row)
    assert finder.shape(row) == expected
    assert hub_calls(hub, org) == []


def test_a_bad_column_falls_back_to_a_lookup(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    write_st(directory / "model.safetensors", {"w": ("F32", [10, 20])})
    finder = make_finder(None, FakeTime())
    shape = finder.shape(make_row(str(directory), num_params="lots"))
    assert shape == WeightShape(200, 10, "local")


BAD_COUNTS = {
    "nan": "nan", "inf": "inf", "1e999": "1e999", "negative": "-5", "zero": "0",
    "words": "lots", "past-any-model": "1e30", "400-digits": "9" * 400,
}


@pytest.mark.parametrize("cell", BAD_COUNTS.values(), ids=BAD_COUNTS.keys())
@pytest.mark.parametrize("column", ["num_params", "matrix_dim"])
def test_a_bad_count_cell_is_unknown_and_said_once(
    cell: str, column: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """No count from 1 to 1000T parameters (10 million for a matrix's side): the shape is as
    if the cell were empty (no num_params here: unknown, offline), and the column is warned
    of once for three rows, naming the first one's line. Before: silently unknown."""
    finder = make_finder(None, FakeTime())
    rows = [make_row(f"org/m{i}", line=i + 2, **{column: cell}) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="controller"):
        assert [finder.shape(r) for r in rows] == [None] * 3
    (warning,) = [r.getMessage() for r in caplog.records if column in r.getMessage()]
    assert warning.startswith(f"line 2: {column} '{cell[:20]}")


def test_a_bad_width_beside_good_parameters_is_inferred() -> None:
    """num_params alone decides; a bad matrix_dim is as if absent: the width is inferred."""
    shape = make_finder(None, FakeTime()).shape(
        make_row("org/m", num_params="7B", matrix_dim="1e999"))
    assert shape == WeightShape(7 * B, width_from_params(7 * B), "column", width_inferred=True)


def test_a_truncated_local_header_is_unknown_and_one_gpu(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cut-off download or garbage: no crash, one warning, the model gets one GPU and is
    counted as unknown."""
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b'{"w":')
    counts = GpuCounts(GpuRule(), make_finder(None, FakeTime()), cap=8)
    with caplog.at_level(logging.WARNING, logger="controller.weights.weightmeta"):
        assert counts(make_row(str(directory))) == 1
    assert "cannot read its weights' shape" in caplog.text
    assert counts.stats == ShapeStats(unknown=1)


def test_an_adapter_costs_what_its_base_costs(tmp_path: Path) -> None:
    """The worker merges the adapter into its base: the base's shape decides, found from
    source_model, from the listed base row, or from a local adapter's adapter_config.json."""
    base = tmp_path / "base"
    write_st(base / "model.safetensors", {"w": ("BF16", [4096, 11008])})
    adapter = tmp_path / "adapter"
    write_st(adapter / "adapter_model.safetensors", {"lora_A": ("F32", [8, 4096])})
    finder = make_finder(None, FakeTime())
    expected = WeightShape(4096 * 11008, 4096, "local")
    assert finder.shape(make_row(str(adapter), "lora", str(base))) == expected
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": str(base)}))
    assert finder.shape(make_row(str(adapter), "lora")) == expected
    listed = make_row("org/base", num_params="405e9", matrix_dim="16384")
    shape = finder.shape(make_row("org/lora", "lora", "org/base"), {listed.key: listed}.get)
    assert shape == WeightShape(405 * B, 16384, "column")
    assert finder.shape(make_row("org/lora", "lora")) is None  # a hub adapter, base unknown


# --- the hub ----------------------------------------------------------------------------------


def add_repo(hub: HubServer, root: Path, repo: str,
             files: Mapping[str, Mapping[str, tuple[str, list[int]]]], **pad: int) -> None:
    for name, tensors in files.items():
        write_st(root / repo / name, tensors, pad_to=pad.get("pad_to", 0))
    hub.add_repo(repo, root / repo)


def test_a_small_hub_model_costs_one_lookup(hub: HubServer, org: str, tmp_path: Path) -> None:
    """The model info's parameter count says 1 GPU whatever the width: no header read."""
    tensors = llama_layers(4096, 11008, range(2))
    add_repo(hub, tmp_path, f"{org}/small", {"model.safetensors": tensors})
    finder = make_finder(hub, FakeTime())
    shape = finder.shape(make_row(f"{org}/small"))
    assert shape == WeightShape(count(tensors), width_from_params(count(tensors)), "hub",
                                width_inferred=True)
    assert hub_calls(hub, org) == [("api", "", 200)]


def test_a_big_hub_model_reads_one_header_by_range(hub: HubServer, org: str,
                                                   tmp_path: Path) -> None:
    """A 405B-like sharded repo: the count comes from the model info, the width from the
    first shard's header, fetched through resolve (302 to the CDN) with a Range of the first
    100 kB; the other shard is never touched."""
    first = llama_layers(16384, 53248, range(0, 60), vocab=128256, kv=1024)
    second = llama_layers(16384, 53248, range(60, 126), kv=1024)
    add_repo(hub, tmp_path, f"{org}/big", {"model-00001-of-00002.safetensors": first,
                                           "model-00002-of-00002.safetensors": second})
    clock = FakeTime()
    finder = make_finder(hub, clock, rate_per_s=2.0)
    shape = finder.shape(make_row(f"{org}/big"))
    assert shape == WeightShape(count(first) + count(second), 16384, "hub")
    shard = "model-00001-of-00002.safetensors"
    assert hub_calls(hub, org, 3) == [("api", "", 200), ("file", shard, 302),
                                      ("cdn", shard, 206)]
    assert clock.sleeps == [0.5]  # 2 requests a second: the header waited for its turn
    assert GpuCounts(GpuRule(), finder, cap=8)(make_row(f"{org}/big")) == 4
    assert len(hub_calls(hub, org)) == 3  # memoised: asking again costs nothing


def test_a_header_longer_than_the_first_read_takes_a_second_range(
        hub: HubServer, org: str, tmp_path: Path) -> None:
    tensors = llama_layers(16384, 53248, range(126), kv=1024)
    add_repo(hub, tmp_path, f"{org}/long", {"model.safetensors": tensors},
             pad_to=FIRST_READ_BYTES + 5000)
    finder = make_finder(hub, FakeTime())
    assert finder.shape(make_row(f"{org}/long")) == WeightShape(count(tensors), 16384, "hub")
    cdn = [c for c in hub_calls(hub, org, 5) if c[0] == "cdn"]
    assert cdn == [("cdn", "model.safetensors", 206)] * 2


def test_a_failed_header_read_falls_back_to_the_inferred_width(
        hub: HubServer, org: str, tmp_path: Path) -> None:
    """The count from the model info stands and the width is inferred: the big model still
    gets several GPUs; the header read is retried like any lookup, then given up."""
    tensors = llama_layers(16384, 53248, range(126), kv=1024)
    add_repo(hub, tmp_path, f"{org}/flaky", {"model.safetensors": tensors})
    hub.fail(f"{org}/flaky", 503, on="model.safetensors", times=None)
    clock = FakeTime()
    counts = GpuCounts(GpuRule(), make_finder(hub, clock), cap=8)
    shape = counts.finder.shape(make_row(f"{org}/flaky"))
    assert shape == WeightShape(count(tensors), width_from_params(count(tensors)), "hub",
                                width_inferred=True)
    assert counts(make_row(f"{org}/flaky")) == 4
    assert [c for c in hub_calls(hub, org, 5) if c[0] == "file"] == [
        ("file", "model.safetensors", 503)] * 4
    backoff = [wait for wait in clock.sleeps if wait > 0.01]  # not the rate limit's 1 ms
    assert backoff == [1.0, 2.0, 4.0]  # the Sizer's backoff between attempts


def test_offline_makes_no_request_and_the_model_gets_one_gpu(
        hub: HubServer, org: str, tmp_path: Path) -> None:
    add_repo(hub, tmp_path, f"{org}/big", {
        "model.safetensors": llama_layers(16384, 53248, range(126), kv=1024)})
    counts = GpuCounts(GpuRule(), make_finder(hub, FakeTime(), offline=True), cap=8)
    row = make_row(f"{org}/big")
    assert not counts.finder.needs_hub(row)
    assert counts(row) == 1
    assert counts.stats == ShapeStats(unknown=1)
    assert hub_calls(hub, org) == []


def test_the_lookup_limit_covers_header_reads(hub: HubServer, org: str,
                                              tmp_path: Path) -> None:
    """One lookup allowed: the model info is made, the header read is not; the width is then
    inferred, and a second model gets no lookup at all (unknown: 1 GPU)."""
    for name in ("a", "b"):
        add_repo(hub, tmp_path, f"{org}/{name}", {
            "model.safetensors": llama_layers(16384, 53248, range(126), kv=1024)})
    counts = GpuCounts(GpuRule(), make_finder(hub, FakeTime(), lookup_limit=1), cap=8)
    shape_a = counts.finder.shape(make_row(f"{org}/a"))
    assert shape_a is not None and shape_a.width_inferred
    assert counts(make_row(f"{org}/b")) == 1
    assert hub_calls(hub, org) == [("api", "", 200)]
