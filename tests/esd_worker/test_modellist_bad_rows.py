"""Bad rows of a model list: one line each, naming the line and the problem; the rest still run."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from esd_worker.core.models.modellist import (
    ADAPTER_RELATIONS,
    read_model_list,
)
from tests.support.modellist import GOOD, HEADER, make_adapter_dir, write_list

# --- bad rows -------------------------------------------------------------------------------



@pytest.mark.parametrize(
    ("row", "expected"),
    [
        pytest.param(",base,", "empty model id", id="empty-id"),
        pytest.param("   ,base,", "empty model id", id="blank-id"),
        pytest.param("org/na me,,", "malformed model id 'org/na me'", id="space-in-id"),
        pytest.param("a/b/c,,", "malformed model id 'a/b/c'", id="three-parts"),
        pytest.param("-org/name,,", "malformed model id '-org/name'", id="leading-dash"),
        pytest.param("org--x/name,,", "'--' and '..' are not allowed", id="double-dash"),
        pytest.param("org/name.git,,", "must not end with '.git'", id="dot-git"),
        pytest.param("café/x,,", "malformed model id 'café/x'", id="non-ascii"),
        pytest.param("org/a,finetuned,", "unknown base_model_relation 'finetuned'",
                     id="unknown-relation"),
        pytest.param("org/a,weights,", "expected empty or base, finetune", id="relation-hint"),
        pytest.param("org/a@,,", "empty revision after '@' in 'org/a@'", id="empty-revision"),
        pytest.param("@main,,", "empty model id before '@'", id="empty-id-before-at"),
        pytest.param("org/a@ma in,,", "bad revision 'ma in' in 'org/a@ma in': whitespace",
                     id="revision-whitespace"),
        pytest.param("org/a@x..y,,", "bad revision 'x..y'", id="revision-dotdot"),
        pytest.param("org/a@feat/,,", "bad revision 'feat/'", id="revision-trailing-slash"),
        pytest.param("org/a@x.lock,,", "bad revision 'x.lock'", id="revision-lock"),
        pytest.param("org/a,adapter,./no/such/base", "source model path does not exist: "
                     "./no/such/base", id="local-source-missing"),
        pytest.param("org/a,adapter,bad base!", "source_model: malformed model id 'bad base!'",
                     id="malformed-source"),
        pytest.param("org/a,adapter,org/base@", "source_model: empty revision",
                     id="source-empty-revision"),
        pytest.param("org/a,base,,surplus", "4 cells, but the header has 3", id="extra-cells"),
    ],
)
def test_bad_row_gives_one_problem_and_others_load(
    tmp_path: Path, row: str, expected: str
) -> None:
    path = write_list(tmp_path, HEADER + GOOD + row + "\n" + "org/after,,\n")
    result = read_model_list(path)
    assert [r.model_id for r in result.rows] == ["org/good", "org/after"]
    (problem,) = result.problems
    assert (problem.source, problem.line) == (str(path), 3)
    assert expected in problem.message
    assert str(problem).startswith(f"{path}:3: ")


@pytest.mark.parametrize("relation", sorted(ADAPTER_RELATIONS))
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(None, "has no adapter_config.json and no source_model", id="no-config"),
        pytest.param({"peft_type": "LORA"}, "names no base_model_name_or_path", id="no-base"),
        pytest.param({"base_model_name_or_path": "  "}, "names no base_model_name_or_path",
                     id="blank-base"),
    ],
)
def test_local_adapter_without_base_is_a_problem(
    tmp_path: Path, relation: str, config: dict[str, object] | None, expected: str
) -> None:
    """No source_model and a config that names no base: the worker could not find the base."""
    adapter = make_adapter_dir(tmp_path, "adapter", config)
    path = write_list(tmp_path, f"{HEADER}{adapter},{relation},\n")
    result = read_model_list(path)
    assert result.rows == ()
    (problem,) = result.problems
    assert problem.line == 2
    assert expected in problem.message


def test_local_adapter_with_unreadable_config_is_a_problem(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{not json")
    result = read_model_list(write_list(tmp_path, f"{HEADER}{adapter},lora,\n"))
    (problem,) = result.problems
    assert "cannot read adapter_config.json" in problem.message


@pytest.mark.parametrize(
    "row",
    [
        pytest.param("{adapter},adapter,", id="base-in-config"),
        pytest.param("{bare},adapter,{base}", id="source-given-local"),
        pytest.param("{bare},peft,org/base@main", id="source-given-hub"),
        pytest.param("{bare},base,", id="not-an-adapter"),
        pytest.param("org/hub-adapter,lora,", id="hub-adapter-read-at-run-time"),
        pytest.param("./not/here,adapter,", id="missing-local-model-is-the-workers-failure"),
    ],
)
def test_adapter_rows_that_can_find_their_base(tmp_path: Path, row: str) -> None:
    adapter = make_adapter_dir(tmp_path, "adapter", {"base_model_name_or_path": "org/base"})
    bare = make_adapter_dir(tmp_path, "bare", None)
    base = tmp_path / "base"
    base.mkdir()
    line = row.format(adapter=adapter, bare=bare, base=base)
    result = read_model_list(write_list(tmp_path, HEADER + line + "\n"))
    assert result.problems == ()
    assert len(result.rows) == 1


@pytest.mark.parametrize("relation", ["base", "finetune", "quantized", "merge"])
def test_source_model_of_non_adapters_is_not_checked(tmp_path: Path, relation: str) -> None:
    """Only adapters use source_model; hub metadata lists a merge's parents as a list there."""
    path = write_list(
        tmp_path,
        f"{HEADER}org/a,{relation},\"['x/y', 'z/w']\"\norg/b,{relation},./no/such/dir\n",
    )
    result = read_model_list(path)
    assert result.problems == ()
    assert [r.source_model for r in result.rows] == ["['x/y', 'z/w']", "./no/such/dir"]


