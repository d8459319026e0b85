"""Coverage per model (issue 41): result.json's `coverage` as summary.csv's
params_analysed_share and tensors_skipped (the same bytes from the markers and from the
results tables, a folder store and S3), as the Coverage block of a model's page (escaped as
every worker's text), the quantization schemes of its layer rows, and the share in the
index's model lists; markers written before coverage say so."""

from __future__ import annotations

import csv
import html.parser
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from controller.results import summary as summary_module
from controller.results.html import INDEX_NAME, MODELS_FOLDER, PAGE_NAME, SHARE_HEADER
from controller.results.pages import NOT_RECORDED, expert_group, model_page, with_rows
from controller.results.reader import ModelResult
from controller.results.report import ReportSettings, write_report
from controller.results.reportfit import fit_of
from controller.results.summary import write_summary
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import read_markers
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import (
    MODEL_SCHEMA,
    DoneModel,
    coverage_cells,
    part_tables,
    table_bytes,
    write_part,
    write_parts,
)
from tests.support.results import analysed
from tests.support.s3server import STORE_KINDS, S3Server, serve_s3, store_url

PARAMS = {"evals_thresh": 1e-5}
MARKUP = '<script>alert("x")</script>&'
COVERAGE: dict[str, Any] = {
    "tensors": 12, "parameters": 4000,
    "analysed": {"tensors": 3, "matrices": 5, "parameters": 3000},
    "skipped": {
        "norm": {"tensors": 4, "parameters": 600, "example": "h.0.ln_1.weight"},
        "vector": {"tensors": 5, "parameters": 400, "example": f"h.0.{MARKUP}.bias"},
    },
}
QUANTIZED = "fp8-e4m3-block128x128"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return open_store(store_url(request, tmp_path))


def done(name: str, coverage: dict[str, Any] | None, alpha: float,
         quantization: str = "") -> DoneModel:
    """A done model `org/<name>` of two layers (the second dequantized from `quantization`
    when given) whose marker holds `coverage` (None: written before it)."""
    row = ModelRow(f"org/{name}", None, "", None, line=0)
    marker = Marker(model=row.ref, model_key=row.key, model_id=row.model_id,
                    architecture="LlamaForCausalLM", parameters=PARAMS, coverage=coverage,
                    finished_at="2026-01-01T00:00:00+00:00", timings={"total_s": 1})
    layers = [{"layer": f"h.{i}.mlp", "M": 8, "N": 16, "num_params": 128,
               "alpha": alpha + i, "status": "ok", "quantization": quantization if i else ""}
              for i in range(2)]
    return DoneModel(marker, layers)


def rows_of(names: list[str]) -> list[ModelRow]:
    return [ModelRow(f"org/{n}", None, "", None, line=0) for n in names]


def summary(store: Store, names: list[str]) -> tuple[bytes, list[dict[str, str]]]:
    assert write_summary(store, rows_of(names), threads=2) == len(names)
    data = store.get_bytes("summary.csv")
    assert data is not None
    return data, list(csv.DictReader(io.StringIO(data.decode())))


# --- the two numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("coverage", "share", "skipped"), [
    pytest.param(COVERAGE, 0.75, 9, id="recorded"),
    pytest.param(None, None, None, id="written-before-coverage"),
    pytest.param({**COVERAGE, "skipped": {}}, 0.75, 0, id="nothing-skipped"),
    pytest.param({**COVERAGE, "parameters": 0}, None, 9, id="no-parameters"),
    pytest.param({"tensors": 1}, None, None, id="counts-missing"),
    pytest.param({**COVERAGE, "parameters": "4000"}, None, 9, id="not-a-count"),
    pytest.param({**COVERAGE, "skipped": {"norm": {"tensors": True}}}, 0.75, None,
                 id="a-bool-is-no-count"),
])
def test_coverage_cells(coverage: dict[str, Any] | None, share: float | None,
                        skipped: int | None) -> None:
    assert coverage_cells(coverage) == (share, skipped)


# --- summary.csv ---------------------------------------------------------------------------


