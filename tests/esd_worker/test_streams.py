"""One model's layers over several analysis streams (esd_worker.analysis.streams): on the CPU, with
one,
two or three "devices" (torch.device("cpu") each, one stream per entry), the worker writes the
same layers.csv and eigs.npz, bit for bit, as with one; rows stay in the model's layer order
whichever stream finishes first; the first failure stops every stream; the devices chosen
follow --parallel-gpu/--no-parallel-gpu; and a layer too big for its GPU stops the model with
exit 5, naming the layer."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from esd_worker.analysis.analyze import analyse_model_with
from esd_worker.analysis.layers import CONV2D, LINEAR, LayerMap, LayerSpec
from esd_worker.analysis.modellayers import LayerAnalysis
from esd_worker.analysis.streams import (
    GIB,
    PREFETCH,
    Streams,
    check_fits,
    choose_devices,
    layer_peak_bytes,
)
from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings
from esd_worker.core.errors import (
    DeviceError,
    GpuOutOfMemoryError,
    PermanentModelError,
    exit_code_for,
    failure_message,
)
from esd_worker.core.store.results import eigs_from_npz
from esd_worker.fetch.resolve import ResolvedModel
from tests.support.builders import make_llama, make_lora_adapter

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


class Run:
    """One in-process analysis on `streams` CPU "devices": layers.csv bytes, eigs, marker."""

    def __init__(self, model: Path, out: Path, streams: int, speculate: str = "off",
                 **settings: Any) -> None:
        marker = analyse_model_with(
            WorkerSettings(model=str(model), output=str(out), device="cpu", **settings),
            speculate=speculate, devices=[CPU] * streams,
        )
        folder = out / marker.model_key
        self.csv = (folder / "layers.csv").read_bytes()
        self.eigs = eigs_from_npz((folder / "eigs.npz").read_bytes())
        self.marker = json.loads((folder / "result.json").read_text())
        self.layers = [line.split(",")[2] for line in self.csv.decode().splitlines()[1:]]


def assert_identical(one: Run, many: Run) -> None:
    """Same table bytes, same eigenvalue arrays in the same order, bit for bit."""
    assert many.csv == one.csv
    assert list(many.eigs) == list(one.eigs)
    for name, evals in one.eigs.items():
        assert many.eigs[name].dtype == evals.dtype
        assert many.eigs[name].tobytes() == evals.tobytes(), name


@pytest.fixture(scope="module")
def uneven_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three blocks whose layers differ in size: q/o 48², k/v 24×48, gate/up 80×48, down
    48×80, lm_head 96×48: streams finish their layers at different times."""
    root = tmp_path_factory.mktemp("streams")
    return make_llama(root / "llama", hidden_size=48, intermediate_size=80, num_layers=3,
                      vocab_size=96)


