"""Issue 41's acceptance: a zoo of tiny random-weight checkpoints of every family the worker
claims (dense and MoE LLMs, encoders, speech, vision, multimodal, formats, components,
quantized schemes, peft methods), built here with their own libraries (tests/zoo), analysed
by ONE `esd-worker --models` process, and judged entry by entry against what each entry's
library holds (tests.zoo.checker): none wrong, none silently partial, at least 95% analysed
correctly (or refused where the zoo expects a refusal), each expected refusal refused.

The checker's own rules are tested first, on synthetic rows, so that a pass of the zoo means
what it says: a λ_max 2e-4 off is wrong, a matrix in no row is partial, a warning makes a
partial noted, one matrix in two rows leaves the other uncovered, fused experts are covered
by their halves, a Conv2d row is the pooled conv_norm-scaled spectrum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.zoo.catalog import Entry
from tests.zoo.checker import (
    CORRECT,
    CRASHED,
    NOTED,
    REFUSED,
    SILENT,
    UNKNOWN,
    WRONG,
    _failed,
    judge,
)
from tests.zoo.library import CONV2D, EMBEDDING, EXPERT, MATRIX, lam_max, units_of

ENTRY = Entry("synthetic", "test", Path("/nowhere"), "transformers")


def _row(name: str, w: torch.Tensor, lam: float | None = None, status: str = "ok"
         ) -> dict[str, str]:
    m, n = (w.shape[0], w.shape[1])
    value = lam_max(w) if lam is None else lam
    return {"layer": name, "M": str(m), "N": str(n), "status": status,
            "spectral_norm": "nan" if status == "too_small" else repr(value)}


def _coverage(rules: dict[str, int], warning: str | None = None, unexplained: int = 0
              ) -> dict[str, Any]:
    analysed = 6  # _rows' six rows
    held = analysed + sum(rules.values()) + unexplained
    return {"tensors": held, "parameters": 0,
            "analysed": {"tensors": analysed, "parameters": 0, "matrices": analysed},
            "skipped": {r: {"tensors": n, "parameters": 0, "example": "x"}
                        for r, n in rules.items()},
            "unexplained": {"tensors": unexplained, "parameters": 0, "examples": []},
            "warning": warning}


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(24, 16, generator=gen), "b": torch.randn(24, 16, generator=gen),
            "emb": torch.randn(40, 16, generator=gen),
            "experts": torch.randn(2, 20, 16, generator=gen),  # gate_up: 2 × (10, 16)
            "conv": torch.randn(12, 14, 3, 3, generator=gen)}


def _units(w: dict[str, torch.Tensor]) -> list[Any]:
    return [*units_of("a", w["a"], MATRIX, conv_norm=0.5, typed=True),
            *units_of("b", w["b"], MATRIX, conv_norm=0.5, typed=True),
            *units_of("emb", w["emb"], EMBEDDING, conv_norm=0.5),
            *units_of("mlp.experts.gate_up_proj", w["experts"], EXPERT, conv_norm=0.5),
            *units_of("conv", w["conv"], CONV2D, conv_norm=0.5)]


def _rows(w: dict[str, torch.Tensor]) -> list[dict[str, str]]:
    conv = max(lam_max(w["conv"][:, :, i, j]) for i in range(3) for j in range(3)) * 0.5
    e = w["experts"]
    return [_row("x.a", w["a"]), _row("x.b", w["b"].t()),  # either orientation
            _row("e.0.gate", e[0, :10]), _row("e.0.up", e[0, 10:]), _row("e.1", e[1]),
            _row("c", w["conv"][:, :, 0, 0], conv)]


def test_the_checker_passes_a_faithful_analysis(weights: dict[str, torch.Tensor]) -> None:
    marker = {"coverage": _coverage({"embedding": 1})}
    got = judge(ENTRY, marker, _rows(weights), _units(weights))
    assert got.outcome == CORRECT, got.details


def test_the_checker_finds_a_wrong_number(weights: dict[str, torch.Tensor]) -> None:
    rows = _rows(weights)
    rows[0]["spectral_norm"] = repr(float(rows[0]["spectral_norm"]) * (1 + 2e-4))
    got = judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, rows, _units(weights))
    assert got.outcome == WRONG and "x.a" in got.cause


def test_the_checker_finds_what_is_left_out(weights: dict[str, torch.Tensor]) -> None:
    units, rows = _units(weights), _rows(weights)
    quiet = judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, rows[1:], units)
    assert quiet.outcome == SILENT and "a (matrix)" in quiet.details[0]
    said = judge(ENTRY, {"coverage": _coverage({"embedding": 1}, "1 tensor unexplained", 1)},
                 rows[1:], units)
    assert said.outcome == NOTED
    # The embedding skipped under no rule coverage lists; coverage absent altogether.
    assert judge(ENTRY, {"coverage": _coverage({})}, rows, units).outcome == SILENT
    assert judge(ENTRY, {"coverage": None}, rows, units).outcome == UNKNOWN
    assert judge(ENTRY, {"coverage": None}, rows[1:], units).outcome == SILENT
    # Counts that do not add up are no accounting.
    broken = _coverage({"embedding": 1})
    broken["tensors"] += 1
    assert judge(ENTRY, {"coverage": broken}, rows, units).outcome == SILENT


def test_one_matrix_twice_does_not_cover_another(weights: dict[str, torch.Tensor]) -> None:
    units, rows = _units(weights), _rows(weights)
    twice = [rows[0], {**rows[0], "layer": "x.b"}, *rows[2:]]
    got = judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, twice, units)
    assert got.outcome == WRONG and "x.b" in got.cause
    # One half of a fused expert is not the expert.
    half = [r for r in rows if r["layer"] != "e.0.up"]
    got = judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, half, units)
    assert got.outcome == SILENT and "gate_up_proj[0]" in got.details[0]


def test_too_small_rows_match_by_shape_and_conv_needs_the_scale(
    weights: dict[str, torch.Tensor],
) -> None:
    units, rows = _units(weights), _rows(weights)
    small = [*rows[:-1], _row("c", weights["conv"][:, :, 0, 0], status="too_small")]
    got = judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, small, units)
    assert got.outcome == CORRECT, got.details
    unscaled = [*rows[:-1], {**rows[-1], "spectral_norm": repr(float(rows[-1]["spectral_norm"])
                                                               * 2)}]
    assert judge(ENTRY, {"coverage": _coverage({"embedding": 1})}, unscaled,
                 units).outcome == WRONG


def test_a_refusal_is_one_clean_line() -> None:
    entry = Entry("p", "adapter", Path("/p"), "peft", refusal="no weight changes")
    clean = {"error": "UnsupportedAdapterError: adapter type PROMPT_TUNING changes no weight",
             "exit_code": 3, "retryable": False}
    assert _failed(entry, clean).outcome == REFUSED
    bug = {"error": "KeyError: 'x' (internal error analysing /p: a bug)", "exit_code": 3,
           "retryable": False}
    assert _failed(entry, bug).outcome == CRASHED
    assert _failed(entry, {**clean, "exit_code": 4, "retryable": True}).outcome == CRASHED


# --- the zoo ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The zoo built once a session, analysed by one worker, every entry judged."""
    from tests.zoo.run import run_zoo

    return run_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.mark.slow
def test_the_zoo_is_built_and_analysed_correctly(zoo_run: Any) -> None:
    """One test (under xdist the session fixture would run once per test process)."""
    from tests.zoo.run import markdown_table

    table = markdown_table(zoo_run)
    missing = [f"{o.entry.name}: {o.cause}" for o in zoo_run.outcomes
               if o.entry.not_built is not None and not o.entry.optional]
    assert not missing, "not built:\n" + "\n".join(missing) + "\n\n" + table
    bad = [o for o in zoo_run.outcomes if o.outcome in (WRONG, SILENT)]
    unrefused = [o.entry.name for o in zoo_run.outcomes
                 if o.entry.refusal is not None and o.outcome != REFUSED]
    assert not bad, f"{len(bad)} wrong or silently partial\n\n{table}"
    assert not unrefused, f"expected refusals not refused: {unrefused}\n\n{table}"
    assert zoo_run.share >= 0.95, f"{zoo_run.share:.1%} as expected (< 95%)\n\n{table}"