def test_summary_from_markers_and_from_tables_is_the_same(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker with coverage and one without: the cells, and the same file byte for byte
    whether summary.csv is made from the markers or from the tables' summary parts."""
    read: list[str] = []

    def reading(store: Store, keys: list[str], **kw: Any) -> dict[str, Marker | None]:
        read.extend(keys)
        return read_markers(store, keys, **kw)

    monkeypatch.setattr(summary_module, "read_markers", reading)
    dones = analysed(store, [done("new", COVERAGE, 2.0), done("old", None, 3.0)])
    names = ["new", "old"]
    from_markers, rows = summary(store, names)
    assert [(r["params_analysed_share"], r["tensors_skipped"]) for r in rows] == [
        ("0.75", "9"), ("", "")]
    header = list(rows[0])
    assert header.index("params_analysed_share") == header.index("log_alpha_norm_mean") + 1
    assert header.index("tensors_skipped") + 1 == header.index("device")
    assert len(read) == 2
    write_parts(store, dones)
    read.clear()
    from_tables, _ = summary(store, names)
    assert read == []  # every row from the tables' summary parts
    assert from_tables == from_markers


def test_an_older_part_without_the_columns_gives_empty_cells(tmp_path: Path) -> None:
    """A models part written before coverage: no columns for it, a summary part without its
    keys; summary.csv's cells are empty and the part is still read."""
    store = open_store(str(tmp_path / "results"))
    (model,) = analysed(store, [done("new", COVERAGE, 2.0)])
    ((models, layers),) = part_tables([model]).values()
    part = json.loads(models.column("summary_part")[0].as_py())
    del part["params_analysed_share"], part["tensors_skipped"]
    older = models.drop_columns(["params_analysed_share", "tensors_skipped", "coverage"])
    older = older.set_column(older.schema.get_field_index("summary_part"), "summary_part",
                             pa.array([json.dumps(part)], pa.string()))
    write_part(store, "LlamaForCausalLM", older, layers)
    assert table_bytes(older)  # a valid part of the schema less its optional columns
    _, rows = summary(store, ["new"])
    assert (rows[0]["params_analysed_share"], rows[0]["tensors_skipped"]) == ("", "")
    assert rows[0]["alpha_mean"] == "2.5"


def test_the_models_table_types_the_two_numbers() -> None:
    for name, kind in (("params_analysed_share", pa.float64()),
                       ("tensors_skipped", pa.int64()), ("coverage", pa.string())):
        assert MODEL_SCHEMA.field(name).type == kind


# --- the report ----------------------------------------------------------------------------


class Page(html.parser.HTMLParser):
    """A page's headings and the rows (cell texts) of each of its tables, unescaped."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.paragraphs: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._text: list[str] | None = None
        self._tag = ""
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        if tag in ("h2", "p", "td", "th"):
            self._text, self._tag = [], tag

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag != self._tag or self._text is None:
            return
        text = "".join(self._text)
        if tag == "h2":
            self.headings.append(text)
        elif tag == "p":
            self.paragraphs.append(text)
        else:
            self.tables[-1][-1].append(text)
        self._text = None

    def table(self, first: str) -> list[list[str]]:
        """The table whose first row's first cell is `first`."""
        return next(t for t in self.tables if t and t[0] and t[0][0] == first)


def page_of(model: DoneModel) -> tuple[str, Page]:
    row = model.model_row()
    shell = ModelResult(model.marker.model_key, model.marker, [])
    result = with_rows(shell, list(model.layer_rows()))
    text = model_page(result, row, {}, fit=fit_of(PARAMS))
    return text, Page(text)


def test_a_model_page_shows_its_coverage_escaped() -> None:
    text, page = page_of(done("new", COVERAGE, 2.0))
    assert "Coverage" in page.headings
    held = {r[0]: r[1] for r in page.table("tensors held")}
    assert held == {"tensors held": "12", "parameters held": "4000", "analysed tensors": "3",
                    "analysed matrices": "5",
                    "analysed parameters": "3000 (75.0 % of the parameters)"}
    skipped = page.table("skipped by rule")
    assert skipped[1:] == [["norm", "4", "600", "h.0.ln_1.weight"],
                           ["vector", "5", "400", f"h.0.{MARKUP}.bias"]]
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert "Quantization" not in page.headings  # every row read as stored


def test_a_model_page_of_a_marker_before_coverage_says_so() -> None:
    _, page = page_of(done("old", None, 2.0))
    assert "Coverage" in page.headings and NOT_RECORDED in page.paragraphs


def test_a_hostile_coverage_is_shown_as_text() -> None:
    coverage = {"tensors": MARKUP, "analysed": [], "skipped": {MARKUP: {"tensors": MARKUP}}}
    text, page = page_of(done("odd", coverage, 2.0))
    assert "<script>" not in text
    held = {r[0]: r[1] for r in page.table("tensors held")}
    assert held["tensors held"] == MARKUP and held["analysed matrices"] == "–"
    assert page.table("skipped by rule")[1][:2] == [MARKUP, MARKUP]


def test_a_model_page_shows_the_quantization_of_its_layer_rows() -> None:
    _, page = page_of(done("fp8", COVERAGE, 2.0, quantization=QUANTIZED))
    assert "Quantization" in page.headings
    assert page.table("scheme")[1:] == [[QUANTIZED, "1", "h.1.mlp"]]
    assert any("1 read as stored" in p for p in page.paragraphs)


def test_the_report_shows_coverage_in_the_lists_and_on_the_pages(tmp_path: Path) -> None:
    """The whole report from the tables: the index's model lists carry the share (– for a
    marker before coverage), each page its Coverage block and its layer rows' scheme."""
    store = open_store(str(tmp_path / "results"))
    new, old = analysed(store, [done("new", COVERAGE, 2.0, QUANTIZED), done("old", None, 3.0)])
    write_parts(store, [new, old])
    out = tmp_path / "report"
    write_report(ReportSettings(results=str(tmp_path / "results"), out=str(out),
                                esd_layers=1, threads=2))
    index = Page((out / INDEX_NAME).read_text(encoding="utf-8"))
    lists = [t for t in index.tables if t and t[0][:2] == ["#", "model"]]
    assert lists and all(t[0][-1] == SHARE_HEADER for t in lists)
    shares = {row[1]: row[-1] for t in lists for row in t[1:]}
    assert shares == {"org/new": "0.750", "org/old": "–"}
    new_page = Page((out / f"{MODELS_FOLDER}{new.marker.model_key}/{PAGE_NAME}")
                    .read_text(encoding="utf-8"))
    assert new_page.table("scheme")[1:] == [[QUANTIZED, "1", "h.1.mlp"]]
    assert new_page.table("tensors held")[0] == ["tensors held", "12"]
    old_page = Page((out / f"{MODELS_FOLDER}{old.marker.model_key}/{PAGE_NAME}")
                    .read_text(encoding="utf-8"))
    assert NOT_RECORDED in old_page.paragraphs and "Quantization" not in old_page.headings


@pytest.mark.parametrize(("layer", "group"), [
    ("model.layers.3.mlp.experts.12.gate_up_proj",
     "model.layers.3.mlp.experts.*.gate_up_proj"),
    ("model.layers.3.block_sparse_moe.experts.0.w1",
     "model.layers.3.block_sparse_moe.experts.*.w1"),
    ("model.layers.0.block_sparse_moe.input_linear.3",
     "model.layers.0.block_sparse_moe.input_linear.*"),
    ("blk.7.ffn_gate_exps.2", "blk.7.ffn_gate_exps.*"),
])
def test_expert_rows_group_by_layer_and_matrix(layer: str, group: str) -> None:
    assert expert_group(layer) == group


def test_a_model_page_groups_its_experts() -> None:
    """A MoE's rows, one per expert: the page has one line per layer's matrix with the
    experts' count, the fitted ones and α's mean, min and max over those."""
    model = done("moe", COVERAGE, 2.0)
    experts = [{"layer": f"model.layers.{b}.mlp.experts.{i}.down_proj", "layer_type": "Expert",
                "alpha": 2.0 + i + b, "status": "ok" if i < 3 else "too_small", "M": 8,
                "N": 16, "num_params": 128} for b in range(2) for i in range(4)]
    _, page = page_of(DoneModel(model.marker, [*model.layers, *experts]))
    assert "Experts" in page.headings
    assert page.table("layer")[1:] == [
        ["model.layers.0.mlp.experts.*.down_proj", "4", "3", "3.000", "2.000", "4.000"],
        ["model.layers.1.mlp.experts.*.down_proj", "4", "3", "4.000", "3.000", "5.000"],
    ]
    _, plain = page_of(model)
    assert "Experts" not in plain.headings
