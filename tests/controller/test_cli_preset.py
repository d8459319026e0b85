"""`--preset ww` on `esd-sweep run` and `refit`: the run's analysis settings are the preset's
under the flags given, and every worker it starts gets them as explicit flags (a worker never
needs to know the preset: its argv says each setting, and reads back to the same settings)."""

from __future__ import annotations

import pytest

from controller.cli import build_parser, settings_from_args
from esd_worker.core.command.flags import fit_from_args
from esd_worker.core.command.invocation import WorkerInvocation, parse
from esd_worker.core.command.settings import AnalysisSettings

WW = AnalysisSettings(fix_fingers="DKS", precision="float64", include_embeddings=True,
                      min_evals=8)
RUN = ["run", "--model-list", "models.csv", "--output-dir", "out"]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--preset", "ww"], WW),
    (["--preset", "ww", "--precision", "float32"],
     AnalysisSettings(fix_fingers="DKS", include_embeddings=True, min_evals=8)),
    ([], AnalysisSettings()),
])
def test_a_runs_workers_get_the_presets_settings(flags: list[str],
                                                 expected: AnalysisSettings) -> None:
    settings = settings_from_args(build_parser().parse_args([*RUN, *flags]))
    assert settings.analysis == expected
    argv = WorkerInvocation(mode="model", target="m", output="out",
                            analysis=settings.analysis).to_argv()
    assert "--preset" not in argv
    assert parse(argv).analysis == expected


@pytest.mark.parametrize(("flags", "fix_fingers"), [
    (["--preset", "ww"], "DKS"),
    (["--preset", "ww", "--fix-fingers", "xmin_peak"], "xmin_peak"),
    ([], "xmin_mid"),
])
def test_a_refit_takes_the_presets_fit(flags: list[str], fix_fingers: str) -> None:
    args = build_parser().parse_args(["refit", "--output-dir", "out", *flags])
    assert fit_from_args(args).fix_fingers == fix_fingers
