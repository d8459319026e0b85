"""Tests of esd_worker.core.models.modellist: both CSV layouts, ids and revisions, one problem per
bad row."""

from __future__ import annotations

from pathlib import Path

import pytest

from esd_worker.core.models.modellist import (
    ADAPTER_RELATIONS,
    RELATIONS,
    ModelList,
    ModelListError,
    ModelRow,
    RowProblem,
    base_first,
    make_single,
    read_model_list,
)
from esd_worker.core.models.naming import model_key, parse_ref, repo_id_problem, revision_problem
from tests.support.modellist import GOOD, HEADER, make_model_row, write_list

# --- builders -------------------------------------------------------------------------------








# --- layouts --------------------------------------------------------------------------------


def test_kinexp_layout_full_name_source_relation(tmp_path: Path) -> None:
    """The gputracker pipeline's layout (full_name, source_model, base_model_relation) loads."""
    path = write_list(
        tmp_path,
        "full_name,source_model,base_model_relation\n"
        "openai-community/gpt2,,base\n"
        "peft-internal-testing/gpt2-lora-random,openai-community/gpt2,adapter\n"
        "meta-llama/Llama-2-7b-hf,,base\n",
    )
    result = read_model_list(path)
    assert result.problems == ()
    assert [(r.model_id, r.relation, r.source_model, r.line) for r in result.rows] == [
        ("openai-community/gpt2", "base", None, 2),
        ("peft-internal-testing/gpt2-lora-random", "adapter", "openai-community/gpt2", 3),
        ("meta-llama/Llama-2-7b-hf", "base", None, 4),
    ]


def test_run_esd_layout_model_id_relation_source(tmp_path: Path) -> None:
    """run_esd_experiment's layout (model_id, base_model_relation, source_model) loads the same."""
    path = write_list(
        tmp_path,
        "model_id,base_model_relation,source_model\n"
        "meta-llama/Llama-2-7b-hf,,\n"
        "microsoft/phi-2,,\n"
        "some/lora-adapter,adapter,meta-llama/Llama-2-7b-hf\n"
        "another/adapter,lora,\n",
    )
    result = read_model_list(path)
    assert result.problems == ()
    assert [(r.model_id, r.relation, r.source_model) for r in result.rows] == [
        ("meta-llama/Llama-2-7b-hf", "", None),
        ("microsoft/phi-2", "", None),
        ("some/lora-adapter", "adapter", "meta-llama/Llama-2-7b-hf"),
        ("another/adapter", "lora", None),  # hub adapter: the worker reads its config
    ]
    assert [r.is_adapter for r in result.rows] == [False, False, True, True]


def test_id_column_alone_is_enough(tmp_path: Path) -> None:
    result = read_model_list(write_list(tmp_path, "model_id\norg/a\norg/b\n"))
    assert [r.ref for r in result.rows] == ["org/a", "org/b"]
    assert all(r.relation == "" and r.source_model is None for r in result.rows)


def test_header_names_ignore_case_whitespace_and_bom(tmp_path: Path) -> None:
    """A spreadsheet export: BOM, capitals, spaces around names, CRLF line ends."""
    path = write_list(
        tmp_path,
        " Source_Model ,MODEL_ID , Base_Model_Relation\r\nbase/m,org/a,FineTune\r\n",
        bom=True,
    )
    result = read_model_list(path)
    assert result.problems == ()
    (row,) = result.rows
    assert (row.model_id, row.relation, row.source_model) == ("org/a", "finetune", "base/m")


def test_model_id_wins_over_full_name_which_is_kept_as_metadata(tmp_path: Path) -> None:
    path = write_list(tmp_path, "full_name,model_id\nold/name,new/name\n")
    (row,) = read_model_list(path).rows
    assert row.model_id == "new/name"
    assert row.metadata == {"full_name": "old/name"}


def test_extra_columns_kept_as_metadata(tmp_path: Path) -> None:
    path = write_list(
        tmp_path,
        "downloads,model_id,Pipeline Tag,base_model_relation\n"
        "1200,org/a,text-generation,base\n"
        "7,org/b,,\n",
    )
    rows = read_model_list(path).rows
    assert [dict(r.metadata) for r in rows] == [
        {"downloads": "1200", "Pipeline Tag": "text-generation"},
        {"downloads": "7", "Pipeline Tag": ""},
    ]


def test_metadata_does_not_take_part_in_equality_or_hashing() -> None:
    """Rows are used as dict keys and set members; metadata is a plain dict."""
    a = ModelRow("org/a", None, "", None, line=2, metadata={"x": "1"})
    b = ModelRow("org/a", None, "", None, line=2, metadata={"x": "2"})
    assert a == b and hash(a) == hash(b)


