"""The `esd-worker` command: every expected failure is an exit code and one clear line on
stderr, never a traceback; the flags reach the analysis."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from esd_worker import cli
from esd_worker.core.errors import EXIT_DEVICE, EXIT_PERMANENT, EXIT_USAGE
from esd_worker.core.models.naming import model_key
from tests.support.builders import (
    CliResult,
    corrupt_safetensors,
    make_lora_adapter,
    make_peft_adapter,
    make_tensor_model,
    read_result,
    worker_command,
)

pytestmark = pytest.mark.usefixtures("restore_logging")


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> CliResult:
    """cli.main in this process (torch is imported once for the whole test session)."""
    code = cli.main(["--device", "cpu", *argv])
    return CliResult(code, capsys.readouterr().err, Path())


def run_subprocess(*argv: str) -> CliResult:
    """The real console entry point in a fresh interpreter."""
    proc = subprocess.run(
        [*worker_command(), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    return CliResult(proc.returncode, proc.stderr, Path())


def assert_one_clear_line(run: CliResult, code: int, *fragments: str) -> str:
    """Exit code as expected, exactly one error line (the last line), no traceback."""
    assert run.code == code, run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.errors) == 1, run.stderr
    assert run.lines[-1] == run.errors[0]
    for fragment in fragments:
        assert fragment in run.errors[0], run.errors[0]
    return run.errors[0]


# --- usage errors (exit 2) -----------------------------------------------------------------


def test_bad_flag_subprocess(tmp_path: Path) -> None:
    """argparse's usage block is replaced by one line that points at --help."""
    run = run_subprocess("--model", "x", "--output", str(tmp_path), "--bogus")
    line = assert_one_clear_line(run, EXIT_USAGE, "unrecognized arguments: --bogus", "--help")
    assert run.lines == [line]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        pytest.param(["--min-evals", "1"], "argument --min-evals/--min_evals: must be a whole "
                     "number from 2 to", id="min-evals"),
        pytest.param(["--evals-thresh", "nan"], "argument --evals-thresh", id="nan-thresh"),
        pytest.param(["--conv-norm", "0"], "argument --conv-norm", id="conv-norm"),
        pytest.param(["--bins", "0", "--min-evals", "0"], "argument --bins: must be a whole "
                     "number from 1", id="first-of-two"),
        pytest.param(["--fix-fingers", "median"], "invalid choice", id="choice"),
        pytest.param(["--bins", "many"], "argument --bins", id="type"),
        pytest.param(["--cache-budget", "1e999"], "argument --cache-budget", id="cache-budget"),
        pytest.param(["--shard-index", "-1"], "argument --shard-index", id="shard-index"),
    ],
)
def test_bad_settings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], fragment: str
) -> None:
    """A value out of its flag's range is argparse's one-line usage error naming the flag
    (the first such flag: argparse stops there)."""
    with pytest.raises(SystemExit) as exc:
        code = cli.main(["--model", "x", "--output", str(tmp_path), *argv])
        raise SystemExit(code)
    run = CliResult(int(exc.value.code or 0), capsys.readouterr().err, tmp_path)
    assert_one_clear_line(run, EXIT_USAGE, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_device_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Not the command's fault: the same command runs on a node whose GPU works (exit 6,
    which whoever ran the worker retries elsewhere)."""
    code = cli.main(["--model", str(tmp_path), "--output", str(tmp_path / "o"),
                     "--device", "cuda"])
    run = CliResult(code, capsys.readouterr().err, tmp_path)
    assert_one_clear_line(run, EXIT_DEVICE, "CUDA is not available")


# --- permanent model errors (exit 3) -------------------------------------------------------


def test_missing_path_subprocess(tmp_path: Path) -> None:
    """The real console script on a path that does not exist."""
    missing = tmp_path / "no" / "such" / "model"
    run = run_subprocess("--model", str(missing), "--output", str(tmp_path / "out"),
                         "--device", "cpu")
    assert_one_clear_line(run, EXIT_PERMANENT, "model not found: no directory", str(missing))
    assert not list((tmp_path / "out").rglob("*.*"))  # at most the (checked) empty output


def test_corrupt_safetensors(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "corrupt"
    model.mkdir()
    for f in llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    corrupt_safetensors(model)
    run = run_main(capsys, "--model", str(model), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, "corrupt safetensors file model.safetensors")
    assert not (tmp_path / "out" / model_key(str(model)) / "result.json").exists()


def test_truncated_safetensors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A download cut short: the header promises more bytes than the file has."""
    model = make_tensor_model(tmp_path / "cut", {"a.0.p.weight": torch.randn(64, 64)})
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    run = run_main(capsys, "--model", str(model), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, "corrupt")


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        pytest.param({}, "no weights", id="empty-dir"),
        pytest.param({"pytorch_model.bin": b"not a pickle"}, "corrupt or unsafe weights file",
                     id="garbage-bin"),
        pytest.param({"model.safetensors.index.json": b"{not json"}, "corrupt checkpoint index",
                     id="bad-index"),
        pytest.param({"model.safetensors.index.json":
                      b'{"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}'},
                     "names missing shards", id="missing-shard"),
        pytest.param({"adapter_config.json": b"[1, 2]"}, "corrupt adapter_config.json",
                     id="bad-adapter-config"),
    ],
)
def test_bad_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, files: dict[str, bytes], fragment: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name, data in files.items():
        (model / name).write_bytes(data)
    run = run_main(capsys, "--model", str(model), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, fragment)


class _Calls:
    """Pickles as the call `function(*args)`: what a malicious weights file holds."""

    def __init__(self, function: Callable[..., object], *args: object) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.function, self.args


