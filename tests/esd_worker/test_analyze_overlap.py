"""Speculative spectra (esd_worker.analysis.speculate): computed while discovery runs, they change
nothing
in the results. The same model analysed with speculation off and complete (every candidate
speculated, whatever the timing) writes byte-identical layers.csv and identical eigenvalues;
merged, replaced, non-finite and too-small layers go through the normal path; and with the
real overlap ("on") spectra are computed before a slow discovery ends."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from esd_worker.analysis.analyze import analyse_model_with
from esd_worker.analysis.speculate import speculation_mode
from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings
from esd_worker.core.store.results import eigs_from_npz
from tests.support.builders import (
    make_llama,
    make_lora_adapter,
    make_tensor_model,
)


class Run:
    """One in-process analysis on the CPU: layers.csv as bytes, eigs, result.json."""

    def __init__(self, model: Path, out: Path, speculate: str, **analysis: Any) -> None:
        settings = WorkerSettings(model=str(model), output=str(out), device="cpu",
                                  analysis=AnalysisSettings(**analysis))
        marker = analyse_model_with(settings, speculate=speculate)
        folder = out / marker.model_key
        self.csv = (folder / "layers.csv").read_bytes()
        self.eigs = eigs_from_npz((folder / "eigs.npz").read_bytes())
        self.marker = json.loads((folder / "result.json").read_text())
        self.speculated = self.marker["timings"]["speculated_layers"]
        self.rows = self.csv.decode().splitlines()


def assert_same(off: Run, on: Run) -> None:
    assert on.csv == off.csv
    assert on.eigs.keys() == off.eigs.keys()
    for name, evals in off.eigs.items():
        np.testing.assert_array_equal(on.eigs[name], evals, err_msg=name)
    assert on.marker["summary"] == off.marker["summary"]
    assert off.speculated == 0


def compare(model: Path, tmp_path: Path, **analysis: Any) -> tuple[Run, Run]:
    off = Run(model, tmp_path / "off", "off", **analysis)
    full = Run(model, tmp_path / "complete", "complete", **analysis)
    assert_same(off, full)
    return off, full


def ok_layers(run: Run) -> int:
    rows = csv.DictReader(run.rows)
    return sum(1 for row in rows if row["status"] in ("ok", "fit_failed"))


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_llama(llama_dir: Path, tmp_path: Path, precision: str) -> None:
    """Every Linear of the tiny Llama is a candidate (its embedding is not): all speculated."""
    off, full = compare(llama_dir, tmp_path, precision=precision)
    assert full.speculated == ok_layers(off) == len(off.rows) - 1 > 0


def test_gpt2_conv1d(gpt2_dir: Path, tmp_path: Path) -> None:
    """Conv1D stores in x out: speculated as the stored 2-D tensor, labelled out x in (M, N)
    by the row; lm_head is tied to wte, an embedding-named key: not speculated."""
    off, full = compare(gpt2_dir, tmp_path)
    assert 0 < full.speculated < len(off.rows) - 1
    assert any(",Conv1D," in line for line in off.rows)


def test_resnet_conv2d(resnet_dir: Path, tmp_path: Path) -> None:
    """4-D tensors are speculated as Conv2d (pooled, conv_norm); the 3-channel stem is
    too_small and never computed."""
    off, full = compare(resnet_dir, tmp_path, conv_norm=0.8)
    assert full.speculated == ok_layers(off) > 0
    assert any(row["layer_type"] == "Conv2d" and row["status"] == "too_small"
               for row in csv.DictReader(off.rows))


def test_embeddings_when_asked(llama_dir: Path, tmp_path: Path) -> None:
    """With --include-embeddings the embedding is a candidate too: every layer speculated."""
    off, full = compare(llama_dir, tmp_path, include_embeddings=True)
    assert any(",Embedding," in line for line in off.rows)
    assert full.speculated == len(off.rows) - 1


def test_gpt2_lora_merged_layers_use_the_normal_path(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    """A LoRA adapter on c_attn and c_fc: those layers are merged W + ΔW, never the base
    tensor's speculative spectrum; the untouched c_proj layers still are speculated."""
    adapter = make_lora_adapter(gpt2_dir, tmp_path / "adapter", target_modules=("c_attn", "c_fc"),
                                fan_in_fan_out=True)
    _, full = compare(adapter, tmp_path)
    base = Run(gpt2_dir, tmp_path / "base", "complete")
    merged = full.marker["adapter"]["merged_modules"]
    assert merged > 0
    assert full.speculated == base.speculated - merged > 0
    # and the merged layers really differ from the base's (which were speculated there)
    changed = [n for n in full.eigs if not np.array_equal(full.eigs[n], base.eigs[n])]
    assert len(changed) == merged


