"""`esd-sweep refit`: fits recomputed from stored eigenvalues, next to the original tables.

Real results come from tests.support.results.example_results (the worker on a tiny GPT-2, a LoRA
adapter on it and the real all-MiniLM-L6-v2). Corner cases (layers without eigenvalues,
too_small layers, models without eigs.npz) use small stores written here the way the worker
writes them: layers.csv rows from esd_worker.core.powerlaw.layer_metrics, eigs.npz, result.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controller.errors import EXIT_INFRA, ResultsError, describe_error
from controller.output.tenure import LeaseLostError, Tenure
from controller.results import refit
from controller.results.refit import (
    STATUS_NO_EIGS,
    RefitSettings,
    refit_rows,
    refit_store,
    refit_tag,
)
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.naming import model_key
from esd_worker.core.powerlaw import METRIC_COLUMNS, layer_metrics
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import (
    eigs_from_npz,
    eigs_to_npz,
    layers_from_csv,
    layers_to_csv,
    summarize_layers,
)
from tests.support.results import copy_example, example_results, keys_by_relation, png_title


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    master = example_results(tmp_path_factory, gpt2_dir)
    return copy_example(master, tmp_path_factory.mktemp("refit") / "results")


@pytest.fixture(scope="module")
def original(example: Path) -> refit.RefitResult:
    """A refit of the example with the worker's own (default) settings."""
    return refit_store(RefitSettings(results=str(example)))


@pytest.fixture(scope="module")
def dks(example: Path) -> refit.RefitResult:
    return refit_store(RefitSettings(results=str(example), fix_fingers="DKS"))


def test_default_tag_names_the_settings() -> None:
    assert refit_tag("DKS", 1e-5, 100) == "refit-DKS-1e-05-100"
    assert refit_tag("xmin_peak", 0.001, 50, 20) == "refit-xmin_peak-0.001-50-min20"
    assert RefitSettings(results=".", fix_fingers="DKS").resolved_tag == "refit-DKS-1e-05-100"
    assert RefitSettings(results=".", tag="mine").resolved_tag == "mine"


@pytest.mark.parametrize("relation", ["base", "adapter", "finetune"])
def test_refit_with_original_settings_reproduces_the_table_exactly(
    example: Path, original: refit.RefitResult, relation: str
) -> None:
    """The worker computed layers.csv with layer_metrics on these very eigenvalues (stored in
    float64) and the default settings; the refit calls the same function on the same arrays
    and encodes floats with the same repr: the files are identical, byte for byte (MiniLM:
    the real trained model; GPT-2: Conv1D layers; the adapter: merged LoRA weights)."""
    key = keys_by_relation(example)[relation]
    assert original.tag == "refit-xmin_mid-1e-05-100"
    before = (example / key / "layers.csv").read_bytes()
    after = (example / key / f"layers.{original.tag}.csv").read_bytes()
    assert after == before
    assert original.counts.refit == sum(
        len(layers_from_csv((example / k / "layers.csv").read_bytes()))
        for k in keys_by_relation(example).values()
    )
    assert original.counts.no_eigs == 0 and not original.skipped


def test_refit_leaves_the_worker_files_alone(example: Path, dks: refit.RefitResult) -> None:
    """The originals are read, never written: the markers still describe layers.csv."""
    for key in dks.models:
        marker = json.loads((example / key / "result.json").read_text())
        assert marker["parameters"]["fix_fingers"] == "xmin_mid"
        rows = layers_from_csv((example / key / "layers.csv").read_bytes())
        assert {r["fix_fingers"] for r in rows} == {"xmin_mid"}


def test_dks_refit_equals_layer_metrics_on_the_stored_eigenvalues(
    example: Path, dks: refit.RefitResult
) -> None:
    """Every metric of the DKS table is what layer_metrics(eigs, max_dim=max(M, N),
    fix_fingers="DKS") gives for the layer's stored eigenvalues (the reference computed
    here, directly). DKS scans every xmin instead of taking the median, so α moves for
    almost every layer; the norm metrics use all eigenvalues and do not move."""
    assert dks.tag == "refit-DKS-1e-05-100"
    moved = total = 0
    for key in dks.models:
        eigs = eigs_from_npz((example / key / "eigs.npz").read_bytes())
        before = layers_from_csv((example / key / "layers.csv").read_bytes())
        after = layers_from_csv((example / key / f"layers.{dks.tag}.csv").read_bytes())
        assert [r["layer"] for r in after] == [r["layer"] for r in before]
        for old, new in zip(before, after, strict=True):
            expected = layer_metrics(eigs[new["layer"]], max_dim=max(int(new["M"]),
                                     int(new["N"])), fix_fingers="DKS")
            for col in METRIC_COLUMNS:
                assert new[col] == _cell(expected[col]), (new["layer"], col)
            assert new["status"] == expected["status"]
            assert new["fix_fingers"] == "DKS"
            for col in ("spectral_norm", "norm", "stable_rank", "entropy", "matrix_rank"):
                assert new[col] == old[col]
            moved += new["alpha"] != old["alpha"]
            total += 1
    assert moved >= 0.9 * total


