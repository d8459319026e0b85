"""Weights staged through reusable host buffers (esd_worker.analysis.staging), played on the
CPU: the GPU's page-locked slots and copy stream become plain slots and the buffer itself.
A checkpoint reads a tensor into a slot exactly as it reads it alone; the analysis through
the slots gives the rows and eigenvalues of the plain path, bit for bit, on one stream and on
three; the slots bound what is read ahead (a read waits for a free one, with a deadline), and
a run that stops frees every slot it held."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from esd_worker.analysis.metamodel import discover_layers
from esd_worker.analysis.modellayers import LayerAnalysis
from esd_worker.analysis.staging import BufferPool, Staged, stage, take
from esd_worker.analysis.streams import PREFETCH
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.errors import PermanentModelError, WorkerError
from esd_worker.fetch.resolve import ResolvedModel
from tests.support.builders import make_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("bf16") / "llama", hidden_size=48,
                      intermediate_size=96, num_layers=3, dtype=torch.bfloat16)


# -- the pool ----------------------------------------------------------------------------------


def test_a_slot_grows_to_fit_and_the_nearest_in_size_is_reused() -> None:
    pool = BufferPool(2, pinned=False)
    big = pool.acquire(3 << 20)
    small = pool.acquire(1000)
    assert big.numel() >= 3 << 20 and small.numel() >= 1000
    assert pool.allocated_bytes == big.numel() + small.numel()
    pool.release(big)
    pool.release(small)
    assert pool.acquire(500).data_ptr() == small.data_ptr()  # the small one fits: no growth
    assert pool.acquire(2 << 20).data_ptr() == big.data_ptr()
    assert pool.allocated_bytes == big.numel() + small.numel()


def test_a_read_waits_for_a_free_slot_and_gives_up_at_its_deadline() -> None:
    pool = BufferPool(1, pinned=False, wait_s=0.3)
    held = pool.acquire(10)
    t = time.monotonic()
    with pytest.raises(WorkerError, match="no host buffer freed in 0s"):
        pool.acquire(10)
    assert 0.25 <= time.monotonic() - t < 5
    threading.Timer(0.1, pool.release, (held,)).start()
    pool.wait_s = 10
    assert pool.acquire(10).data_ptr() == held.data_ptr()


# -- reading into a slot -------------------------------------------------------------------------


def test_read_into_gives_the_tensor_read_gives(bf16_llama: Path) -> None:
    with Checkpoint(bf16_llama) as ckpt:
        pool = BufferPool(1, pinned=False)
        for key in ckpt.keys():  # noqa: SIM118 - Checkpoint is not a Mapping
            buffer = pool.acquire(ckpt.nbytes(key))
            got = ckpt.read_into(key, buffer)
            assert got.data_ptr() == buffer.data_ptr() and not ckpt.in_memory(key)
            assert torch.equal(got, ckpt.read(key)) and got.dtype == torch.bfloat16
            pool.release(buffer)
        key = ckpt.keys()[0]
        with pytest.raises(PermanentModelError, match="cannot hold"):
            ckpt.read_into(key, torch.empty(ckpt.nbytes(key) - 1, dtype=torch.uint8))


def test_a_checkpoint_held_in_memory_is_read_as_before(tmp_path: Path) -> None:
    """A .bin checkpoint holds its tensors: stage hands them over and keeps no slot."""
    folder = make_llama(tmp_path / "bin", weights_format="bin")
    pool = BufferPool(1, pinned=False)
    with Checkpoint(folder) as ckpt:
        key = ckpt.keys()[0]
        staged = stage(ckpt, key, CPU, pool, None)
        assert staged.buffer is None and torch.equal(take(staged), ckpt.read(key))
    assert pool.allocated_bytes == 0  # no slot was used


# -- the analysis through the slots ---------------------------------------------------------------


def analysis(folder: Path, ckpt: Checkpoint, streams: int, *, staged: bool) -> LayerAnalysis:
    model = ResolvedModel(ref=str(folder), model_id=str(folder), revision=None,
                          resolved_revision=None, directory=folder, source="local")
    layer_map = discover_layers(folder, ckpt)
    return LayerAnalysis(model, layer_map, ckpt.read, AnalysisSettings(), [CPU] * streams, None,
                     False, reader=ckpt if staged else None)


@pytest.mark.parametrize("streams", [1, 3])
def test_the_staged_path_gives_the_plain_paths_results(bf16_llama: Path, streams: int) -> None:
    with Checkpoint(bf16_llama) as ckpt:
        plain = analysis(bf16_llama, ckpt, 1, staged=False)
        plain.run()
        job = analysis(bf16_llama, ckpt, streams, staged=True)
        job.run()
    assert job.buffers is not None and len(job.buffers._free) == (PREFETCH + 1) * streams
    assert job.rows == plain.rows and len(job.rows) == 3 * 7 + 1
    assert job.eigs.keys() == plain.eigs.keys()
    for name, evals in plain.eigs.items():
        assert np.array_equal(job.eigs[name], evals)


class _Failing:
    """A checkpoint whose read of one tensor into a slot fails."""

    def __init__(self, ckpt: Checkpoint, bad: str) -> None:
        self.ckpt, self.bad = ckpt, bad

    def read(self, key: str) -> torch.Tensor:
        return self.ckpt.read(key)

    def nbytes(self, key: str) -> int:
        return self.ckpt.nbytes(key)

    def in_memory(self, key: str) -> bool:
        return False

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        if key == self.bad:
            raise PermanentModelError(f"corrupt tensor {key!r}")
        return self.ckpt.read_into(key, out)


def test_a_run_that_stops_frees_every_slot(bf16_llama: Path) -> None:
    """The fifth tensor's read fails on one of three streams: the run ends with its error at
    once (no read left waiting for a slot another stream holds), every slot is free again and
    no stream or reader thread is left."""
    with Checkpoint(bf16_llama) as ckpt:
        job = analysis(bf16_llama, ckpt, 3, staged=True)
        job.reader = _Failing(ckpt, job.layer_map.layers[4].key)
        t = time.monotonic()
        with pytest.raises(PermanentModelError, match="corrupt tensor"):
            job.run()
    assert time.monotonic() - t < 30
    assert job.buffers is not None and len(job.buffers._free) == (PREFETCH + 1) * 3
    assert not any(t.name.startswith(("esd-stream", "esd-read")) for t in threading.enumerate())


def test_a_staged_cpu_tensor_is_its_slot_until_the_layer_is_done(bf16_llama: Path) -> None:
    pool = BufferPool(1, pinned=False)
    with Checkpoint(bf16_llama) as ckpt:
        key = ckpt.keys()[0]
        staged = stage(ckpt, key, CPU, pool, None)
        assert isinstance(staged, Staged) and staged.buffer is not None
        assert take(staged).data_ptr() == staged.buffer.data_ptr()
        assert not pool._free  # held until the analysis frees it
