"""The Python API's frames carry coverage (issue 41): models() has params_analysed_share and
tensors_skipped (NA for a marker written before coverage; a count stays a nullable Int64),
layers() the scheme each row was dequantized from (`quantization`), from the results tables
and from the per-model files no part holds yet, of a folder store and of S3 (moto)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import esd_sweep
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.tables import DoneModel, write_parts
from tests.support.results import analysed
from tests.support.s3server import STORE_KINDS, S3Server, serve_s3, store_url

COVERAGE: dict[str, Any] = {
    "tensors": 10, "parameters": 1000,
    "analysed": {"tensors": 2, "matrices": 2, "parameters": 800},
    "skipped": {"norm": {"tensors": 8, "parameters": 200, "example": "ln_f.weight"}},
}
SCHEME = "gptq-int4-g128"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def done(name: str, coverage: dict[str, Any] | None, scheme: str) -> DoneModel:
    marker = Marker(model=f"org/{name}", model_key=f"{name}-0123456789", model_id=f"org/{name}",
                    architecture="LlamaForCausalLM", coverage=coverage,
                    parameters={"evals_thresh": 1e-5}, finished_at="2026-01-01",
                    timings={"total_s": 1})
    layers = [{"layer": f"h.{i}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": 2.0 + i,
               "status": "ok", "quantization": scheme} for i in range(2)]
    return DoneModel(marker, layers)


@pytest.mark.parametrize("tabled", [True, False], ids=["tables", "files"])
@pytest.mark.parametrize("kind", STORE_KINDS, indirect=True)
def test_models_and_layers_carry_coverage(kind: str, tabled: bool) -> None:
    url = kind
    store = open_store(url)
    dones = analysed(store, [done("new", COVERAGE, SCHEME), done("old", None, "")])
    if tabled:
        write_parts(store, dones)
    results = esd_sweep.load(url)
    models = results.models().set_index("model_id")
    assert models.loc["org/new", "params_analysed_share"] == pytest.approx(0.8)
    assert pd.isna(models.loc["org/old", "params_analysed_share"])
    assert models["tensors_skipped"].dtype == "Int64"
    assert models.loc["org/new", "tensors_skipped"] == 8
    assert pd.isna(models.loc["org/old", "tensors_skipped"])
    layers = results.layers()
    schemes = {m: set(g["quantization"].fillna("")) for m, g in layers.groupby("model_key")}
    assert schemes == {"new-0123456789": {SCHEME}, "old-0123456789": {""}}
    chosen = results.models(["params_analysed_share"])
    assert list(chosen.columns) == ["params_analysed_share", "model_key"]


@pytest.fixture
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty results location of the kind asked for (STORE_KINDS)."""
    return store_url(request, tmp_path)
