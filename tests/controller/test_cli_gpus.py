"""`esd-sweep run`'s GPU-rule flags: --gpus-per-job N|auto, --multi-gpu-minutes,
--max-gpus-per-job, with --no-parallel-gpu; their settings, their errors, and what a local
--dry-run says about a list whose num_params column names a 405B model."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import build_parser, main, settings_from_args
from controller.gpu.gpurule import GpuRule
from controller.settings import SweepSettings

pytestmark = pytest.mark.usefixtures("restore_logging")


def settings_for(*flags: str) -> SweepSettings:
    args = build_parser().parse_args(["run", "--single-model", "org/m", "--output-dir",
                                      "/tmp/out", *flags])
    return settings_from_args(args)


@pytest.mark.parametrize(("flags", "rule", "tracker_n"), [
    ((), GpuRule(), 1),
    (("--gpus-per-job", "auto"), GpuRule(), 1),
    (("--gpus-per-job", "2"), GpuRule(explicit=2), 2),
    (("--num_gpus_per_job", "3"), GpuRule(explicit=3), 3),  # the old spelling
    (("--multi-gpu-minutes", "45", "--max-gpus-per-job", "4"),
     GpuRule(multi_gpu_minutes=45, max_gpus_per_job=4), 1),
], ids=["default-auto", "auto", "explicit", "old-spelling", "threshold-and-cap"])
def test_flags_to_settings(flags: tuple[str, ...], rule: GpuRule, tracker_n: int) -> None:
    """auto is the default; an explicit N is also what the GPU tracker checks against."""
    settings = settings_for(*flags)
    assert settings.gpu_rule == rule
    assert settings.gpu.gpus_per_job == tracker_n


def test_no_parallel_gpu_makes_auto_give_one() -> None:
    applied = settings_for("--no-parallel-gpu").applied_gpu_rule
    assert not applied.auto and applied.gpus(None, cap=8) == 1
    assert settings_for("--no-parallel-gpu", "--gpus-per-job", "2").applied_gpu_rule.base == 2


@pytest.mark.parametrize(("flags", "why"), [
    (("--multi-gpu-minutes", "0"), "must be a number > 0 and <= 10080 minutes, got '0'"),
    (("--max-gpus-per-job", "0"), "must be a whole number from 1 to 64, got '0'"),
    (("--gpus-per-job", "many"), "must be a whole number from 0 to 64, or 'auto', got 'many'"),
], ids=["threshold", "cap", "not-a-number"])
def test_bad_values_are_usage_errors_naming_the_flag(
        flags: tuple[str, ...], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the flag's range (esd_worker.core.command.flags.Number) as argparse's usage
    error: a
    week of minutes, at most 64 GPUs a model (several nodes'), or auto."""
    with pytest.raises(SystemExit) as e:
        settings_for(*flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}" in err and why in err


def test_local_dry_run_marks_the_model_that_gets_several_gpus(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    models = tmp_path / "models.csv"
    models.write_text("model_id,num_params,matrix_dim\norg/small,125e6,768\n"
                      "org/huge,405B,16384\n")
    code = main(["run", "--model-list", str(models), "--output-dir", str(tmp_path / "out"),
                 "--dry-run", "--multi-gpu-minutes", "30"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# --gpus-per-job auto")
    assert "--model org/small " in lines[1]
    assert lines[2].startswith("# gpus=3: model=org/huge: ~405.0B params, largest matrix "
                               "16384, est ~72 GPU-min on one GPU")
    assert "--model org/huge " in lines[3]


@pytest.mark.parametrize(("flags", "expected", "argv"), [
    ((), None, []),
    (("--host-eigensolvers", "0"), 0, ["--host-eigensolvers", "0"]),
    (("--host-eigensolvers", "12"), 12, ["--host-eigensolvers", "12"]),
], ids=["default", "off", "twelve"])
def test_host_eigensolvers_reach_every_worker(flags: tuple[str, ...], expected: int | None,
                                              argv: list[str]) -> None:
    """The flag goes to each GPU worker's command line as given; left out, the worker
    decides from its CPU quota (esd_worker.analysis.hostsolve)."""
    from controller.run.sweep import worker_spec
    from esd_worker.core.command.invocation import SERVE, SHARDS, parse

    settings = settings_for(*flags)
    assert settings.host_eigensolvers == expected
    spec = worker_spec(settings, "run-1", "/tmp/out")
    for mode, target in ((SERVE, ""), (SHARDS, "s3://b/shards")):
        got = spec.invocation(mode, target).to_argv()
        tail = got[got.index("--host-eigensolvers"):][:2] if argv else []
        assert tail == argv and ("--host-eigensolvers" in got) == bool(argv)
        assert parse(got).host_eigensolvers == expected


def test_host_eigensolvers_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    with pytest.raises(SystemExit) as raised:
        settings_for("--host-eigensolvers", "-1")
    assert raised.value.code == 2
    assert "--host-eigensolvers" in capsys.readouterr().err