def test_comments_and_blank_lines_are_skipped_and_lines_stay_true(tmp_path: Path) -> None:
    """Line numbers count every physical line, so a problem points at the right one."""
    path = write_list(
        tmp_path,
        "# exported 2026-11-23\n"
        "\n"
        "model_id,base_model_relation\n"
        "# base models\n"
        "org/a,base\n"
        "   \n"
        "org/b,nonsense\n"
        '  # indented comment, "quoted"\n'
        "org/c,\n",
    )
    result = read_model_list(path)
    assert [(r.model_id, r.line) for r in result.rows] == [("org/a", 5), ("org/c", 9)]
    assert [p.line for p in result.problems] == [7]


def test_rows_of_empty_cells_are_blank_lines(tmp_path: Path) -> None:
    """Spreadsheets export empty lines as ',,'; they are not rows with an empty id."""
    result = read_model_list(write_list(tmp_path, HEADER + ",,\n , ,\norg/a,,\n"))
    assert [(r.model_id, r.line) for r in result.rows] == [("org/a", 4)]
    assert result.problems == ()


def test_multiline_quoted_metadata_keeps_line_numbers(tmp_path: Path) -> None:
    """A metadata cell spanning lines (pandas exports of model cards do this)."""
    path = write_list(
        tmp_path,
        'model_id,description\norg/a,"line one\nline two"\norg/b,x\n,empty\n',
    )
    result = read_model_list(path)
    assert [(r.model_id, r.line) for r in result.rows] == [("org/a", 2), ("org/b", 4)]
    assert result.rows[0].metadata == {"description": "line one\nline two"}
    assert [str(p) for p in result.problems] == [f"{path}:5: empty model id"]


# --- revisions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "model_id", "revision"),
    [
        ("org/name", "org/name", None),
        ("org/name@main", "org/name", "main"),
        ("org/name@v1.0.2", "org/name", "v1.0.2"),
        ("org/name@refs/pr/12", "org/name", "refs/pr/12"),
        ("gpt2@6c0e6080953db56375760c0471a8c5f2929baf11", "gpt2",
         "6c0e6080953db56375760c0471a8c5f2929baf11"),
        ("org/name@release_2024-01", "org/name", "release_2024-01"),
        ("  org/name@main  ", "org/name", "main"),
    ],
    ids=lambda v: str(v),
)
def test_parse_ref(ref: str, model_id: str, revision: str | None) -> None:
    assert parse_ref(ref) == (model_id, revision, None)


# --- local paths ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "model_id"),
    [
        pytest.param("./models/tiny@v2", "{tmp}/work/models/tiny@v2", id="at-is-part-of-a-path"),
        pytest.param("/abs/dir/", "/abs/dir", id="absolute"),
        pytest.param("//abs//dir", "/abs/dir", id="double-slashes"),
        pytest.param("~/models/x", "{tmp}/home/models/x", id="home"),
        pytest.param("../up/x", "{tmp}/up/x", id="parent"),
    ],
)
def test_parse_ref_makes_local_paths_absolute(in_work_dir: Path, ref: str, model_id: str) -> None:
    """A path is keyed by the directory it names, wherever the list is read
    (esd_worker.core.models.naming.local_path), with no revision even when a name has an '@'."""
    assert parse_ref(ref) == (model_id.format(tmp=in_work_dir), None, None)


def test_spellings_of_one_directory_are_one_model(in_work_dir: Path) -> None:
    """`/w/m`, `/w/m/`, `//w/m` and `./m` read in /w are one model (the first row kept, the
    others duplicates), recorded by its absolute path."""
    m = in_work_dir / "work" / "m"
    path = write_list(in_work_dir, f"model_id\n{m}\n{m}/\n/{m}\n./m\n")
    result = read_model_list(path)
    assert [(r.model_id, r.line) for r in result.rows] == [(str(m), 2)]
    assert result.rows[0].key == model_key(str(m))
    assert result.duplicates == 3


