"""The minimum Kubernetes version is stated once: jobs.MIN_KUBERNETES (1.31, podFailurePolicy
GA). The controller's server-version check uses it, the strict schemas the tests validate
against start from it (tests/support/kubesim.K8S_VERSIONS), and no page of the docs or the
README states another minimum ("Kubernetes ≥ 1.29", "needs >= 1.30", "1.29 or newer", "an
API server older than 1.29"). kubectl's own minimum (kubectl 1.27 or newer) is not a
Kubernetes minimum and is left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.backends.kubernetes.common.jobs import MIN_KUBERNETES, min_kubernetes
from controller.backends.kubernetes.common.wiring import server_too_old
from tests.support import REPO_ROOT
from tests.support.kubesim import K8S_VERSION, K8S_VERSIONS

PAGES = sorted({REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")})
# A stated minimum of Kubernetes 1.NN, in the ways the docs word one; group "minor" is NN.
_MINIMUM = re.compile(
    r"(?P<context>[^\n]{0,60}?)(?:(?:≥|>=)\s*(?:v|Kubernetes\s+)?"
    r"|(?:Kubernetes|API server|cluster)s?\s+(?:older\s+than|before)\s+)"
    r"1\.(?P<minor>\d+)"
    r"|Kubernetes\s+1\.(?P<minor2>\d+)(?:\+|\s+or\s+(?:newer|later|above))")
# What the ≥ form must follow to be about Kubernetes (not Kueue's, a library's, kubectl's).
_ABOUT_KUBERNETES = re.compile(r"(?i)(kubernetes|api server|cluster|\bmode\b|\bk8s\b|"
                               r"\bEKS\b|\bGKE\b|sharded|per-model)")


def stated_minimums(text: str) -> list[tuple[int, str]]:
    """(minor, the words around it) for every minimum Kubernetes version `text` states."""
    text = re.sub(r"\s*\n\s*", " ", text)  # a sentence broken over lines is one sentence
    found = []
    for match in _MINIMUM.finditer(text):
        minor = match["minor"] or match["minor2"]
        context = match["context"] or ""
        if match["minor"] and ("kubectl" in context.lower()
                               or not _ABOUT_KUBERNETES.search(context + match[0])):
            continue
        found.append((int(minor), text[max(match.start(), match.end() - 90):match.end()]))
    return found


@pytest.mark.parametrize(("text", "minors"), [
    ("**Requirements.** Kubernetes ≥ 1.29 (Indexed Jobs)", [29]),
    ("the sharded mode needs ≥ 1.29 for `backoffLimitPerIndex`", [29]),
    ("Kubernetes 1.31 or newer (podFailurePolicy), and kubectl 1.27 or newer", [31]),
    ("an API server older than\n1.29 is refused", [29]),
    ("Kubernetes >= 1.30", [30]),
    ("kubectl ≥ 1.27 (its built-in kustomize)", []),
    ("Kueue ≥ 0.15; boto3 >= 1.34", []),
    ("validated for Kubernetes 1.31 and 1.37", []),
])
def test_the_patterns(text: str, minors: list[int]) -> None:
    assert [minor for minor, _ in stated_minimums(text)] == minors


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_states_another_minimum(page: Path) -> None:
    wrong = [f"{page.name}: …{words}" for minor, words in stated_minimums(page.read_text())
             if (MIN_KUBERNETES[0], minor) != MIN_KUBERNETES]
    assert wrong == [], f"the minimum is Kubernetes {min_kubernetes()} (jobs.MIN_KUBERNETES)"


def test_the_constant_is_what_the_code_and_the_tests_use() -> None:
    """The server check refuses the minor before and takes the minimum; the strict-schema
    validation starts at it."""
    major, minor = MIN_KUBERNETES
    assert server_too_old(f"v{major}.{minor - 1}.9") is not None
    assert server_too_old(f"v{major}.{minor}.0-eks-0123456") is None
    assert K8S_VERSION == f"{major}.{minor}.0" == K8S_VERSIONS[0]
