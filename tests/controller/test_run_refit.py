"""`esd-sweep run` after only the fit settings changed: a refit in place, not an analysis.

What users rely on: rerunning a finished sweep with another --fix-fingers (or
--evals-thresh, --bins) takes milliseconds a model, starts no worker and downloads nothing,
and leaves exactly what an analysis with those settings would have left (layers.csv,
marker, the results tables); anything else (--reanalyse, another non-fit setting, stored
eigenvalues that are missing or damaged) is analysed again, and no model is lost. Real CPU
workers on locally built models, the sweep run in this process through its command line.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main
from controller.results.tables import Tables
from controller.run.refitrun import fit_only
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.marker import FileSeal, Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import layers_from_csv
from tests.support.builders import make_gpt2
from tests.support.s3server import S3Server, serve_s3

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers inherit it: the same eigenvalues run after run, and two cores not fought for."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@contextmanager
def _kept_logging() -> Iterator[None]:
    """The root logger as it was after main() set it up in this process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def sweep(models: list[Path], out: str, tmp: Path, *extra: str) -> dict[str, Any]:
    """`esd-sweep run` over `models` into `out` (a folder or URL); its --report document."""
    listing = tmp / "models.csv"
    listing.write_text("model_id\n" + "".join(f"{m}\n" for m in models))
    report = tmp / "report.json"
    with _kept_logging():
        code = main(["run", "--model-list", str(listing), "--output-dir", out, "--device",
                     "cpu", "--retry-backoff", "0.1", "--report", str(report), *extra])
    doc: dict[str, Any] = json.loads(report.read_text())
    assert code == doc["exit_code"]
    return doc


def alphas(out: Path, key: str, name: str = "layers.csv") -> dict[str, float]:
    rows = layers_from_csv((out / key / name).read_bytes())
    return {row["layer"]: float(row["alpha"]) for row in rows if row["status"] == "ok"}


RUN = AnalysisSettings(fix_fingers="DKS", bins=50).as_dict()
SEALED = {"layers.csv": FileSeal.of(b"t"), "eigs.npz": FileSeal.of(b"e")}


