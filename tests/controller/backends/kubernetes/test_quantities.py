"""controller.backends.kubernetes.common.quantities: the number a quantity flag stands for, as the
API
server reads it, and the refusal of what no node could offer."""

from __future__ import annotations

import math

import pytest

from controller.backends.kubernetes.common.quantities import quantity_problem, quantity_value


@pytest.mark.parametrize(("quantity", "value"), [
    ("2", 2.0), ("500m", 0.5), ("1.5k", 1500.0), (".5", 0.5), ("16Gi", 2.0**34),
    ("3M", 3e6), ("1e3", 1000.0), ("2E2", 200.0), ("16Ei", 16 * 2.0**60),
    ("1e999", math.inf), ("lots", None), ("16GiB", None), ("-1", None), ("", None),
])
def test_quantity_value(quantity: str, value: float | None) -> None:
    """Binary suffixes are powers of 2, decimal ones of 10, `e<n>` an exponent (1e999 is
    infinite, not an error): the same number Kubernetes' own parser gives."""
    assert quantity_value(quantity) == value


@pytest.mark.parametrize(("quantity", "problem"), [
    ("16Gi", None), ("1000T", None),
    ("lots", "is not a Kubernetes quantity"), ("1e999", "more than any node has"),
    ("16Ei", "more than any node has"), ("1e16", "more than any node has"),
])
def test_quantity_problem(quantity: str, problem: str | None) -> None:
    got = quantity_problem("memory_request", quantity)
    assert (got is None) if problem is None else (problem in str(got))