def _cell(value: Any) -> str:
    """layers.csv's encoding of one value (esd_worker.core.store.results)."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def test_refit_summary_is_computed_from_the_new_tables(
    example: Path, dks: refit.RefitResult
) -> None:
    """summary.<tag>.csv: one row per refit model, statistics by summarize_layers over the
    refit rows (not the marker's, which describe layers.csv); refits/<tag>.json records the
    settings and counts."""
    rows = list(csv.DictReader((example / f"summary.{dks.tag}.csv").open()))
    assert [r["model_key"] for r in rows] == list(dks.models)
    for row in rows:
        table = layers_from_csv((example / row["model_key"] / f"layers.{dks.tag}.csv")
                                .read_bytes())
        assert float(row["alpha_mean"]) == summarize_layers(table)["alpha_mean"]
    record = json.loads((example / "refits" / f"{dks.tag}.json").read_text())
    assert record["parameters"] == {"fix_fingers": "DKS", "evals_thresh": 1e-5, "bins": 100,
                                    "min_evals": None}
    assert record["models"] == list(dks.models)
    assert record["rows"]["refit"] == dks.counts.refit


def test_report_on_a_refit_table(
    example: Path, dks: refit.RefitResult, tmp_path: Path
) -> None:
    """`report --tag` reads layers.<tag>.csv (from the per-model files): its numbers are the
    refit's (summary.<tag>.csv's alpha_mean, the largest first in the top list) and the
    model pages' rows the refit's. Its fit is the refit's (DKS, from refits/<tag>.json; the
    example was analysed with xmin_mid): on the index, the page and the α plot, and with it
    WeightWatcher's band share."""
    from controller.results.report import ReportSettings, write_report

    report = write_report(ReportSettings(results=str(example), out=str(tmp_path), tag=dks.tag,
                                         max_model_plots=1, esd_layers=1))
    assert report.models == len(dks.models)
    refit_summary = {r["model_key"]: float(r["alpha_mean"]) for r in csv.DictReader(
        (example / f"summary.{dks.tag}.csv").open())}
    page = (tmp_path / "index.html").read_text()
    top = page[page.index("<h4>Top 20</h4>"):]
    assert f"<td>{max(refit_summary.values()):.3f}</td>" in top.split("</table>")[0]
    assert f"layers.{dks.tag}.csv" in page
    assert "Fit: <b>fit DKS, float32</b>" in page[:page.index("<h2>")]
    assert "calibrated for the DKS fit" not in page and "α in [2, 6]" in page
    (model,) = (tmp_path / "models").iterdir()
    assert "Fit: <b>fit DKS, float32</b>" in (model / "index.html").read_text()
    assert (png_title((model / "alpha.png").read_bytes()) or "").endswith("\nfit DKS, float32")


def test_threads_do_not_change_the_numbers(example: Path, dks: refit.RefitResult) -> None:
    """Layers fitted one at a time write the same bytes as layers fitted concurrently."""
    serial = refit_store(RefitSettings(results=str(example), fix_fingers="DKS", threads=1,
                                       tag="serial"))
    for key in serial.models:
        assert (example / key / "layers.serial.csv").read_bytes() == \
            (example / key / f"layers.{dks.tag}.csv").read_bytes()


# --------------------------------------------------------------------- corner cases


Layer = tuple[str, int, int, "np.ndarray | None"]


