"""The example results store (the real worker on a tiny GPT-2, a LoRA adapter on it and the real
all-MiniLM-L6-v2), built once per session and shared by the report, refit and compare tests."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

EXAMPLE_DONE = ".example-complete"


def example_results(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    """The example store (module docstring), built by the first caller of the session.

    Returns a read-only master: callers that write (report, refit) copy it first
    (copy_example).
    """
    root = tmp_path_factory.getbasetemp() / "esd-report-example"
    out = root / "results"
    if (root / EXAMPLE_DONE).exists():
        return out
    from tests.support.builders import make_lora_adapter, minilm_path, run_analysis

    shutil.rmtree(root, ignore_errors=True)
    adapter = make_lora_adapter(
        gpt2_dir, root / "tiny-gpt2-lora", target_modules=("c_attn", "c_proj"),
        fan_in_fan_out=True,
    )
    run_analysis(gpt2_dir, out, relation="base")
    run_analysis(adapter, out, relation="adapter")
    run_analysis(minilm_path(), out, relation="finetune")
    (root / EXAMPLE_DONE).write_text("ok\n")
    return out


def copy_example(master: Path, target: Path) -> Path:
    shutil.copytree(master, target)
    return target


def keys_by_relation(results: Path) -> dict[str, str]:
    """relation → model_key of the example store."""
    found = {}
    for marker in results.glob("*/result.json"):
        data = json.loads(marker.read_text())
        found[data["relation"]] = data["model_key"]
    return found


def wired_subparser(command: str, flag: str) -> argparse.ArgumentParser | None:
    """`esd-sweep COMMAND`'s parser when the CLI has it with `flag`, else None (not wired)."""
    from controller import cli

    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(command)
            if sub is not None and any(flag in a.option_strings for a in sub._actions):
                return sub
    return None
