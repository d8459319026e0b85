"""esd_sweep.load: a store that `esd-sweep run` wrote, read as DataFrames (a folder and S3
through moto's server), narrowed to one model list, with the failures and eigenvalues; and
plot_esd draws a layer with its fit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import esd_sweep
from esd_worker.core.models.naming import ref_key
from esd_worker.core.store.opener import open_store
from tests.controller.test_sweep import make_tiny_gpt2, run_sweep, write_model_list
from tests.support.s3server import S3Server, serve_s3

MISSING = "/nonexistent/esd-test-model"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], Path]:
    """A store with two done models and a failure, and the list of the first model only."""
    root = tmp_path_factory.mktemp("load")
    models = [str(make_tiny_gpt2(root / f"gpt2-{i}", seed=i)) for i in range(2)]
    full = write_model_list(root / "models.csv", [(m, "", "") for m in [*models, MISSING]])
    one = write_model_list(root / "one.csv", [(models[0], "", "")])
    done = run_sweep(full, root / "out")
    assert done.returncode == 1, done.stderr[-2000:]  # the missing model failed
    return root / "out", models, one


def test_models_layers_summary_and_failures(sweep: tuple[Path, list[str], Path]) -> None:
    out, models, _ = sweep
    results = esd_sweep.load(str(out))
    frame = results.models()
    assert sorted(frame["model_id"]) == sorted(models)
    assert set(frame["fit"]) == {"fit xmin_mid, float32"}
    layers = results.layers()
    assert set(layers["model_id"]) == set(models)
    for key, group in layers.groupby("model_key"):
        assert list(group["layer_id"]) == list(range(len(group))), key
    assert layers["alpha"].dtype == np.float64 and layers["warning"].isna().all()
    summary = results.summary()
    assert sorted(summary["model_id"]) == sorted(models)
    failures = results.failures()
    assert list(failures["model_id"]) == [MISSING]
    failure = failures.iloc[0]
    assert failure["exit_code"] == 3 and not failure["retryable"] and failure["attempts"] == 1
    assert "model not found" in failure["last_error"]
    assert failure["error"].startswith("PermanentModelError")


def test_one_list_narrows_every_table(sweep: tuple[Path, list[str], Path]) -> None:
    out, models, one = sweep
    results = esd_sweep.load(str(out), model_list=str(one))
    assert list(results.models()["model_id"]) == [models[0]]
    assert set(results.layers()["model_id"]) == {models[0]}
    assert list(results.summary()["model_id"]) == [models[0]]
    assert results.failures().empty


def test_layers_of_some_models_and_columns(sweep: tuple[Path, list[str], Path]) -> None:
    out, models, _ = sweep
    results = esd_sweep.load(str(out))
    by_id = results.layers(models=[models[1]])
    by_key = results.layers(models=[ref_key(models[1])])
    assert set(by_id["model_id"]) == {models[1]} and len(by_id) == len(by_key)
    narrow = results.layers(columns=["layer", "alpha"])
    assert set(narrow.columns) == {"layer", "alpha", "model_key"} and len(narrow) > len(by_id)


def test_eigenvalues_and_the_esd_plot(sweep: tuple[Path, list[str], Path]) -> None:
    out, models, _ = sweep
    results = esd_sweep.load(str(out))
    row = results.layers(models=[models[0]]).iloc[0]
    lam = results.eigenvalues(models[0], row["longname"])
    assert isinstance(lam, np.ndarray) and lam.max() == pytest.approx(row["lambda_max"])
    figure = esd_sweep.plot_esd(row, lam)
    ax = figure.axes[0]
    assert row["longname"] in ax.get_title() and "fit xmin_mid" in ax.get_title()
    assert any(line.get_label().startswith("power law α=") for line in ax.get_lines())
    with pytest.raises(KeyError, match="not done"):
        results.eigenvalues(MISSING)


def test_a_store_on_s3(sweep: tuple[Path, list[str], Path], s3_server: S3Server) -> None:
    """The same store copied to S3 (moto's server over HTTP) reads the same."""
    out, _, _ = sweep
    url = s3_server.url(s3_server.new_bucket(), "results")
    store = open_store(url)
    for path in out.rglob("*"):
        if path.is_file() and "logs" not in path.parts:
            store.put_bytes(path.relative_to(out).as_posix(), path.read_bytes())
    local, remote = esd_sweep.load(str(out)), esd_sweep.load(url)
    pd.testing.assert_frame_equal(
        local.layers().sort_values(["model_key", "layer_id"]).reset_index(drop=True),
        remote.layers().sort_values(["model_key", "layer_id"]).reset_index(drop=True))
    assert list(remote.failures()["model_id"]) == [MISSING]


def test_a_missing_folder_is_one_clear_error(tmp_path: Path) -> None:
    from controller.errors import ResultsError

    with pytest.raises(ResultsError, match="no such directory"):
        esd_sweep.load(str(tmp_path / "nowhere"))