def _rows_like_the_worker(
    layers: list[Layer], settings: AnalysisSettings
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    rows, eigs = [], {}
    for name, M, N, evals in layers:
        row: dict[str, Any] = {"model_id": "org/model", "revision": "", "layer": name,
                               "layer_type": "Linear", "M": M, "N": N, "num_params": M * N,
                               "fix_fingers": settings.fix_fingers}
        if min(M, N) < settings.min_evals:
            row |= refit._empty_metrics() | {"status": "too_small"}
        else:
            assert evals is not None
            row |= layer_metrics(evals, max_dim=max(M, N), fix_fingers=settings.fix_fingers,
                                 evals_thresh=settings.evals_thresh, bins=settings.bins)
            eigs[name] = evals
        rows.append(row)
    return rows, eigs


DEFAULTS = AnalysisSettings()


def make_store(
    root: Path, layers: list[Layer], *, model: str = "org/model", drop_eigs: tuple[str, ...] = (),
    eigs_npz: bool = True, settings: AnalysisSettings = DEFAULTS,
) -> str:
    """A result as the worker writes it (rows from layer_metrics; too_small rows below
    settings.min_evals); drop_eigs: layers whose eigenvalues eigs.npz leaves out."""
    rows, eigs = _rows_like_the_worker(layers, settings)
    key = model_key(model)
    folder = root / key
    folder.mkdir(parents=True)
    (folder / "layers.csv").write_bytes(layers_to_csv(rows))
    if eigs_npz:
        kept = {k: v for k, v in eigs.items() if k not in drop_eigs}
        (folder / "eigs.npz").write_bytes(eigs_to_npz(kept))
    (folder / "result.json").write_bytes(Marker(
        model=model, model_id=model, revision=None, model_key=key,
        relation="base", base_model=None, parameters=settings.as_dict(),
        summary=summarize_layers(rows),
        layers_name="layers.csv", eigs_name="eigs.npz" if eigs_npz else None,
    ).to_json())
    return key


def _pareto(alpha: float, n: int, seed: int) -> np.ndarray:
    """Eigenvalues with a power-law density ∝ λ^-alpha above 1 (numpy's Lomax + 1)."""
    return np.sort(np.random.default_rng(seed).pareto(alpha - 1.0, n) + 1.0)


LAYERS: list[Layer] = [
    ("big", 64, 256, _pareto(2.5, 64, 1)),
    ("mid", 24, 24, _pareto(3.0, 24, 2)),
    ("tiny", 8, 32, None),  # smaller side 8 < min_evals 10: too_small, no eigenvalues
    ("lost", 40, 40, _pareto(4.0, 40, 3)),
]


def _read(root: Path, key: str, tag: str) -> dict[str, dict[str, str]]:
    return {r["layer"]: r for r in layers_from_csv((root / key / f"layers.{tag}.csv")
                                                   .read_bytes())}


def test_layers_without_eigenvalues_keep_their_numbers_as_no_eigs(tmp_path: Path) -> None:
    """"lost" is in layers.csv (fitted) but not in eigs.npz: its row is kept as it was, with
    its original fix_fingers (which made those numbers) and status no_eigs, so the refit
    summary leaves it out of the α statistics. "tiny" was too_small: it stays too_small."""
    key = make_store(tmp_path, LAYERS, drop_eigs=("lost",))
    result = refit_store(RefitSettings(results=str(tmp_path), fix_fingers="DKS", tag="t"))
    original = {r["layer"]: r for r in layers_from_csv((tmp_path / key / "layers.csv")
                                                        .read_bytes())}
    new = _read(tmp_path, key, "t")
    assert new["lost"] == original["lost"] | {"status": STATUS_NO_EIGS}
    assert new["lost"]["fix_fingers"] == "xmin_mid"
    assert new["tiny"] == original["tiny"] | {"fix_fingers": "DKS"}
    assert new["big"]["fix_fingers"] == "DKS" and new["big"]["status"] == "ok"
    assert (result.counts.refit, result.counts.no_eigs, result.counts.kept) == (2, 1, 1)
    summary = next(csv.DictReader((tmp_path / "summary.t.csv").open()))
    assert summary["layers"] == "4" and summary["layers_ok"] == "2"


@pytest.mark.parametrize(
    ("min_evals", "too_small"),
    [
        pytest.param(None, {"tiny"}, id="as-analysed"),
        pytest.param(30, {"tiny", "mid"}, id="larger-marks-more"),
        pytest.param(5, {"tiny"}, id="smaller-cannot-bring-back"),
    ],
)
def test_min_evals(tmp_path: Path, min_evals: int | None, too_small: set[str]) -> None:
    """min_evals decides too_small from the shape alone: 30 > 24 makes "mid" (24 × 24)
    too_small, with the worker's empty metrics (NaN, counts 0); 5 cannot analyse "tiny"
    (8 × 32), which has no stored eigenvalues, so it stays too_small as analysed."""
    key = make_store(tmp_path, LAYERS)
    refit_store(RefitSettings(results=str(tmp_path), min_evals=min_evals, tag="t"))
    new = _read(tmp_path, key, "t")
    assert {name for name, r in new.items() if r["status"] == "too_small"} == too_small
    for name in too_small:
        assert new[name]["alpha"] == "nan" and new[name]["num_evals"] == "0"


def test_models_without_eigs_npz_are_left_out(tmp_path: Path) -> None:
    """A model analysed with --no-eigs cannot be refit: it is listed as skipped and gets no
    table; the others are refit."""
    with_eigs = make_store(tmp_path, LAYERS[:1], model="org/a")
    without = make_store(tmp_path, LAYERS[:1], model="org/b", eigs_npz=False)
    result = refit_store(RefitSettings(results=str(tmp_path), tag="t"))
    assert result.models == (with_eigs,) and result.skipped == (without,)
    assert not (tmp_path / without / "layers.t.csv").exists()


def test_no_eigs_anywhere_is_one_line_usage_error(tmp_path: Path) -> None:
    make_store(tmp_path, LAYERS[:1], eigs_npz=False)
    with pytest.raises(ResultsError, match=r"no eigs\.npz") as err:
        refit_store(RefitSettings(results=str(tmp_path)))
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_missing_location_is_one_line_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="no such directory") as err:
        refit_store(RefitSettings(results=str(tmp_path / "missing")))
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_unknown_model_key_is_named(tmp_path: Path) -> None:
    make_store(tmp_path, LAYERS[:1])
    with pytest.raises(ResultsError, match="no-such-key"):
        refit_store(RefitSettings(results=str(tmp_path), keys=("no-such-key",)))


