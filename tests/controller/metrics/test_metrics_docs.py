"""docs/operations.md ("Metrics") lists exactly the metrics the run's registry exports, with
their types; every PromQL expression of docs/grafana/esd-sweep.json names only those."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from controller.metrics.runmetrics import RunMetrics
from tests.support import REPO_ROOT

# How each family's name is exported (prometheus_client writes an Info as a gauge).
_EXPORTED = {"counter": "{}_total", "info": "{}_info"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
_DOC_TYPE = {"info": "gauge"}


def families() -> dict[str, str]:
    """Exported name → type, as the registry collects them."""
    registry = RunMetrics(run_id="r", backend="local", version="1").registry
    return {_EXPORTED.get(f.type, "{}").format(f.name): f.type for f in registry.collect()}


def series_names() -> set[str]:
    """Every series name a query may use: the exported names and a histogram's series."""
    names: set[str] = set()
    for name, kind in families().items():
        names.add(name)
        if kind == "histogram":
            names.update(name + suffix for suffix in _SUFFIXES["histogram"])
    return names


def doc_rows() -> dict[str, str]:
    """The Metrics section's table: metric name → its type column."""
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(esd_sweep_[a-z_]+)` \| ([a-z]+)", section, re.MULTILINE)
    assert len(rows) == len(dict(rows)), "a metric listed twice"
    return dict(rows)


def test_the_operations_doc_lists_exactly_the_exported_metrics() -> None:
    expected = {name: _DOC_TYPE.get(kind, kind) for name, kind in families().items()}
    assert doc_rows() == expected


def _expressions(node: Any) -> Iterator[str]:
    """Every `expr` of the dashboard's targets and every variable query, however nested."""
    if isinstance(node, dict):
        for key, item in node.items():
            # A variable's `query` is a string (a PromQL function) or an object with one.
            if isinstance(item, str) and (key in ("expr", "definition")
                                          or (key == "query" and "(" in item)):
                yield item
            else:
                yield from _expressions(item)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def test_the_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((REPO_ROOT / "docs" / "grafana" / "esd-sweep.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    exprs = list(_expressions(dashboard["panels"])) + list(_expressions(variables))
    targets = [t for p in dashboard["panels"] for t in p["targets"]]
    assert targets and all(t["datasource"]["uid"] == "${datasource}" for t in targets)
    used = {name for e in exprs for name in re.findall(r"\besd_sweep_[a-z_]+", e)}
    assert used and used <= series_names(), used - series_names()
    # Every metric the dashboard is for appears in some panel.
    for wanted in ("esd_sweep_models", "esd_sweep_models_done_total",
                   "esd_sweep_failures_total", "esd_sweep_class_models",
                   "esd_sweep_downloaded_bytes_total", "esd_sweep_device_busy_ratio"):
        assert wanted in used