@pytest.mark.parametrize("relation", ["", "adapter", "lora", "peft"])
def test_source_model_checked_where_it_may_be_a_base(tmp_path: Path, relation: str) -> None:
    """An empty relation may still be an adapter (the worker looks for adapter_config.json)."""
    result = read_model_list(write_list(tmp_path, f"{HEADER}org/a,{relation},./no/such/dir\n"))
    (problem,) = result.problems
    assert problem.message == "source model path does not exist: ./no/such/dir"


def test_many_bad_rows_each_reported(tmp_path: Path) -> None:
    path = write_list(tmp_path, HEADER + ",lora,\norg/a,bogus,\norg/ok,,\norg/b@,,\n")
    result = read_model_list(path)
    assert [r.model_id for r in result.rows] == ["org/ok"]
    assert [p.line for p in result.problems] == [2, 3, 5]


# --- quotes that do not balance -------------------------------------------------------------

NOTES = "model_id,base_model_relation,notes\n"
MANY = [f"org/m{i},,\n" for i in range(12_000)]  # more than csv's field limit holds


def field_limit_line(opened: str, lines: list[str], first: int) -> int:
    """The line on which a cell that opens with `opened` on line `first` and takes in
    `lines` grows past csv's field limit (where the csv module gives up on it)."""
    size = len(opened)
    for number, line in enumerate(lines, start=first + 1):
        size += len(line)
        if size > csv.field_size_limit():
            return number
    raise AssertionError("the lines fit in one field")


@pytest.mark.parametrize(
    ("body", "last", "ids"),
    [
        pytest.param('org/q,,"never closed\norg/b,,\norg/c,,\n', 5, ["org/b", "org/c"],
                     id="notes-quote-to-the-end"),
        pytest.param('"org/q,,\norg/b,,\norg/c,,\n', 5, ["org/b", "org/c"],
                     id="id-quote-to-the-end"),
        pytest.param('org/q,,"opened\norg/b,,\norg/c,,"closed" later\norg/d,,\n', 5,
                     ["org/b", "org/c", "org/d"], id="closed-rows-later-with-text-after"),
        pytest.param('org/q,,"never closed\n' + "".join(MANY),
                     field_limit_line("never closed\n", MANY, 3),
                     [f"org/m{i}" for i in range(12_000)], id="past-the-field-limit"),
    ],
)
def test_a_quote_that_swallows_rows_is_a_bad_row(
    tmp_path: Path, body: str, last: int, ids: list[str]
) -> None:
    """A quote that opens a cell and does not close where the cell ends would make the
    rows after it one cell: that row is one bad row with its line and the lines it took,
    and the rows it took are read as rows (the list's other rows still run)."""
    path = write_list(tmp_path, NOTES + "org/a,,first\n" + body)
    result = read_model_list(path)
    assert [r.model_id for r in result.rows] == ["org/a", *ids]
    (problem,) = result.problems
    assert problem.line == 3
    assert problem.message.startswith(
        f"unbalanced quote: the quoted cell opened on this line runs on to line {last} (")
    assert f"lines 4-{last} are read as rows" in problem.message
    assert [r.line for r in result.rows[1:3]] == [4, 5]