def test_bad_settings_are_reported_together(tmp_path: Path) -> None:
    """Every bad setting is named in one message."""
    with pytest.raises(ResultsError) as err:
        refit_store(RefitSettings(results=str(tmp_path), fix_fingers="best", bins=0,
                                  tag="../x"))
    message = str(err.value)
    assert "fix_fingers" in message and "bins" in message and "invalid tag" in message
    assert "\n" not in message


def test_refit_rows_keeps_order_and_unanalysed_statuses() -> None:
    """Rows come back in table order; a layer the worker could not analyse
    (unsupported_dtype) keeps its status and metrics even when eigenvalues are passed."""
    rows: list[Mapping[str, str]] = [
        {"layer": "a", "M": "16", "N": "16", "status": "unsupported_dtype", "alpha": "nan",
         "fix_fingers": "xmin_mid"},
        {"layer": "b", "M": "16", "N": "16", "status": "ok", "alpha": "2.0",
         "fix_fingers": "xmin_mid"},
    ]
    evals = _pareto(3.0, 16, 4)
    out, counts = refit_rows(rows, {"a": evals, "b": evals}, fix_fingers="DKS",
                             evals_thresh=1e-5, bins=100)
    assert [r["layer"] for r in out] == ["a", "b"]
    assert out[0]["status"] == "unsupported_dtype" and out[0]["alpha"] == "nan"
    assert out[1]["alpha"] == layer_metrics(evals, max_dim=16, fix_fingers="DKS")["alpha"]
    assert (counts.refit, counts.kept) == (1, 1)


def test_run_refit_flags_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The subcommand: kebab-case flags and their snake_case aliases; it prints the tag, the
    counts and α mean before → after per model."""
    make_store(tmp_path, LAYERS)
    parser = argparse.ArgumentParser()
    refit.add_refit_flags(parser)
    args = parser.parse_args(["--output_dir", str(tmp_path), "--fix-fingers", "DKS",
                              "--evals_thresh", "1e-4", "--bins", "50"])
    assert refit.run_refit(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("refit refit-DKS-0.0001-50: 1 model(s), 3 layers refit")
    assert "alpha_mean before" in out and "org/model" in out


def test_cli_refit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """Through `esd-sweep refit`: 0 on a store with eigenvalues; a store without any eigs.npz
    is one line on stderr and exit 2."""
    from tests.support.results import wired_subparser

    if wired_subparser("refit", "--fix-fingers") is None:
        pytest.skip("esd-sweep refit is not wired yet")
    from controller.cli import main

    make_store(tmp_path / "ok", LAYERS)
    assert main(["refit", "--output-dir", str(tmp_path / "ok"), "--fix-fingers", "DKS"]) == 0
    make_store(tmp_path / "bare", LAYERS, eigs_npz=False)
    capsys.readouterr()
    assert main(["refit", "--output-dir", str(tmp_path / "bare")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no eigs.npz" in err[0]


def test_a_refit_whose_lease_is_lost_writes_nothing_more(
    example: Path, tmp_path: Path
) -> None:
    """The lease is lost before the first table (as a refit paused past an S3 lease's TTL
    finds it): no layers.<tag>.csv, no summary, no record; LeaseLostError (exit 3)."""
    copy = copy_example(example, tmp_path / "results")
    tenure = Tenure(str(copy))
    tenure.lose()
    with pytest.raises(LeaseLostError) as raised:
        refit_store(RefitSettings(results=str(copy), tag="lost"), tenure=tenure)
    assert describe_error(raised.value) is not None
    assert describe_error(raised.value)[0] == EXIT_INFRA  # type: ignore[index]
    assert not list(copy.rglob("*lost*"))
