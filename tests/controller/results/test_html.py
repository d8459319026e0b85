"""The report's index page on a real small store: results tables (parts) plus models only
as per-model files (the tables' fallback) plus failure records; what the page says, that its
links resolve, and that its size does not grow with the number of models."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller.results.html import INDEX_NAME, fmt
from controller.results.report import ReportSettings, write_report
from esd_worker.core.store.layout import write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.records import FailureRecord, write_failure
from esd_worker.core.store.results import layers_to_csv
from esd_worker.core.store.stores import LocalStore
from esd_worker.core.store.tables import DoneModel, write_parts
from tests.support.results import Links, analysed

ARCHS = ("LlamaForCausalLM", "GPT2LMHeadModel", "BertModel")


def marker(i: int) -> Marker:
    return Marker(model=f"org/m{i}", model_key=f"m{i:05d}", model_id=f"org/m{i}",
                  architecture=ARCHS[i % 3], finished_at="2026-01-01", timings={"total_s": 1},
                  relation="finetune" if i % 2 else "", parameters={"evals_thresh": 1e-5})


def layers(i: int, count: int = 2) -> list[dict[str, object]]:
    alpha = 2.0 + (i % 97) / 10
    return [{"layer": f"h.{j}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": alpha,
             "status": "ok"} for j in range(count)]


def make_store(root: Path, tabled: int, per_model: int) -> LocalStore:
    store = LocalStore(root)
    write_parts(store, analysed(store, [DoneModel(marker(i), layers(i)) for i in range(tabled)]))
    for i in range(tabled, tabled + per_model):
        write_model_result(store, marker(i), layers=layers_to_csv(layers(i)))
    for i, error in enumerate(["TransientError", "TransientError", "PermanentModelError"]):
        write_failure(store, FailureRecord(
            model=f"org/bad{i}", model_key=f"bad{i}", error=error, exit_code=3, signal=None,
            retryable=error == "TransientError", attempts=1, stderr_tail=(), run_id="r",
            time="t"))
    return store


def test_index_says_counts_groups_lists_and_failures(tmp_path: Path) -> None:
    """40 models in parts + 5 only as per-model files: all 45 count; 3 families; the top
    lists link to pages that exist (3: --max-model-plots); the failures grouped by cause
    with examples."""
    make_store(tmp_path / "store", 40, 5)
    out = tmp_path / "site"
    report = write_report(ReportSettings(results=str(tmp_path / "store"), out=str(out),
                                         esd_layers=1, max_model_plots=3))
    assert (report.models, report.layers) == (45, 90)
    page = (out / INDEX_NAME).read_text()
    assert "45 models, 90 layers, 3 families" in page
    assert "evals_thresh" in page and "use other settings" not in page
    for group in ("llama", "gpt2", "bert", "finetune", "unknown", "&lt;100m"):
        assert group in page.lower(), group
    links = Links()
    links.feed(page)
    pages = [r for r in links.refs if r.startswith("models/")]
    assert pages and all((out / r).is_file() for r in links.refs)
    assert report.plotted_models == len(set(pages)) == 3
    failures = page[page.index("<h2>Failures</h2>"):]
    assert "3 failure record(s)" in failures
    assert "TransientError</td><td>yes</td><td>2</td>" in failures
    assert "org/bad2" in failures


def test_index_size_does_not_grow_with_models(tmp_path: Path) -> None:
    """20,000 models: the index stays well under 3 MB (its size is set by groups and N)."""
    make_store(tmp_path / "store", 20_000, 0)
    t0 = time.perf_counter()
    write_report(ReportSettings(results=str(tmp_path / "store"), out=str(tmp_path / "site"),
                                max_model_plots=0))
    assert time.perf_counter() - t0 < 60
    size = (tmp_path / "site" / INDEX_NAME).stat().st_size
    assert size < 3 * 2**20


@pytest.mark.parametrize(("value", "digits", "text"), [
    (None, 3, "–"), (float("nan"), 3, "–"), (2.0, 3, "2.000"), (0.25, 2, "0.25"), (7, 3, "7"),
])
def test_cells(value: float | int | None, digits: int, text: str) -> None:
    assert fmt(value, digits) == text