def test_a_relative_path_is_the_directory_it_was_read_in(
    in_work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`./m` read in two directories is two models: another directory's `./m` is not done
    because this one is."""
    path = write_list(in_work_dir, "model_id\n./m\n")
    first = read_model_list(path).rows[0]
    monkeypatch.chdir(in_work_dir)
    second = read_model_list(path).rows[0]
    assert (first.model_id, second.model_id) == (str(in_work_dir / "work" / "m"),
                                                 str(in_work_dir / "m"))
    assert first.key != second.key


def test_a_local_base_is_named_as_its_row_is(in_work_dir: Path) -> None:
    """source_model `./base/` is the listed `./base`: the adapter runs right after it
    (base_first), and the worker is given the same absolute path."""
    (in_work_dir / "work" / "base").mkdir()
    path = write_list(in_work_dir, HEADER + "./lora,adapter,./base/\norg/x,,\n./base,,\n")
    rows = read_model_list(path).rows
    base = str(in_work_dir / "work" / "base")
    assert rows[0].source_model == base
    assert [r.model_id for r in base_first(rows)] == [
        "org/x", base, str(in_work_dir / "work" / "lora"),
    ]


def test_a_dotdot_out_of_a_symlink_refuses_the_row(in_work_dir: Path) -> None:
    """`./link/../m` names <work>/m as text but <elsewhere>/m to the OS (link points into
    <elsewhere>/deep): another model's weights under the name given. The row is refused with
    its line, as model_id and as source_model; `./link/x/..` (the link itself) is kept."""
    deep = in_work_dir / "elsewhere" / "deep"
    for folder in (deep / "x", in_work_dir / "elsewhere" / "m", in_work_dir / "work" / "m"):
        folder.mkdir(parents=True)
    (in_work_dir / "work" / "link").symlink_to(deep)
    path = write_list(in_work_dir, HEADER + "./link/../m,,\n./lora,adapter,./link/../m\n"
                      "./link/x/..,,\n")
    result = read_model_list(path)
    assert [r.model_id for r in result.rows] == [str(in_work_dir / "work" / "link")]
    assert [p.line for p in result.problems] == [2, 3]
    assert all("steps out of the symlink" in p.message and "/work/link" in p.message
               for p in result.problems)
    (problem,) = make_single("./link/../m").problems
    assert "steps out of the symlink" in problem.message


def test_make_single_makes_a_local_path_absolute(in_work_dir: Path) -> None:
    (row,) = make_single("./m/").rows
    assert row.model_id == row.ref == str(in_work_dir / "work" / "m")


def test_revisions_give_distinct_keys_and_refs(tmp_path: Path) -> None:
    path = write_list(tmp_path, "model_id\norg/a\norg/a@main\norg/a@abc1234\n")
    rows = read_model_list(path).rows
    assert [r.ref for r in rows] == ["org/a", "org/a@main", "org/a@abc1234"]
    assert [r.key for r in rows] == [
        model_key("org/a"), model_key("org/a", "main"), model_key("org/a", "abc1234")
    ]
    assert len({r.key for r in rows}) == 3


@pytest.mark.parametrize(
    "revision",
    ["main", "v1.0", "refs/pr/1", "abc1234", "feature/x-y_z", "a" * 40],
)
def test_revision_ok(revision: str) -> None:
    assert revision_problem(revision) is None


@pytest.mark.parametrize(
    "revision",
    ["", "ma in", "tab\there", "x..y", "feat/", "/feat", "x.", "x.lock", ".hidden", "a/.b",
     "x:y", "x~1", "x^", "x?", "x*", "x[", "x\\y", "a//b", "@", "x@{1}", "a" * 256],
)
def test_revision_rejected(revision: str) -> None:
    assert revision_problem(revision)


# --- repo id syntax -------------------------------------------------------------------------

VALID_IDS = [
    "gpt2", "org/name", "Foo-BAR_foo.bar123", "123", "a/b", "_x/_y", "org/name_",
    "a" * 96, "o" * 96 + "/" + "n" * 96,
]
INVALID_IDS = [
    "", "a/b/c", "-org/name", "org-/name", "org/name-", "org/.name", "org/name.",
    "org--x/name", "org/na..me", "org/name.git", "org/na me", "café/x", "org/na!me",
    "/name", "org/", "a" * 97, "org/" + "n" * 97,
]


@pytest.mark.parametrize("repo_id", VALID_IDS)
def test_repo_id_ok(repo_id: str) -> None:
    assert repo_id_problem(repo_id) is None


@pytest.mark.parametrize("repo_id", INVALID_IDS)
def test_repo_id_rejected(repo_id: str) -> None:
    assert repo_id_problem(repo_id)


@pytest.mark.parametrize("repo_id", VALID_IDS + INVALID_IDS)
def test_repo_id_rules_match_huggingface_hub(repo_id: str) -> None:
    """Our copy of the rules agrees with huggingface_hub's validate_repo_id (worker extra)."""
    validators = pytest.importorskip("huggingface_hub.utils")
    try:
        validators.validate_repo_id(repo_id)
        hub_ok = bool(repo_id)  # the hub skips None only; "" fails its regex
    except validators.HFValidationError:
        hub_ok = False
    assert (repo_id_problem(repo_id) is None) == hub_ok


# --- duplicates and limit -------------------------------------------------------------------


def test_duplicates_dropped_first_kept(tmp_path: Path) -> None:
    """Same id and revision twice is one model; the same id at another revision is not."""
    path = write_list(
        tmp_path,
        HEADER
        + "org/a,base,\n"
        + "org/b,,\n"
        + "org/a,finetune,\n"  # duplicate of line 2, different relation: first wins
        + "org/a@main,,\n"
        + "org/b,,\n",
    )
    result = read_model_list(path)
    assert [(r.ref, r.line, r.relation) for r in result.rows] == [
        ("org/a", 2, "base"), ("org/b", 3, ""), ("org/a@main", 5, ""),
    ]
    assert result.duplicates == 2


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(None, ["org/a", "org/b", "org/c"]), (0, []), (1, ["org/a"]), (2, ["org/a", "org/b"]),
     (10, ["org/a", "org/b", "org/c"])],
)
def test_limit_counts_valid_rows_after_dedup(
    tmp_path: Path, limit: int | None, expected: list[str]
) -> None:
    """Bad rows and duplicates before the cut do not use up the limit."""
    path = write_list(tmp_path, HEADER + ",base,\norg/a,,\norg/a,,\norg/b,,\nbad id,,\norg/c,,\n")
    result = read_model_list(path, limit=limit)
    assert [r.ref for r in result.rows] == expected
    assert len(result.problems) == 2
    assert result.duplicates == 1