@pytest.fixture(scope="module")
def one_stream(uneven_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(uneven_llama, tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("streams", [2, 3])
def test_streams_write_what_one_stream_writes(
    uneven_llama: Path, one_stream: Run, tmp_path: Path, streams: int
) -> None:
    """The layers are dealt to 2 or 3 streams (each stream's count in the marker adds up
    to every layer), the table and every eigenvalue are those of one stream."""
    many = Run(uneven_llama, tmp_path, streams)
    assert_identical(one_stream, many)
    assert many.layers == one_stream.layers and len(many.layers) == 3 * 7 + 1
    device = many.marker["device"]
    assert (device["type"], device["count"], len(device["names"])) == ("cpu", streams, streams)
    assert sum(device["layers_per_stream"]) == len(many.layers)
    assert one_stream.marker["device"]["count"] == 1
    assert one_stream.marker["device"]["layers_per_stream"] == [len(many.layers)]


def test_speculation_beside_streams(uneven_llama: Path, one_stream: Run, tmp_path: Path) -> None:
    """Spectra speculated during discovery (on the first device) and the streams' own make
    the same result as one stream without speculation."""
    many = Run(uneven_llama, tmp_path, 3, speculate="complete")
    assert_identical(one_stream, many)
    assert many.marker["timings"]["speculated_layers"] == len(many.layers)


def test_lora_merged_on_each_streams_device(uneven_llama: Path, tmp_path: Path) -> None:
    """A LoRA adapter on q_proj, v_proj and down_proj: every stream merges W + ΔW for the
    layers it takes (on its own device), and three streams write what one does; the merged
    layers really differ from the base's."""
    adapter = make_lora_adapter(uneven_llama, tmp_path / "adapter",
                                target_modules=("q_proj", "v_proj", "down_proj"))
    one = Run(adapter, tmp_path / "one", 1)
    many = Run(adapter, tmp_path / "many", 3)
    assert_identical(one, many)
    base = Run(uneven_llama, tmp_path / "base", 1)
    changed = [n for n in one.eigs if not np.array_equal(one.eigs[n], base.eigs[n])]
    assert len(changed) == many.marker["adapter"]["merged_modules"] == 9


# --- the dealing, on fake layers ------------------------------------------------------------


def fake_layers(count: int) -> list[LayerSpec]:
    return [LayerSpec(f"layer{i}", f"layer{i}.weight", LINEAR, (4, 4)) for i in range(count)]


def ready(pool: ThreadPoolExecutor, spec: LayerSpec, device: torch.device
          ) -> Future[torch.Tensor]:
    return pool.submit(torch.zeros, spec.shape)


def test_results_in_layer_order_whichever_stream_finishes_first() -> None:
    """Layer 0 takes longest (its stream is held up), the others finish before it: the
    results still come back in layer order, and all three streams took layers."""
    finished: list[str] = []
    threads: dict[str, str] = {}
    lock = threading.Lock()

    def analyse(spec: LayerSpec, tensor: torch.Tensor, device: torch.device) -> str:
        time.sleep(0.3 if spec.name == "layer0" else 0.02)
        with lock:
            finished.append(spec.name)
            threads[spec.name] = threading.current_thread().name
        return spec.name

    layers = fake_layers(12)
    streams = Streams(layers, [CPU] * 3, fetch=ready, analyse=analyse)
    assert streams.run() == [spec.name for spec in layers]
    assert finished != [spec.name for spec in layers]  # the order had to be restored
    assert len(set(threads.values())) == 3
    assert sorted(streams.layers_per_stream) == sorted(
        list(threads.values()).count(name) for name in set(threads.values())
    )


def test_an_error_in_another_stream_is_raised_in_the_caller() -> None:
    """A layer failing on the third stream's thread ends run() with that very exception."""
    error = ValueError("bad layer")

    def analyse(spec: LayerSpec, tensor: torch.Tensor, device: torch.device) -> str:
        time.sleep(0.02)
        if threading.current_thread().name == "esd-stream-2":
            raise error
        return spec.name

    streams = Streams(fake_layers(60), [CPU] * 3, fetch=ready, analyse=analyse)
    with pytest.raises(ValueError) as raised:
        streams.run()
    assert raised.value is error
    assert streams.stopping.is_set()


def test_cuda_out_of_memory_names_the_layer_and_device() -> None:
    """An allocator failure in one layer becomes GpuOutOfMemoryError (exit 5) that says
    which layer, its shape, the model and the device."""

    def analyse(spec: LayerSpec, tensor: torch.Tensor, device: torch.device) -> str:
        if spec.name == "layer3":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return spec.name

    streams = Streams(fake_layers(6), [CPU] * 2, fetch=ready, analyse=analyse, label="org/m")
    with pytest.raises(GpuOutOfMemoryError) as raised:
        streams.run()
    text = str(raised.value)
    assert "layer layer3 of org/m (4×4) on cpu: CUDA out of memory" in text
    assert exit_code_for(raised.value) == 5


# --- a failing read, through the analysis object -------------------------------------------


def model_of(layers: list[LayerSpec]) -> tuple[ResolvedModel, LayerMap]:
    model = ResolvedModel(ref="org/fake", model_id="org/fake", revision=None,
                          resolved_revision=None, directory=Path("."), source="local")
    return model, LayerMap(layers, "fallback", None)


def uneven_tensors(count: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(16 + i % 5, 12 + i % 3, generator=gen)
            for i in range(count)}


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_a_failing_read_stops_every_stream(streams: int) -> None:
    """Layer 4's read fails; reads of later layers wait until the run is stopping (so no
    stream can have computed them first). The run raises the read's error, no layer after
    4 is analysed, and no stream claims new layers once stopping: of 40 layers at most the
    ones claimed before (4 + 1, and PREFETCH + 1 per stream) were ever read."""
    count, bad = 40, 4
    tensors = uneven_tensors(count)
    layers = [LayerSpec(key.removesuffix(".weight"), key, LINEAR, tuple(t.shape))
              for key, t in tensors.items()]
    error = PermanentModelError("corrupt tensor 'layer4.weight'")
    read_keys: list[str] = []
    late_reads: list[str] = []
    stuck: list[str] = []
    job: dict[str, LayerAnalysis] = {}

    def read(key: str) -> torch.Tensor:
        index = int(key.removeprefix("layer").removesuffix(".weight"))
        stopping = job["a"].streams.stopping  # type: ignore[union-attr]
        if stopping.is_set():
            late_reads.append(key)
        read_keys.append(key)
        if index == bad:
            raise error
        if index > bad and not stopping.wait(10):
            stuck.append(key)  # the failure did not stop the run (or not in time)
        return tensors[key]

    model, layer_map = model_of(layers)
    job["a"] = LayerAnalysis(model, layer_map, read, AnalysisSettings(), [CPU] * streams, None,
                         False)
    with pytest.raises(PermanentModelError) as raised:
        job["a"].run()
    assert raised.value is error
    assert not stuck
    per_stream = job["a"].streams.layers_per_stream  # type: ignore[union-attr]
    assert sum(per_stream) <= bad
    assert len(read_keys) <= bad + 1 + streams * (PREFETCH + 1) < count
    assert len(late_reads) <= streams * PREFETCH
    time.sleep(0.05)
    assert len(read_keys) == len(set(read_keys))  # and nothing more once run() returned
    assert not any(t.name.startswith(("esd-stream", "esd-read")) for t in threading.enumerate())


# --- which devices ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "parallel", "available", "count", "expected"),
    [
        pytest.param("auto", True, True, 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"],
                     id="auto-parallel-4-gpus"),
        pytest.param("auto", False, True, 4, ["cuda:0"], id="no-parallel-gpu"),
        pytest.param("cuda", True, True, 2, ["cuda:0", "cuda:1"], id="cuda-parallel-2"),
        pytest.param("cuda", True, True, 1, ["cuda:0"], id="one-gpu"),
        pytest.param("auto", True, False, 0, ["cpu"], id="auto-without-cuda"),
        pytest.param("cpu", True, True, 8, ["cpu"], id="cpu-asked-for"),
    ],
)
def test_choose_devices(requested: str, parallel: bool, available: bool, count: int,
                        expected: list[str]) -> None:
    """Every visible GPU with --parallel-gpu (the default), the first alone with
    --no-parallel-gpu, one CPU "device" whenever the CPU is used."""
    got = choose_devices(requested, parallel, available=available, count=count)
    assert [str(d) for d in got] == expected


def test_cuda_without_cuda_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        choose_devices("cuda", True, available=False, count=0)


@pytest.mark.parametrize("parallel", [True, False])
def test_the_cli_path_on_the_cpu_uses_one_device(
    uneven_llama: Path, one_stream: Run, tmp_path: Path, parallel: bool
) -> None:
    """Without devices= the settings choose: on this CPU-only machine one stream either way,
    and the marker says so."""
    marker = analyse_model_with(
        WorkerSettings(model=str(uneven_llama), output=str(tmp_path), device="cpu",
                       parallel_gpu=parallel), speculate="off",
    )
    assert marker.device is not None and marker.device["count"] == 1
    assert (tmp_path / marker.model_key / "layers.csv").read_bytes() == one_stream.csv


# --- the memory bound ------------------------------------------------------------------------

BF16, F32 = torch.bfloat16, torch.float32
USABLE_24 = int(24 * GIB - GIB - 0.05 * 24 * GIB)  # streams.device_capacity of a 24 GiB GPU
USABLE_8 = int(8 * GIB - GIB - 0.05 * 8 * GIB)


@pytest.mark.parametrize(
    ("shape", "precision", "stored", "fits_24", "fits_8"),
    [
        pytest.param((4096, 4096), "float32", BF16, True, True, id="7B-attention"),
        pytest.param((11008, 4096), "float32", BF16, True, True, id="7B-mlp"),
        pytest.param((32000, 4096), "float32", BF16, True, True, id="7B-lm_head"),
        pytest.param((8192, 8192), "float32", BF16, True, True, id="8192-f32"),
        pytest.param((8192, 8192), "float64", BF16, True, True, id="8192-f64"),
        pytest.param((16384, 16384), "float32", BF16, True, False, id="16384-f32"),
        pytest.param((16384, 16384), "float32", F32, True, False, id="16384-f32-stored"),
        pytest.param((16384, 16384), "float64", BF16, True, False, id="16384-f64"),
        pytest.param((53248, 16384), "float32", BF16, True, False, id="405B-mlp-f32"),
        pytest.param((16384, 53248), "float32", BF16, True, False, id="405B-down-f32"),
        pytest.param((53248, 16384), "float64", BF16, True, False, id="405B-mlp-f64"),
    ],
)
def test_layer_peak_bytes(shape: tuple[int, int], precision: str, stored: torch.dtype,
                          fits_24: bool, fits_8: bool) -> None:
    """The estimate holds at least what is surely alive while eigvalsh runs (the weight in
    the work dtype, its Gram matrix, the float64 copy eigvalsh is given and eigvalsh's own
    copy of it), at least the stored and the converted weight together, and at most that
    plus two more float64 Gram matrices (workspace, eigenvalues); a 4096-wide layer stays
    under 2 GiB (issue 2); the 16384² float32 and the 405B MLP layer fit a 24 GiB GPU, not
    8 GiB (the float64 solve), nor does float64 at 16384."""
    work = 8 if precision == "float64" else 4
    m, n = shape
    weight, gram, gram64 = m * n * work, min(m, n) ** 2 * work, min(m, n) ** 2 * 8
    load = weight + (m * n * stored.itemsize if stored.itemsize != work else 0)
    need = layer_peak_bytes(shape, LINEAR, precision, stored)
    converted = gram64 if work == 4 else 0
    assert need >= max(weight + gram + converted + gram64, load)
    assert need <= max(weight + gram + converted + 3 * gram64, load)
    if max(shape) <= 32000 and min(shape) == 4096:
        assert need <= 2 * GIB
    assert (need <= USABLE_24, need <= USABLE_8) == (fits_24, fits_8)


def test_conv2d_peak_counts_its_matrices() -> None:
    """A 3×3 Conv2d of 512 channels: 9 Gram matrices of 512² and the permuted, scaled copy
    of the weight beside it: more than a Linear of the same number of values."""
    conv = layer_peak_bytes((512, 512, 3, 3), CONV2D, "float32", F32)
    assert conv >= 2 * 512 * 512 * 9 * 4 + 2 * 9 * 512 * 512 * 4
    assert conv > layer_peak_bytes((512, 512 * 9), LINEAR, "float32", F32)


def test_check_fits_names_the_layer_and_exits_5() -> None:
    """The 405B MLP layer in float64 on an 8 GiB GPU: one line naming the layer, the model,
    the shape, what it needs and what the device has; exit 5 (GpuOutOfMemoryError)."""
    with pytest.raises(GpuOutOfMemoryError) as raised:
        check_fits("model.layers.0.mlp.up_proj", (53248, 16384), LINEAR, "float64", BF16,
                   torch.device("cuda:1"), USABLE_8, model="org/big")
    text = failure_message(raised.value, "org/big")
    assert text.startswith("layer model.layers.0.mlp.up_proj of org/big (53248×16384 bfloat16)"
                           " needs ~")
    assert "GiB on cuda:1, which has 6.6 GiB usable" in text
    assert "--precision float32" in text and "\n" not in text
    assert exit_code_for(raised.value) == 5
    check_fits("model.layers.0.mlp.up_proj", (53248, 16384), LINEAR, "float32", BF16,
               torch.device("cuda:0"), USABLE_24)  # fits: nothing raised


def test_a_layer_too_big_for_its_device_fails_the_model(
    uneven_llama: Path, tmp_path: Path
) -> None:
    """A simulated device whose usable memory is one byte short of lm_head's need (the
    largest layer, analysed last): the model fails with exit 5 naming lm_head, and nothing
    is written."""
    lm_head = layer_peak_bytes((96, 48), LINEAR, "float32", F32)
    others = layer_peak_bytes((80, 48), LINEAR, "float32", F32)
    assert others < lm_head
    with pytest.raises(GpuOutOfMemoryError) as raised:
        analyse_model_with(
            WorkerSettings(model=str(uneven_llama), output=str(tmp_path), device="cpu"),
            speculate="off", devices=[CPU] * 2, capacity=lambda device: lm_head - 1,
        )
    assert "layer lm_head of " in str(raised.value) and "(96×48 float32)" in str(raised.value)
    assert exit_code_for(raised.value) == 5
    assert not list(tmp_path.rglob("result.json"))


@pytest.mark.parametrize("up_front", [True, False])
def test_the_check_runs_up_front_and_again_before_each_layer(up_front: bool) -> None:
    """Layer 3 of 6 does not fit. With the checkpoint's dtypes known, the check over every
    layer fails the run before any stream starts; without them, the stream's own check
    before the layer stops the run there, after the three smaller layers."""
    tensors = {f"layer{i}.weight": torch.ones(16, 16) for i in range(6)}
    tensors["layer3.weight"] = torch.ones(64, 64)
    layers = [LayerSpec(key.removesuffix(".weight"), key, LINEAR, tuple(t.shape))
              for key, t in tensors.items()]
    model, layer_map = model_of(layers)
    capacity = layer_peak_bytes((64, 64), LINEAR, "float32", F32) - 1
    job = LayerAnalysis(model, layer_map, tensors.__getitem__, AnalysisSettings(), [CPU], None,
                    False, capacity=lambda device: capacity,
                    stored_dtype=(lambda key: F32) if up_front else None)
    with pytest.raises(GpuOutOfMemoryError, match=r"layer layer3 of org/fake \(64×64 float32\)"):
        job.run()
    if up_front:
        assert job.streams is None
    else:
        assert job.streams is not None and job.streams.layers_per_stream == [3]


# --- the benchmark stays runnable ------------------------------------------------------------


def load_bench() -> ModuleType:
    path = REPO / "benchmarks" / "bench_multi_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_multi_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_multi_gpu_tiny_cpu_mode(tmp_path: Path) -> None:
    """benchmarks/bench_multi_gpu.py on the CPU at toy size: one stream and two, identical
    outputs, a scaling figure, kernel timings; the JSON says so."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    code = bench.main(["--device", "cpu", "--hidden", "64", "--blocks", "2", "--streams", "2",
                       "--kernel-sizes", "64", "--out", str(tmp_path / "ckpt"),
                       "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["identical"] is True
    assert [run["streams"] for run in report["runs"]] == [1, 2]
    assert report["runs"][1]["layers_per_stream"] and sum(
        report["runs"][1]["layers_per_stream"]) == report["layers"] == 2 * 7 + 1
    assert report["scaling"] > 0
    assert {"gram_64", "eigvalsh_f32_64", "eigvalsh_f64_64"} <= set(report["kernels_s"])