def test_llama_lora_with_modules_to_save(llama_dir: Path, tmp_path: Path) -> None:
    """q_proj merged and lm_head replaced by the adapter's own copy: neither is speculated."""
    adapter = make_lora_adapter(llama_dir, tmp_path / "adapter", target_modules=("q_proj",),
                                modules_to_save=["lm_head"])
    off, full = compare(adapter, tmp_path)
    assert full.marker["adapter"]["replaced_layers"] == 1
    total = len(off.rows) - 1
    assert full.speculated == total - full.marker["adapter"]["merged_modules"] - 1


def test_nonfinite_and_odd_tensors(tmp_path: Path) -> None:
    """A NaN tensor is not speculated into a row (nonfinite_weights in both runs); an inf in
    fp16, a too-small and an integer tensor keep their statuses; the finite ones are taken
    from the speculation."""
    gen = torch.Generator().manual_seed(0)
    good = torch.randn(40, 24, generator=gen)
    nan = good.clone()
    nan[3, 4] = math.nan
    inf = good.clone()
    inf[0, 0] = math.inf
    tensors = {
        "net.0.good.weight": good,
        "net.1.nan.weight": nan,
        "net.2.inf.weight": inf.half(),
        "net.3.tiny.weight": torch.randn(5, 64, generator=gen),
        "net.4.int8.weight": torch.randint(-8, 8, (40, 24), dtype=torch.int8, generator=gen),
        "net.5.bf16.weight": good.bfloat16(),
    }
    model = make_tensor_model(tmp_path / "edge", tensors)
    off, full = compare(model, tmp_path)
    statuses = [row["status"] for row in csv.DictReader(off.rows)]
    assert statuses == ["ok", "nonfinite_weights", "nonfinite_weights", "too_small",
                        "unsupported_dtype", "ok"]
    assert full.speculated == 2


def test_overlap_computes_spectra_before_a_slow_discovery_ends(tmp_path: Path) -> None:
    """A Llama of 48 thin blocks: building it on the meta device takes a few hundred ms of
    Python, while its first tensor's spectrum takes well under one: with the real overlap
    (speculate="on") some layers come from the speculation, and the table is the same."""
    model = make_llama(tmp_path / "deep", num_layers=48, hidden_size=16, intermediate_size=32)
    off = Run(model, tmp_path / "off", "off")
    on = Run(model, tmp_path / "on", "on")
    assert_same(off, on)
    assert on.speculated > 0


def test_unknown_mode_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculate"):
        Run(llama_dir, tmp_path, "sometimes")


def test_auto_mode_needs_a_spare_core_on_the_cpu() -> None:
    """auto: on with a GPU; on the CPU off when torch's threads take every core (discovery
    would be starved of its own), on when one is left over."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        assert speculation_mode("auto", torch.device("cuda:0")) == "on"
        torch.set_num_threads(cores)
        assert speculation_mode("auto", torch.device("cpu")) == "off"
        torch.set_num_threads(1)
        assert speculation_mode("auto", torch.device("cpu")) == ("on" if cores > 1 else "off")
        assert speculation_mode("complete", torch.device("cpu")) == "complete"
    finally:
        torch.set_num_threads(threads)
