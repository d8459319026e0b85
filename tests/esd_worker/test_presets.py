"""Presets (esd_worker/core/command/presets.py): a preset fills the analysis flags not given,
explicit flags win, a stored result's parameters name their preset, and the fit label says
how a table was fitted."""

from __future__ import annotations

from typing import Any

import pytest

from esd_worker.core.command.presets import band_applies, fit_label, preset_of, settings_with
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.command.workerparser import build_parser

WW = AnalysisSettings(fix_fingers="DKS", precision="float64", include_embeddings=True,
                      min_evals=8)


@pytest.mark.parametrize(("flags", "expected"), [
    ([], AnalysisSettings()),
    (["--preset", "ww"], WW),
    (["--preset", "ww", "--fix-fingers", "xmin_mid"],
     AnalysisSettings(fix_fingers="xmin_mid", precision="float64", include_embeddings=True,
                      min_evals=8)),
    (["--preset", "ww", "--min-evals", "10"],
     AnalysisSettings(fix_fingers="DKS", precision="float64", include_embeddings=True)),
    (["--fix-fingers", "DKS", "--precision", "float64", "--include-embeddings",
      "--min-evals", "8"], WW),
    (["--bins", "50", "--evals-thresh", "0.001"], AnalysisSettings(bins=50, evals_thresh=1e-3)),
])
def test_a_preset_fills_the_flags_not_given(flags: list[str], expected: AnalysisSettings) -> None:
    from esd_worker.core.command.flags import analysis_from_args

    args = build_parser().parse_args(["--model", "m", "--output", "o", *flags])
    assert analysis_from_args(args) == expected


def test_an_unknown_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--model", "m", "--output", "o", "--preset", "nope"])
    assert e.value.code == 2
    assert "--preset" in capsys.readouterr().err


@pytest.mark.parametrize(("parameters", "preset"), [
    (WW.as_dict(), "ww"),
    (AnalysisSettings().as_dict(), None),
    (AnalysisSettings(fix_fingers="DKS", precision="float64").as_dict(), None),
    (WW.as_dict() | {"bins": 50}, None),
    (WW.as_dict() | {"a_field_from_a_newer_version": 1}, "ww"),
    (None, None),
    ({}, None),
])
def test_stored_parameters_name_their_preset(parameters: dict[str, Any] | None,
                                             preset: str | None) -> None:
    assert preset_of(parameters) == preset


@pytest.mark.parametrize(("parameters", "refit", "label"), [
    (WW.as_dict(), None, "preset ww (DKS, float64, embeddings)"),
    (AnalysisSettings().as_dict(), None, "fit xmin_mid, float32"),
    (AnalysisSettings().as_dict(), "DKS", "fit DKS, float32"),
    (AnalysisSettings(precision="float64", include_embeddings=True, min_evals=8).as_dict(),
     "DKS", "preset ww (DKS, float64, embeddings)"),
    (None, None, "fit ?, ?"),
])
def test_the_fit_label(parameters: dict[str, Any] | None, refit: str | None,
                       label: str) -> None:
    assert fit_label(parameters, fix_fingers=refit) == label


@pytest.mark.parametrize(("fix_fingers", "applies"), [
    ("DKS", True), ("xmin_mid", False), ("xmin_peak", False), (None, False),
])
def test_weightwatchers_band_applies_to_its_fit_only(fix_fingers: str | None,
                                                     applies: bool) -> None:
    assert band_applies(fix_fingers) is applies


def test_settings_with_keeps_the_defaults_without_a_preset() -> None:
    assert settings_with(None, {"bins": None}) == AnalysisSettings()