def test_negative_limit_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        read_model_list(write_list(tmp_path, HEADER + GOOD), limit=-1)


# --- file-level errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", "is empty", id="empty-file"),
        pytest.param("\n\n# only a comment\n", "is empty", id="only-comments"),
        pytest.param("name,relation\norg/a,base\n", "no model_id or full_name column",
                     id="no-id-column"),
        pytest.param("model_id,base_model_relation\n# none yet\n", "has a header but no models",
                     id="header-only"),
        pytest.param('model_id,"notes\norg/a,x\n', ":1: unbalanced quote",
                     id="header-quote-never-closed"),
    ],
)
def test_file_level_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ModelListError, match=expected):
        read_model_list(write_list(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelListError, match="model list not found"):
        read_model_list(tmp_path / "nope.csv")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ModelListError, match="is a directory"):
        read_model_list(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes("model_id\norg/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ModelListError, match="not UTF-8"):
        read_model_list(path)


def test_path_as_string(tmp_path: Path) -> None:
    path = write_list(tmp_path, HEADER + GOOD)
    assert read_model_list(str(path)).rows[0].model_id == "org/good"


# --- single model ---------------------------------------------------------------------------


def test_make_single() -> None:
    result = make_single("org/a@v1", relation="LoRA", source_model="org/base")
    assert result == ModelList(
        rows=(ModelRow("org/a", "v1", "lora", "org/base", line=0),), problems=(), duplicates=0
    )
    assert result.rows[0].is_adapter


@pytest.mark.parametrize(
    ("ref", "kw", "expected"),
    [
        pytest.param("", {}, "--single-model: empty model id", id="empty"),
        pytest.param("bad id", {}, "--single-model: malformed model id 'bad id'", id="malformed"),
        pytest.param("org/a", {"relation": "nope"}, "--single-model: unknown base_model_relation",
                     id="relation"),
    ],
)
def test_make_single_problem(ref: str, kw: dict[str, str], expected: str) -> None:
    result = make_single(ref, **kw)
    assert result.rows == ()
    (problem,) = result.problems
    assert str(problem).startswith(expected)


# --- rows -----------------------------------------------------------------------------------


def test_row_properties() -> None:
    row = make_model_row("org/a", "main", relation="peft")
    assert row.ref == "org/a@main"
    assert row.key == model_key("org/a", "main")
    assert row.is_adapter
    plain = make_model_row("org/a")
    assert (plain.ref, plain.key, plain.is_adapter) == ("org/a", model_key("org/a"), False)


def test_relations_constant() -> None:
    assert RELATIONS[0] == "" and set(ADAPTER_RELATIONS) <= set(RELATIONS)


def test_row_problem_str() -> None:
    assert str(RowProblem("models.csv", 7, "empty model id")) == "models.csv:7: empty model id"
