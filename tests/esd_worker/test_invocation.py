"""esd_worker.core.command.invocation: a worker command line as a value, and back.

Table-driven: every mode with every flag the controller passes (and the rest the worker
takes). For each, parse(to_argv()) is the value again, and the `esd-worker` command's own
parser (esd_worker.cli.build_parser) takes the argv.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from esd_worker.cli import build_parser
from esd_worker.core.command.invocation import (
    MODEL,
    MODELS,
    SELF_CHECK,
    SERVE,
    SHARDS,
    BatchOptions,
    InvalidInvocation,
    WorkerInvocation,
    parse,
    parse_command,
)
from esd_worker.core.command.settings import AnalysisSettings

STORE = "s3://esd-results/atlas"
TARGETS = {MODEL: "org/model@refs/pr/1", MODELS: "/lists/models.csv",
           SHARDS: f"{STORE}/_shards/r1/gpu1", SERVE: "", SELF_CHECK: ""}

# One change from a mode's plain invocation each: every flag, and the values that are easy
# to get wrong (floats that need repr, a rate said in six digits, a trailing '/').
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "model-key": {"model_key": "org--model--0123456789"},
    "empty-model-key": {"model_key": ""},
    "adapter": {"relation": "lora", "base_model": "org/base@main"},
    "json-logs": {"log_format": "json"},
    "text-logs": {"log_format": "text"},
    "device-cpu": {"device": "cpu"},
    "device-cuda": {"device": "cuda"},
    "device-auto": {"device": "auto"},
    "hub-rate": {"hub_rate": 0.75},
    "hub-rate-whole": {"hub_rate": 3.0},
    "hub-rate-long": {"hub_rate": 10 / 3},
    "analysis": {"analysis": AnalysisSettings(
        fix_fingers="DKS", evals_thresh=1.25e-7, bins=37, min_evals=3, conv_norm=1 / 3,
        precision="float64", include_embeddings=True)},
    "no-eigs": {"save_eigs": False},
    "trust-remote-code": {"trust_remote_code": True},
    "no-parallel-gpu": {"parallel_gpu": False},
    "host-eigensolvers": {"host_eigensolvers": 6},
    "no-host-eigensolvers": {"host_eigensolvers": 0},
    "verbose": {"verbose": True},
    "batch": {"batch": BatchOptions(run_id="20261123T070501Z-3fa9c2", max_retries=0,
                                    prefetch=5, overwrite=True, skip_failed=True)},
    "cache": {"batch": BatchOptions(cache_dir="/cache/models/", cache_budget=50 * 10**9)},
    "watch": {"batch": BatchOptions(model_timeout=90.5, memory_limit=30 * 10**9)},
    "odd-strings": {"model_key": "k; rm -rf ~ $(id)", "relation": "adapter",
                    "base_model": "./base model `x` 'q\" é\u202e|&>x"},
    "everything": {"model_key": "k", "relation": "peft", "base_model": "b", "device": "cuda",
                   "log_format": "json", "hub_rate": 1.5, "save_eigs": False,
                   "trust_remote_code": True, "parallel_gpu": False, "verbose": True,
                   "host_eigensolvers": 3,
                   "batch": BatchOptions(run_id="r", max_retries=7, prefetch=0,
                                         overwrite=True, cache_dir="/c", cache_budget=1)},
}
SHARDS_ONLY = {"shard-index": {"batch": BatchOptions(run_id="r", shard_index=41)}}
CASES = [pytest.param(mode, name, id=f"{mode}-{name}")
         for mode in TARGETS for name in VARIANTS] + [
    pytest.param(SHARDS, name, id=f"{SHARDS}-{name}") for name in SHARDS_ONLY]


def invocation(mode: str, variant: str) -> WorkerInvocation:
    output = "" if mode == SELF_CHECK and variant == "plain" else STORE
    changes = VARIANTS[variant] if variant in VARIANTS else SHARDS_ONLY[variant]
    return replace(WorkerInvocation(mode, TARGETS[mode], output), **changes)


@pytest.mark.parametrize(("mode", "variant"), CASES)
def test_round_trip(mode: str, variant: str) -> None:
    inv = invocation(mode, variant)
    argv = inv.to_argv()
    assert all(isinstance(a, str) for a in argv)
    assert parse(argv) == inv
    assert inv.problems() == []
    assert parse_command(inv.command()) == inv


@pytest.mark.parametrize(("mode", "variant"), CASES)
def test_the_worker_takes_every_argv(mode: str, variant: str) -> None:
    inv = invocation(mode, variant)
    args = build_parser().parse_args(inv.to_argv())
    assert args.output == (inv.output or None)
    assert args.device == inv.device or (inv.device is None and args.device == "auto")
    assert bool(args.serve) == (mode == SERVE) and bool(args.self_check) == (mode == SELF_CHECK)
    assert (args.model, args.models, args.shards) == tuple(
        TARGETS[mode] if mode == m else None for m in (MODEL, MODELS, SHARDS))


def test_one_order_byte_for_byte() -> None:
    """The order Kubernetes Jobs have always held (adoption reads values, but a person
    comparing two Jobs reads the argv)."""
    model = WorkerInvocation(MODEL, "org/m@v1", STORE, model_key="k", log_format="json",
                             device="cuda").for_model("org/lora", key="k2", relation="lora",
                                                      base_model="org/base")
    analysis = ["--fix-fingers", "xmin_mid", "--evals-thresh", "1e-05", "--bins", "100",
                "--min-evals", "10", "--conv-norm", "0.5", "--precision", "float32"]
    assert model.command() == [
        "esd-worker", "--model", "org/lora", "--output", STORE, "--model-key", "k2",
        "--log-format", "json", "--device", "cuda", "--relation", "lora",
        "--base-model", "org/base", *analysis]
    shards = WorkerInvocation(
        SHARDS, f"{STORE}/_shards/r/gpu1", STORE, log_format="json", device="cpu",
        hub_rate=3 / 7, save_eigs=False,
        batch=BatchOptions(run_id="r", overwrite=True, cache_dir="/cache/models",
                           cache_budget=123))
    assert shards.to_argv() == [
        "--shards", f"{STORE}/_shards/r/gpu1", "--output", STORE, "--log-format", "json",
        "--device", "cpu", "--run-id", "r", "--max-retries", "2", "--prefetch", "1",
        "--overwrite", "--hub-rate", "0.428571", "--cache-dir", "/cache/models",
        "--cache-budget", "123", *analysis, "--no-eigs"]


def test_left_out_is_not_the_default() -> None:
    """No --device or --log-format reads as None (the flag left out again), whatever
    $ESD_LOG_FORMAT the reader has; the batch flags of a batch mode are always said."""
    inv = parse(["--serve", "--output", STORE])
    assert (inv.device, inv.log_format) == (None, None)
    assert inv.to_argv()[:7] == ["--serve", "--output", STORE, "--max-retries", "2",
                                 "--prefetch", "1"]


def test_aliases_read_as_their_flag() -> None:
    inv = parse(["--model-id", "org/m", "--output-dir", STORE, "--source-model", "org/b",
                 "--base_model_relation", "lora", "--parallel-esd", "--no_eigs"])
    assert inv == WorkerInvocation(MODEL, "org/m", STORE, relation="lora",
                                   base_model="org/b", save_eigs=False)


@pytest.mark.parametrize("argv", [
    [], ["--model", "x"], ["--model", "x", "--models", "y", "--output", STORE],
    ["--model", "x", "--output", STORE, "--device", "tpu"],
    ["--model", "x", "--output", STORE, "--max-retries", "101"],
    ["--model", "x", "--output", STORE, "--hub-rate", "nan"],
    ["--model", "x", "--output", STORE, "--shard-index", "1"],
    ["--model", "", "--output", STORE], ["--help"], ["--version"], ["--bogus"],
], ids=repr)
def test_what_the_worker_refuses_is_refused_quietly(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidInvocation):
        parse(argv)
    assert capsys.readouterr() == ("", "")


def test_a_command_of_another_program_is_refused() -> None:
    with pytest.raises(InvalidInvocation, match="esd-worker"):
        parse_command(["python", "--model", "x", "--output", STORE])


@pytest.mark.parametrize(("inv", "problem"), [
    (WorkerInvocation(MODEL, "", STORE), "target: model needs one"),
    (WorkerInvocation(SERVE, "x", STORE), "target: serve takes none"),
    (WorkerInvocation(SHARDS, "u", ""), "output"),
    (WorkerInvocation("batch", "", STORE), "mode"),
    (WorkerInvocation(MODEL, "m", STORE, device="gpu"), "device"),
    (WorkerInvocation(MODEL, "m", STORE, log_format="xml"), "log_format"),
    (WorkerInvocation(MODEL, "m", STORE, batch=BatchOptions(shard_index=2)), "shard_index"),
    (WorkerInvocation(MODEL, "m\n--device", STORE), "target"),
    (WorkerInvocation(MODEL, "m", STORE, model_key="k\r"), "model_key"),
    (WorkerInvocation(SERVE, "", STORE, batch=BatchOptions(cache_dir="/x\n--y")),
     "batch.cache_dir"),
    (WorkerInvocation(SERVE, "", STORE, batch=BatchOptions(max_retries=-1)), "max-retries"),
    (WorkerInvocation(MODEL, "m", STORE, analysis=AnalysisSettings(bins=0)), "bins"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_problems_name_the_field(inv: WorkerInvocation, problem: str) -> None:
    assert any(problem in p for p in inv.problems()), inv.problems()


def test_no_argv_for_a_mode_without_its_target() -> None:
    with pytest.raises(InvalidInvocation, match="target"):
        WorkerInvocation(MODEL, "", STORE).to_argv()
