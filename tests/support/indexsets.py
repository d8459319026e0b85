"""The index sets of an Indexed Job's status (completedIndexes, failedIndexes: "1,3-5,7"),
written and read as the Job controller does, for the simulators and their tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def format_indexes(indexes: Iterable[int]) -> str:
    """Indexes as the Job controller writes them: increasing, comma-separated, runs of three
    or more as first-last ("1,3-5,7"); a run of two stays two numbers ("3,4"). (A run
    is a group of sorted indexes with the same index - position.)"""
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(indexes))), lambda p: p[1] - p[0]):
        values = [str(v) for _, v in run]
        parts.append(f"{values[0]}-{values[-1]}" if len(values) >= 3 else ",".join(values))
    return ",".join(parts)


def parse_indexes(text: str | None) -> set[int]:
    """The indexes of a completedIndexes / failedIndexes string ("1,3-5,7")."""
    out: set[int] = set()
    for part in filter(None, (text or "").split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out
