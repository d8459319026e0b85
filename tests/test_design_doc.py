"""docs/design.md's picture of the code matches the code: every module it names exists, and
every module of the two packages is in it (a newcomer reads the tree, then the files)."""

from __future__ import annotations

import re

from tests.support import REPO_ROOT

DESIGN = REPO_ROOT / "docs" / "design.md"
_ENTRY = re.compile(r"^( *)((?:[\w.]+/?)(?:, [\w.]+/?)*)(?:\s|$)")


def tree_paths(text: str) -> set[str]:
    """The files and folders named in the code tree of design.md (the block that starts
    with `esd_worker/`), as paths relative to the repository."""
    block = text.split("```\nesd_worker/", 1)[1].split("```", 1)[0]
    stack: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in ("esd_worker/" + block).splitlines():
        match = _ENTRY.match(line)
        if not match or not line.strip():
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = "".join(name for _, name in stack)
        for name in match.group(2).split(", "):
            paths.add(parent + name)
            if name.endswith("/"):
                stack.append((indent, name))
    return paths


def test_every_named_module_exists() -> None:
    named = tree_paths(DESIGN.read_text(encoding="utf-8"))
    missing = sorted(p for p in named if not (REPO_ROOT / p).exists())
    assert len(named) > 40
    assert missing == []


def test_every_module_is_named() -> None:
    named = tree_paths(DESIGN.read_text(encoding="utf-8"))
    modules = {
        path.relative_to(REPO_ROOT).as_posix()
        for package in ("controller", "esd_worker", "esd_sweep")
        for path in (REPO_ROOT / package).rglob("*.py")
        if path.name != "__init__.py" or path.parent.name == "backends"
    }
    assert sorted(modules - named) == []


def test_the_parser_reads_nesting_and_lists() -> None:
    text = "```\nesd_worker/   the worker\n  a.py, b.py   two\n  sub/\n    c.py   one\nx.py\n```"
    assert tree_paths(text) == {"esd_worker/", "esd_worker/a.py", "esd_worker/b.py",
                                "esd_worker/sub/", "esd_worker/sub/c.py", "x.py"}
