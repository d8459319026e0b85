"""Damaged results: report, refit and compare leave the damaged model out with one line.

The store is the example (the real worker on a tiny GPT-2, a LoRA adapter on it and the real
all-MiniLM-L6-v2), copied and then damaged the ways a disk, a sync or a person damages files:
a truncated or garbage eigs.npz, one byte flipped (same size), a truncated or emptied
layers.csv, a deleted table. Each command must exit 0 for the rest of the models, name the
damaged model on one warning line, print no traceback and never read the damaged numbers.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    """A copy of the example whose base model's `name` is damaged; (store, that key). The
    copy has no results tables: they are copies its workers made of whole files before any
    damage, so the damage is met where the per-model files are read (models no part holds,
    stores from before the tables, `compact`)."""
    store = tmp_path / "results"
    shutil.copytree(master, store, ignore=shutil.ignore_patterns("_tables"))
    key = keys_by_relation(store)["base"]
    damage(store / key / name)
    return store, key


def reported(store: Path) -> list[str]:
    """The keys of the models the report shows: the pages it made (each model of three is
    in the index's top and bottom lists, and each listed model gets its page)."""
    return sorted(p.name for p in (store / "report" / "models").iterdir())


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
    summary = reported(store)
    others = [k for r, k in keys_by_relation(store).items() if r != "base"]
    assert all(k in summary for k in others)
    if name == "layers.csv" or damage is not flip_a_byte:
        # its numbers are not in the report; a file of another size than its seal is seen
        # by the listing, as `status` sees it: the model is not done, so not reported
        assert key not in summary
    else:  # same size: the table is whole, the model stays, without its ESD plot
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


# -- malformed markers ----------------------------------------------------------------------
#
# A marker whose content no worker writes: keys that step out of the model's folder, wrong
# types, missing fields, numbers JSON has no place for. Before: `../../x` as the table's name
# stopped report, refit and compare with exit 3 ("invalid store key"), a NUL in it with a
# traceback; wrong types inside were taken silently. Each leaves its model out with one line.

Edit = Callable[[dict[str, Any]], None]


def setting(path: str, value: Any) -> Edit:
    """Set the marker's field `path` ("outputs.layers") to `value`."""
    *parents, name = path.split(".")

    def edit(doc: dict[str, Any]) -> None:
        for parent in parents:
            doc = doc[parent]
        doc[name] = value
    return edit


def dropping(name: str) -> Edit:
    return lambda doc: doc.pop(name)


MARKER_EDITS: dict[str, Edit] = {
    "table-out-of-the-store": setting("outputs.layers", "../../x"),
    "table-of-another-model": setting("outputs.layers", "../other--model-0123456789/layers.csv"),
    "table-in-a-subfolder": setting("outputs.layers", "sub/layers.csv"),
    "table-dot-dot": setting("outputs.layers", ".."),
    "table-with-a-nul": setting("outputs.layers", "layers\u0000.csv"),
    "table-not-a-string": setting("outputs.layers", ["layers.csv"]),
    "eigs-out-of-the-store": setting("outputs.eigs", "../../eigs.npz"),
    "eigs-empty-name": setting("outputs.eigs", ""),
    "seal-of-a-path": setting("files", {"../../x": {"size": 1, "sha256": "0" * 64}}),
    "key-out-of-the-store": setting("model_key", "../x"),
    "key-of-another-folder": setting("model_key", "other--model-0123456789"),
    "layer-count-a-string": setting("layer_count", "9"),
    "layer-count-negative": setting("layer_count", -1),
    "status-counts-not-counts": setting("status_counts", {"ok": "many"}),
    "summary-not-numbers": setting("summary.alpha_mean", "abc"),
    "summary-a-list": setting("summary", ["alpha_mean"]),
    "timings-not-numbers": setting("timings.total_s", {"s": 1}),
    "no-model": dropping("model"),
    "schema-a-string": setting("schema", "1"),
}
# Malformed as text: what json.dumps would not write.


def replacing(pattern: str, new: str) -> Callable[[str], str]:
    """The marker's text with its one match of `pattern` replaced by `new`."""
    def change(text: str) -> str:
        changed, n = re.subn(pattern, lambda _: new, text)
        assert n == 1, pattern
        return changed
    return change


MARKER_TEXTS: dict[str, Callable[[str], str]] = {
    "nan": replacing(r'"layer_count": \d+', '"layer_count": NaN'),
    "1e999": replacing(r'"layer_count": \d+', '"layer_count": 1e999'),
    "5000-digits": replacing(r'"layer_count": \d+', '"layer_count": ' + "9" * 5000),
    "nested-100000-deep": replacing(r'"adapter": null',
                                    '"adapter": ' + "[" * 100_000 + "]" * 100_000),
    "not-an-object": lambda text: "[]",
    "not-utf8": lambda text: "\udcff",
}
MARKER_CASES = {**{k: ("edit", v) for k, v in MARKER_EDITS.items()},
                **{k: ("text", v) for k, v in MARKER_TEXTS.items()}}


def malformed_copy(master: Path, tmp_path: Path, how: str, change: Any) -> tuple[Path, str]:
    """A copy of the example whose base model's marker is changed; (store, that key)."""
    store = tmp_path / "results"
    shutil.copytree(master, store, ignore=shutil.ignore_patterns("_tables"))  # damaged_copy
    key = keys_by_relation(store)["base"]
    marker = store / key / "result.json"
    if how == "edit":
        doc = json.loads(marker.read_text())
        change(doc)
        marker.write_text(json.dumps(doc, indent=2))
    else:
        text = change(json.dumps(json.loads(marker.read_text())))
        marker.write_bytes(text.encode("utf-8", "surrogateescape"))
    return store, key


# The report reads a marker as refit and compare do (load_marker, then the sealed table), so
# it is run for one case of each kind of damage (a name, a key, a number, the bytes), not for
# all 27: each report draws ~20 plots (3-4 s).
REPORT_CASES = frozenset({"table-out-of-the-store", "key-of-another-folder", "nan",
                          "not-utf8", "seal-of-a-path"})


@pytest.mark.parametrize(("how", "change"), MARKER_CASES.values(), ids=MARKER_CASES.keys())
def test_a_malformed_marker_leaves_its_model_out_of_report_refit_and_compare(
    master: Path, tmp_path: Path, how: str, change: Any,
    capsys: pytest.CaptureFixture[str], restore_logging: None,
    request: pytest.FixtureRequest,
) -> None:
    """Each command exits 0 for the other two models, names the malformed one on one line
    (what to delete to have it analysed again) and never follows the marker's names."""
    from controller.cli import main

    store, key = malformed_copy(master, tmp_path, how, change)
    others = [k for r, k in keys_by_relation(master).items() if r != "base"]

    if request.node.callspec.id in REPORT_CASES:
        assert main(["report", "--output-dir", str(store), "--max-model-plots", "0"]) == 0
        out, err = capsys.readouterr()
        assert "Traceback" not in err and len(warnings_naming(err, key)) == 1, err
        assert f"delete {key}/result.json" in warnings_naming(err, key)[0]
        assert f"report: {len(others)} model(s)" in out

    assert main(["refit", "--output-dir", str(store), "--tag", "again"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(warnings_naming(err, key)) == 1, err
    record = json.loads((store / "refits" / "again.json").read_text())
    assert sorted(record["models"]) == sorted(others)

    out = tmp_path / "diff.csv"
    assert main(["compare", str(master), str(store), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(warnings_naming(err, key)) == 1, err
    diff = out.read_text()
    assert key not in diff and all(k in diff for k in others)
