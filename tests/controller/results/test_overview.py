"""controller.results.overview: the report's numbers of all models from the results tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.results.overview import build_overview
from controller.results.tables import Tables
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.stores import LocalStore
from esd_worker.core.store.tables import DoneModel, write_parts
from tests.support.results import analysed

ARCHS = ["LlamaForCausalLM", "GPT2LMHeadModel", "BertModel"]


def done(i: int, alpha: float) -> DoneModel:
    marker = Marker(model=f"org/m{i}", model_key=f"m{i:03d}", model_id=f"org/m{i}",
                    architecture=ARCHS[i % 3], finished_at="2026-01-01",
                    timings={"total_s": 1}, relation="finetune" if i % 2 else "",
                    parameters={"evals_thresh": 1e-5})
    rows = [{"layer": f"h.{j}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": alpha,
             "status": "ok"} for j in range(3)]
    return DoneModel(marker, rows)


def test_overview_counts_groups_top_and_outliers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    alphas = [3.0 + 0.01 * i for i in range(60)]
    alphas[7] = 19.0  # far from the rest: an outlier
    write_parts(store, analysed(store, [done(i, a) for i, a in enumerate(alphas)]))
    view = build_overview(Tables(store), n=5)
    assert (view.models, view.layers) == (60, 180)
    assert sum(view.families.values()) == 60 and len(view.families) == 3
    assert view.relations == {"finetune": 30, "unknown": 30}
    text, others = view.common_parameters
    assert "evals_thresh" in text and others == 0
    by_family = dict(view.hists["alpha_mean"]["family"].ordered())
    assert by_family["all"].count == 60 and sum(
        h.count for name, h in by_family.items() if name != "all") == 60
    assert view.top["alpha_mean"].rows()[0] == ("m007", pytest.approx(19.0))
    assert view.bottom["alpha_mean"].rows()[0] == ("m000", pytest.approx(3.0))
    assert [k for k, _ in view.outliers["alpha_mean"].rows()] == ["m007"]
    layer_hist = dict(view.layer_alpha.ordered())
    assert layer_hist["all"].count == 180 and "unknown" not in layer_hist