@pytest.mark.parametrize(("stored", "eigs", "files", "refittable"), [
    pytest.param(AnalysisSettings().as_dict(), "eigs.npz", SEALED, True, id="fit-only"),
    pytest.param(AnalysisSettings(fix_fingers="DKS").as_dict(), "eigs.npz", SEALED, True,
                 id="bins-only"),
    pytest.param(RUN, "eigs.npz", SEALED, False, id="no-change"),
    pytest.param(AnalysisSettings(precision="float64").as_dict(), "eigs.npz", SEALED, False,
                 id="and-precision"),
    pytest.param(AnalysisSettings(min_evals=20).as_dict(), "eigs.npz", SEALED, False,
                 id="and-min-evals"),
    pytest.param({k: v for k, v in AnalysisSettings().as_dict().items() if k != "conv_norm"},
                 "eigs.npz", SEALED, False, id="a-parameter-missing"),
    pytest.param(AnalysisSettings().as_dict(), None, {"layers.csv": SEALED["layers.csv"]},
                 False, id="no-eigenvalues"),
    pytest.param(AnalysisSettings().as_dict(), "eigs.npz", {}, False, id="eigs-not-sealed"),
])
def test_fit_only_decides_what_is_refitted(
    stored: dict[str, Any], eigs: str | None, files: dict[str, FileSeal], refittable: bool
) -> None:
    marker = Marker(model="m", model_key="m", parameters=stored, eigs_name=eigs, files=files)
    assert fit_only(RUN)(marker) is refittable


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("models")
    return [make_gpt2(root / f"gpt2-{i}", seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def analysed(models: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both models analysed with the default fit (xmin_mid), eigenvalues stored."""
    tmp = tmp_path_factory.mktemp("analysed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        doc = sweep(models, str(tmp / "out"), tmp)
    assert doc["exit_code"] == 0 and doc["counts"]["done"] == 2
    return tmp / "out"


@pytest.fixture(scope="module")
def reference(models: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first model analysed from scratch with --fix-fingers DKS."""
    tmp = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        doc = sweep(models[:1], str(tmp / "out"), tmp, "--fix-fingers", "DKS")
    assert doc["exit_code"] == 0
    return tmp / "out"


@pytest.fixture
def out(analysed: Path, tmp_path: Path) -> Path:
    """A copy of the analysed output of this test's own."""
    return Path(shutil.copytree(analysed, tmp_path / "out", ignore=shutil.ignore_patterns(
        "logs", "_lease.json")))


def test_fit_change_is_refitted_in_place_without_a_worker(
    models: list[Path], out: Path, reference: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = model_key(str(models[0]))
    before = alphas(out, key)
    capsys.readouterr()
    doc = sweep(models[:1], str(out), tmp_path, "--fix-fingers", "DKS")
    printed = capsys.readouterr().out
    assert f"run {doc['run_id']}: 0 done, 1 refitted, 0 failed" in printed
    assert "fit: DKS, float32" in printed  # the table above it says the new fit
    counts = doc["counts"]
    assert doc["exit_code"] == 0
    assert counts["refitted"] == 1 and counts["attempted"] == 0 and counts["done"] == 0
    assert not (out / "logs" / "workers" / f"{key}.log").exists()  # no worker had it

    expected = alphas(reference, key)
    refitted = alphas(out, key)
    assert refitted.keys() == expected.keys() and refitted != before
    for layer, alpha in expected.items():
        assert refitted[layer] == pytest.approx(alpha, rel=1e-12, abs=1e-12)
    rows = layers_from_csv((out / key / "layers.csv").read_bytes())
    assert {row["fix_fingers"] for row in rows} == {"DKS"}

    marker = json.loads((out / key / "result.json").read_text())
    ref_marker = json.loads((reference / key / "result.json").read_text())
    assert marker["parameters"] == ref_marker["parameters"]
    assert marker["status_counts"] == ref_marker["status_counts"]
    assert marker["summary"]["alpha_mean"] == pytest.approx(
        ref_marker["summary"]["alpha_mean"], rel=1e-12)
    assert "refit_s" in marker["timings"]

    store = open_store(str(out))
    model_rows = [row for batch in Tables(store).models(["model_key", "alpha_mean"])
                  for row in batch.to_pylist() if row["model_key"] == key]
    assert [row["alpha_mean"] for row in model_rows] == [marker["summary"]["alpha_mean"]]
    layer_alphas = {row["layer"]: row["alpha"]
                    for batch in Tables(store).layers(["model_key", "layer", "alpha", "status"])
                    for row in batch.to_pylist()
                    if row["model_key"] == key and row["status"] == "ok"}
    assert layer_alphas == refitted

    marker_bytes = (out / key / "result.json").read_bytes()
    again = sweep(models[:1], str(out), tmp_path, "--fix-fingers", "DKS")
    assert again["counts"]["already_done"] == 1
    assert again["counts"]["refitted"] == 0 and again["counts"]["attempted"] == 0
    assert (out / key / "result.json").read_bytes() == marker_bytes


@pytest.mark.parametrize("extra", [
    pytest.param(("--reanalyse",), id="reanalyse"),
    pytest.param(("--precision", "float64"), id="non-fit-setting"),
])
def test_other_changes_are_analysed(
    models: list[Path], out: Path, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    key = model_key(str(models[0]))
    doc = sweep(models[:1], str(out), tmp_path, "--fix-fingers", "DKS", *extra)
    assert doc["exit_code"] == 0
    assert doc["counts"]["refitted"] == 0 and doc["counts"]["done"] == 1
    marker = json.loads((out / key / "result.json").read_text())
    assert marker["parameters"]["fix_fingers"] == "DKS" and "refit_s" not in marker["timings"]


def test_missing_or_damaged_eigenvalues_are_analysed(
    models: list[Path], out: Path, tmp_path: Path
) -> None:
    """eigs.npz deleted: the plan sees it; eigs.npz of its sealed size but other bytes: the
    refit finds it and hands the model back. Both analysed, none lost, no crash."""
    gone, corrupt = (model_key(str(m)) for m in models)
    (out / gone / "eigs.npz").unlink()
    data = bytearray((out / corrupt / "eigs.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / corrupt / "eigs.npz").write_bytes(bytes(data))
    doc = sweep(models, str(out), tmp_path, "--fix-fingers", "DKS")
    counts = doc["counts"]
    assert doc["exit_code"] == 0
    assert counts["refitted"] == 0 and counts["refit_analysed"] == 1 and counts["done"] == 2
    for key in (gone, corrupt):
        marker = json.loads((out / key / "result.json").read_text())
        assert marker["parameters"]["fix_fingers"] == "DKS"
        assert (out / key / "eigs.npz").stat().st_size == marker["files"]["eigs.npz"]["size"]


def test_dry_run_and_status_count_the_refits(
    models: list[Path], out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dry run says one would be refitted and one analysed, and writes nothing."""
    (out / model_key(str(models[1])) / "eigs.npz").unlink()
    before = sorted(p for p in out.rglob("*") if p.is_file())
    doc = sweep(models, str(out), tmp_path, "--fix-fingers", "DKS", "--dry-run")
    assert doc["counts"]["to_refit"] == 1 and doc["counts"]["to_analyse"] == 1
    assert sorted(p for p in out.rglob("*") if p.is_file()) == before
    capsys.readouterr()
    listing = tmp_path / "models.csv"
    with _kept_logging():
        assert main(["status", "--model-list", str(listing), "--output-dir", str(out),
                     "--fix-fingers", "DKS", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["stale"] == 2 and status["refittable"] == 1 and status["todo"] == 2


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_refit_in_an_s3_store(
    models: list[Path], analysed: Path, reference: Path, s3_server: S3Server, tmp_path: Path
) -> None:
    """The analysed files copied into S3: the refit reads and writes them there (moto's
    server over HTTP), with the same numbers as the local one."""
    key = model_key(str(models[0]))
    bucket = s3_server.new_bucket()
    url = s3_server.url(bucket, "results")
    store = open_store(url)
    for name in ("layers.csv", "eigs.npz", "result.json"):
        store.put_bytes(f"{key}/{name}", (analysed / key / name).read_bytes())
    doc = sweep(models[:1], url, tmp_path, "--fix-fingers", "DKS", "--log-dir",
                str(tmp_path / "logs"))
    assert doc["exit_code"] == 0
    assert doc["counts"]["refitted"] == 1 and doc["counts"]["attempted"] == 0
    got = layers_from_csv(store.get_bytes(f"{key}/layers.csv") or b"")
    expected = alphas(reference, key)
    assert {r["layer"]: float(r["alpha"]) for r in got if r["status"] == "ok"} == (
        pytest.approx(expected, rel=1e-12))
    assert any(k.startswith("results/_tables/models/") for k in s3_server.keys(bucket))
    marker = json.loads(store.get_bytes(f"{key}/result.json") or b"{}")
    assert marker["parameters"]["fix_fingers"] == "DKS"
