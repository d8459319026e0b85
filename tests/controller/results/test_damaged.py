"""Damaged results: report, refit and compare leave the damaged model out with one line.

The store is the example (the real worker on a tiny GPT-2, a LoRA adapter on it and the real
all-MiniLM-L6-v2), copied and then damaged the ways a disk, a sync or a person damages files:
a truncated or garbage eigs.npz, one byte flipped (same size), a truncated or emptied
layers.csv, a deleted table. Each command must exit 0 for the rest of the models, name the
damaged model on one warning line, print no traceback and never read the damaged numbers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.results import example_results, keys_by_relation

Damage = Callable[[Path], None]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    path.write_bytes(b"this is not what the worker wrote\n" * 3)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def first_lines(path: Path) -> None:
    """A table cut after its header and three rows (a partial copy)."""
    path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:4]))


def nan_row(path: Path) -> None:
    header = path.read_bytes().splitlines(keepends=True)[0]
    cells = header.decode().strip().split(",")
    path.write_bytes(header + (",".join("nan" for _ in cells) + "\n").encode())


CASES = [
    ("eigs.npz", truncate),
    ("eigs.npz", garbage),
    ("eigs.npz", flip_a_byte),
    ("layers.csv", first_lines),
    ("layers.csv", nan_row),
    ("layers.csv", flip_a_byte),
    ("layers.csv", garbage),
]
IDS = [f"{name}-{damage.__name__}" for name, damage in CASES]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    return example_results(tmp_path_factory, gpt2_dir)


def damaged_copy(master: Path, tmp_path: Path, name: str, damage: Damage) -> tuple[Path, str]:
    """A copy of the example whose base model's `name` is damaged; (store, that key)."""
    store = tmp_path / "results"
    shutil.copytree(master, store)
    key = keys_by_relation(store)["base"]
    damage(store / key / name)
    return store, key


def warnings_naming(err: str, key: str) -> list[str]:
    return [line for line in err.splitlines() if key in line and "left out" in line]


@pytest.mark.parametrize(("name", "damage"), CASES, ids=IDS)
def test_report_leaves_the_damaged_model_out(
    master: Path, tmp_path: Path, name: str, damage: Damage,
    capsys: pytest.CaptureFixture[str], restore_logging: None,
) -> None:
    from controller.cli import main

    store, key = damaged_copy(master, tmp_path, name, damage)
    assert main(["report", "--output-dir", str(store)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(warnings_naming(err, key)) == 1, err
    summary = (store / "report" / "summary.csv").read_text()
    others = [k for r, k in keys_by_relation(store).items() if r != "base"]
    assert all(k in summary for k in others)
    if name == "layers.csv":  # its numbers are not in the report
        assert key not in summary
    else:  # the table is whole: the model stays, without the ESD plot of its eigenvalues
        assert key in summary
        assert not (store / "report" / "models" / key / "esd.png").exists()


@pytest.mark.parametrize(("name", "damage"), CASES, ids=IDS)
def test_refit_leaves_the_damaged_model_out(
    master: Path, tmp_path: Path, name: str, damage: Damage,
    capsys: pytest.CaptureFixture[str], restore_logging: None,
) -> None:
    from controller.cli import main

    store, key = damaged_copy(master, tmp_path, name, damage)
    assert main(["refit", "--output-dir", str(store), "--tag", "again"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(warnings_naming(err, key)) == 1, err
    record = json.loads((store / "refits" / "again.json").read_text())
    assert key not in record["models"] and len(record["models"]) == 2
    assert not (store / key / "layers.again.csv").exists()
    if name == "eigs.npz":
        assert record["skipped_damaged"] == [key]


@pytest.mark.parametrize(("name", "damage"), CASES[3:], ids=IDS[3:])
def test_compare_leaves_the_damaged_model_out(
    master: Path, tmp_path: Path, name: str, damage: Damage,
    capsys: pytest.CaptureFixture[str], restore_logging: None,
) -> None:
    """B's base is damaged: comparing A's models with B's, by key, leaves it out."""
    from controller.cli import main

    store, key = damaged_copy(master, tmp_path, name, damage)
    out = tmp_path / "diff.csv"
    assert main(["compare", str(master), str(store), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert len(warnings_naming(captured.err, key)) == 1, captured.err
    diff = out.read_text()
    others = [k for r, k in keys_by_relation(store).items() if r != "base"]
    assert key not in diff and all(k in diff for k in others)
