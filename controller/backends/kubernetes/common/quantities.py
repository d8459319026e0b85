"""Kubernetes resource quantities as the flags give them (`2`, `500m`, `16Gi`, `1e3`): which
strings are quantities, the number each stands for, and which are too big to mean anything.

Pure. Does not build resources (controller.backends.kubernetes.common.jobs) nor size them
(common.resources, and the sharded mode's sharding).
"""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE]\d+)?")
# A request past this is a typo (1e999, 16Ei): no node has it, and the pod would wait for one
# forever. It is also past what Kubernetes keeps of a quantity in an int64 of milli-units.
MAX_QUANTITY = 1e15
_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50,
             "Ei": 2.0**60}


def quantity_value(quantity: str) -> float | None:
    """The number a quantity stands for (16Gi: 2**34; 500m: 0.5; 1e999: inf); None when
    the string is not a quantity."""
    match = _QUANTITY.fullmatch(quantity)
    if match is None:
        return None
    number, suffix = match.group(1), match.group(3) or ""
    if suffix[:1] in ("e", "E") and suffix[1:].isdigit():
        return float(number + suffix)  # inf past a float's range
    return float(number) * _SUFFIXES.get(suffix, 1.0)


def quantity_problem(name: str, quantity: str) -> str | None:
    """Why `quantity` cannot be the setting `name`, or None."""
    value = quantity_value(quantity)
    if value is None:
        return f"{name}: {quantity!r} is not a Kubernetes quantity (e.g. 2, 500m, 16Gi)"
    if value > MAX_QUANTITY:
        return f"{name}: {quantity!r} is more than any node has (at most {MAX_QUANTITY:.0e})"
    return None
