"""Tests of controller.results.html: the report page from hand-made results.

The page of a real report (every link resolves to a written file) is tested in test_report.
"""

from __future__ import annotations

from typing import Any

import pytest

from controller.results import html
from controller.results.reader import ModelResult
from esd_worker.core.store.marker import BaseModelRef
from tests.support.results import Links, make_result


def _model(key: str, model: str, **marker: Any) -> ModelResult:
    return make_result([2.5], model=model, model_key=key, model_id=model, **marker)


def _page(results: list[ModelResult], plots: dict[str, dict[str, str]], **kw: Any) -> str:
    summaries = [{"layers": 1, "layers_ok": 1, "alpha_mean": 2.5} for _ in results]
    bases = kw.pop("bases", {})
    return html.index_html(results, summaries, bases, plots, source="s3://b/<x>", tag=None,
                           max_model_plots=kw.pop("max_model_plots", 50), layers=len(results))


def test_page_links_models_plots_and_bases() -> None:
    """A plotted model's name links to its section; an adapter's base, in the table, links to
    the base's row; every in-page link has its target; text is escaped."""
    base = _model("base-key", "org/base", relation="base")
    adapter = _model("lora-key", "org/lo<ra>", adapter={"r": 8},
                     base_model=BaseModelRef("org/base"))
    plots = {"base-key": {"α per layer": f"{html.MODELS_FOLDER}base-key/{html.ALPHA_PLOT}"}}
    page = _page([base, adapter], plots, bases={"lora-key": "base-key"})
    links = Links()
    links.feed(page)
    anchors = {r[1:] for r in links.refs if r.startswith("#")}
    assert anchors == {"base-key", "row-base-key"}
    assert anchors <= links.ids
    assert f"models/base-key/{html.ALPHA_PLOT}" in links.refs
    assert {html.SUMMARY_NAME, html.PARQUET_NAME, html.RELATION_PLOT} <= set(links.refs)
    assert "org/lo&lt;ra&gt;" in page and "s3://b/&lt;x&gt;" in page
    assert "Per-model plots for the first 1 of 2 models" in page


@pytest.mark.parametrize(
    ("value", "digits", "text"),
    [(None, 3, "–"), ("", 3, "–"), ("nan", 3, "–"), (2.5, 3, "2.500"), ("7", 0, "7"),
     (0.123456, 2, "0.12")],
)
def test_cells(value: Any, digits: int, text: str) -> None:
    """Missing and NaN as a dash; counts without decimals."""
    assert html._fmt(value, digits) == text


def test_long_tables_are_cut_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past INDEX_TABLE_MAX rows the table stops; the page points to summary.csv."""
    monkeypatch.setattr(html, "INDEX_TABLE_MAX", 2)
    results = [_model(f"k{i}", f"org/m{i}") for i in range(3)]
    page = _page(results, {})
    assert "The table lists the first 2 of 3 models" in page
    assert 'id="row-k1"' in page and 'id="row-k2"' not in page