@pytest.mark.parametrize(
    ("function", "named"),
    [
        pytest.param(os.system, f"{os.system.__module__}.system", id="os.system"),
        pytest.param(builtins.exec, "exec", id="builtins.exec"),
    ],
)
def test_weights_file_that_holds_code(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, function: Callable[..., object],
    named: str,
) -> None:
    """A pytorch_model.bin whose pickle calls a function: refused (exit 3) with the real
    reason, the function it names, and no advice to load it with weights_only=False or to
    allowlist the function (torch's own message gives both); the code never ran."""
    ran = tmp_path / "code-ran"
    command = f"touch {ran}" if function is os.system else f"open({str(ran)!r}, 'w')"
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"a.0.p.weight": torch.zeros(4, 4), "extra": _Calls(function, command)},
               model / "pytorch_model.bin")
    run = run_main(capsys, "--model", str(model), "--output", str(tmp_path / "out"))
    line = assert_one_clear_line(run, EXIT_PERMANENT, "unsafe weights file pytorch_model.bin",
                                 f"holds code ({named}), which is not loaded")
    for advice in ("weights_only", "trust", "safe_globals", "allowlist"):
        assert advice not in line
    assert not ran.exists()


def test_lora_ranks_that_disagree(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    """lora_B of rank 3 against lora_A of rank 4: a bad adapter (exit 3, one line naming the
    module and both shapes), not an internal error with a traceback."""
    from safetensors.torch import load_file, save_file

    adapter = make_lora_adapter(llama_dir, tmp_path / "bad", target_modules=("q_proj",))
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] = torch.ones(32, 3)
    save_file(tensors, str(weights))
    run = run_main(capsys, "--model", str(adapter), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, "model.layers.1.self_attn.q_proj",
                          "(4, 32)", "(32, 3)", "ranks disagree")


@pytest.mark.parametrize("kind", ["FOURIERFT", "HRA"])
def test_unknown_adapter_type(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path, kind: str
) -> None:
    """Adapter types not merged, made with peft: exit 3, the message names the type."""
    import peft

    config = (
        peft.FourierFTConfig(target_modules=["q_proj"], n_frequency=16)
        if kind == "FOURIERFT" else peft.HRAConfig(r=2, target_modules=["q_proj"])
    )
    adapter = make_peft_adapter(llama_dir, tmp_path / kind, config)
    run = run_main(capsys, "--model", str(adapter), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, f"adapter type '{kind}' is not supported")


def test_adapter_without_base(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    adapter = make_lora_adapter(
        llama_dir, tmp_path / "orphan", target_modules=("q_proj",),
        base_model_name_or_path=None,
    )
    run = run_main(capsys, "--model", str(adapter), "--output", str(tmp_path / "out"))
    assert_one_clear_line(run, EXIT_PERMANENT, "pass --base-model")
    ok = run_main(capsys, "--model", str(adapter), "--base-model", str(llama_dir),
                  "--output", str(tmp_path / "out"))
    assert ok.code == 0, ok.stderr


# --- an unusable output folder (exit 3: permanent, no retry can fix it) ------------------


def test_output_under_a_regular_file(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    """The output cannot be created (a path under a regular file; works as root too): exit 3,
    not 4 (a retry fails the same way), before any layer is analysed."""
    blocker = tmp_path / "file"
    blocker.write_text("I am a file")
    run = run_main(capsys, "--model", str(llama_dir), "--output", str(blocker / "results"))
    assert_one_clear_line(run, EXIT_PERMANENT, str(blocker), "is not a directory")
    assert "analysed" not in run.stderr


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root can write to a read-only directory")
def test_read_only_output_dir(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        run = run_main(capsys, "--model", str(llama_dir), "--output", str(out))
    finally:
        out.chmod(0o700)
    assert_one_clear_line(run, EXIT_PERMANENT, str(out), "not writable")


# --- success and logging -------------------------------------------------------------------


def test_success_logs_device_diagnostics(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path
) -> None:
    """Old snake_case flags work; the device diagnostics users asked for are logged."""
    run = CliResult(
        cli.main(["--model_id", str(llama_dir), "--output_dir", str(tmp_path), "--no-eigs",
                  "--device", "cpu", "--fix_fingers", "DKS", "--model-key", "custom-key"]),
        capsys.readouterr().err,
        tmp_path,
    )
    assert run.code == 0, run.stderr
    assert run.errors == []
    assert "CUDA_VISIBLE_DEVICES=" in run.stderr
    assert "device used: cpu" in run.stderr
    result = read_result(tmp_path, "custom-key")
    assert result.marker["parameters"]["fix_fingers"] == "DKS"
    assert result.marker["model_key"] == "custom-key"
    assert not (tmp_path / "custom-key" / "eigs.npz").exists()


def test_json_log_format(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--log-format json: every log line is a JSON object (the error among them); the last
    line is still the plain one-line error."""
    run = run_main(capsys, "--model", str(tmp_path / "missing"), "--output", str(tmp_path),
                   "--log-format", "json")
    assert_one_clear_line(run, EXIT_PERMANENT, "model not found")
    records = [json.loads(line) for line in run.lines[:-1]]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert [r["level"] for r in records][-1] == "error"


def test_internal_error_keeps_traceback(
    capsys: pytest.CaptureFixture[str], llama_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug (not a model problem) keeps its traceback for the failure record, then the line."""
    import esd_worker.analysis.analyze

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(esd_worker.analysis.analyze, "analyse_model", broken)
    run = run_main(capsys, "--model", str(llama_dir), "--output", str(tmp_path))
    assert run.code == EXIT_PERMANENT
    assert "Traceback" in run.stderr
    assert run.lines[-1].startswith("esd-worker: error: internal error")
    assert "RuntimeError: boom" in run.lines[-1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("esd-worker ")
