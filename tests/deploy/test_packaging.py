"""The install's promises hold: the Python it claims is the one the linters target and the
tests run on, every dependency has a range, constraints.txt pins each package inside its
range, and every install (make, the Dockerfile, the CI example) goes through
constraints.txt with extras that exist.

What the built wheel holds and that it runs outside the repository: test_wheel.py.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
TOP_PACKAGES = ("esd_worker", "controller", "esd_sweep")
LOWER = (">=", ">", "~=", "==")
UPPER = ("<", "<=", "~=", "==")


def python_floor() -> tuple[int, int]:
    """The lower bound of requires-python (its one `>=` clause), as (major, minor)."""
    floors = [s.version for s in SpecifierSet(PROJECT["requires-python"]) if s.operator == ">="]
    assert len(floors) == 1, PROJECT["requires-python"]
    major, minor = Version(floors[0]).release[:2]
    return major, minor


def dependencies() -> Iterator[tuple[str, Requirement]]:
    """(where, requirement) of the base dependencies and of every extra."""
    for line in PROJECT["dependencies"]:
        yield "dependencies", Requirement(line)
    for extra, lines in PROJECT["optional-dependencies"].items():
        for line in lines:
            yield f"[{extra}]", Requirement(line)


def constraint_pins(text: str) -> dict[str, Version]:
    """name → pinned version of a constraints file; raises on a line that is not `name==X`."""
    pins: dict[str, Version] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;=<>!~,]+)", line)
        if match is None:
            raise ValueError(f"constraints.txt line {number}: {raw!r} is not name==version")
        name = canonicalize_name(match[1])
        if name in pins:
            raise ValueError(f"constraints.txt line {number}: {match[1]} pinned twice")
        pins[name] = Version(match[2])
    return pins


PINS = constraint_pins((REPO_ROOT / "constraints.txt").read_text(encoding="utf-8"))


def test_one_python_version_everywhere() -> None:
    """requires-python's floor is ruff's target, mypy's python_version, the newest-and-only
    Python classifier and the interpreter running these tests (CI runs the oldest claimed)."""
    major, minor = python_floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"{major}.{minor}"
    assert sys.version_info[:2] == (major, minor)
    versions = [c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: \d+\.\d+", c)]
    assert versions == [f"{major}.{minor}"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("numpy>=2.4\n", "not name==version"),
        ("numpy==2.4.6 ; python_version < '3.12'\n", "not name==version"),
        ("torch @ file:///tmp/torch.whl\n", "not name==version"),
        ("numpy==2.4.6\nNumPy==2.4.5\n", "pinned twice"),
    ],
    ids=["range", "marker", "url", "twice"],
)
def test_constraint_pins_refuses_what_is_not_a_pin(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        constraint_pins(text)


def test_constraints_pin_every_line_exactly() -> None:
    assert len(PINS) > 50 and PINS["torch"] == Version("2.13.0")  # parsed, no local label


@pytest.mark.parametrize(("where", "requirement"), list(dependencies()), ids=str)
def test_dependency_has_a_range_and_its_pin_lies_in_it(
    where: str, requirement: Requirement
) -> None:
    operators = {spec.operator for spec in requirement.specifier}
    assert operators & set(LOWER) and operators & set(UPPER), (
        f"{where} {requirement}: needs a lower and an upper bound")
    pin = PINS.get(canonicalize_name(requirement.name))
    assert pin is not None, f"{where} {requirement}: not pinned in constraints.txt"
    assert requirement.specifier.contains(pin, prereleases=True), (
        f"{where} {requirement}: constraints.txt pins {pin}")


def test_build_backend_pin_meets_the_build_requirements() -> None:
    """The wheel is built without isolation with constraints.txt's setuptools (Dockerfile,
    test_wheel.py): it must be one build-system.requires accepts."""
    for line in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(line)
        assert requirement.specifier.contains(PINS[canonicalize_name(requirement.name)])


def test_dev_holds_everything_the_example_needs() -> None:
    """`make setup` (dev) keeps what `make run` installs for the example set."""
    extras = PROJECT["optional-dependencies"]
    assert set(extras["example"]) <= set(extras["dev"])


def test_every_package_ships_its_type_hints() -> None:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == [f"{name}*" for name in TOP_PACKAGES]
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
    for name in TOP_PACKAGES:
        if (REPO_ROOT / name / "__init__.py").is_file():
            assert (REPO_ROOT / name / "py.typed").is_file(), name


def install_lines(path: Path) -> list[str]:
    """The `pip install` commands of a Makefile, Dockerfile or workflow that install this
    project (a `.` or a wheel of it), continuation lines joined."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    return [cmd.strip() for line in text.splitlines() for cmd in line.split("&&")
            if "pip install" in cmd and ("esd_sweep-" in cmd or '".[' in cmd)]


def extras_of(command: str) -> set[str]:
    match = re.search(r"\[([a-z0-9_,-]+)\]\"", command)
    assert match is not None, command
    return set(match[1].split(","))


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("Makefile", [set(PROJECT["optional-dependencies"]), {"worker", "report", "example"}]),
        ("Dockerfile", [{"s3", "kube"}, {"worker", "s3"}]),
        ("examples/ci/github-actions.yml", [{"s3", "kube"}]),
    ],
)
def test_every_install_uses_the_constraints_and_known_extras(
    path: str, expected: list[set[str]]
) -> None:
    """make setup: every extra; make run: worker, report, example; the controller image and
    the CI example: s3, kube; the worker image: worker, s3. Each with constraints.txt's
    versions."""
    commands = install_lines(REPO_ROOT / path)
    assert [extras_of(c) for c in commands] == expected
    assert set().union(*expected) <= set(PROJECT["optional-dependencies"])
    for command in commands:
        assert re.search(r"-c \S*constraints\.txt", command), command
