"""The example results store (the real worker on a tiny GPT-2, a LoRA adapter on it and the real
all-MiniLM-L6-v2), built once per session and shared by the results tests; builders of
hand-made results (make_result) and readers of what a report wrote (png_size, Links)."""

from __future__ import annotations

import argparse
import html.parser
import json
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from controller.results.reader import ModelResult
from esd_worker.core.store.layout import write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import layers_to_csv
from esd_worker.core.store.stores import READ_LIMIT, LocalStore, Store
from esd_worker.core.store.tables import DoneModel

EXAMPLE_DONE = ".example-complete"


def analysed(store: Store, dones: Iterable[DoneModel]) -> list[DoneModel]:
    """Each model's own files written as a worker writes them (its layer table, then the
    sealed marker), and the DoneModels of what was written: the rows a worker's part holds,
    which a reader counts because the model's files agree with them."""
    return [DoneModel(write_model_result(store, d.marker, layers=layers_to_csv(d.layers)),
                      d.layers) for d in dones]


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


def make_result(
    alphas: list[float], statuses: list[str] | None = None, **marker: Any
) -> ModelResult:
    """A model `org/m` whose layers l0, l1, … have these α and statuses (default ok);
    `marker`: Marker fields to set (relation, base_model, revision, …)."""
    statuses = statuses or ["ok"] * len(alphas)
    rows = [{"layer": f"l{i}", "alpha": repr(a), "status": s}
            for i, (a, s) in enumerate(zip(alphas, statuses, strict=True))]
    fields: dict[str, Any] = {"model": "org/m", "model_key": "m-0123456789",
                              "model_id": "org/m"} | marker
    return ModelResult(fields["model_key"], Marker(**fields), rows)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after the 8-byte signature)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def png_title(data: bytes) -> str | None:
    """The Title of a PNG's text chunks (tEXt: Latin-1; iTXt, uncompressed: UTF-8), as
    plots.py writes its figure's title there."""
    at = 8
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        at += 12 + length
        if kind == b"tEXt" and body.startswith(b"Title\0"):
            return body[6:].decode("latin-1")
        if kind == b"iTXt" and body.startswith(b"Title\0\0"):  # flag 0: not compressed
            _language, _translated, text = body[8:].split(b"\0", 2)
            return text.decode("utf-8")
    return None


class Links(html.parser.HTMLParser):
    """The href/src references and the element ids of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.refs.append(value)
            if name == "id" and value:
                self.ids.add(value)


class CountingStore(LocalStore):
    """A LocalStore that notes every key it is asked for (`got`): to check what a reader
    did not read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.got: list[str] = []

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        self.got.append(key)
        return super().get_bytes(key, limit=limit)
