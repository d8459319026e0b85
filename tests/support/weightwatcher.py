"""WeightWatcher run beside our analysis in the tests that compare the two (the version they
were written against, its log quiet, BLAS and torch on one thread)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest

WW_VERSION = "0.7.7"

# The marks of a module that runs WeightWatcher: slow, and WeightWatcher 0.7.7 builds its
# table with an API pandas 3 deprecates (its noise, not ours).
WW_MARKS = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Passing a dict to DataFrame.from_records"),
]


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS and torch on one thread: 384-wide matrices gain nothing from more, and on a busy
    2-core machine spinning thread pools made these modules take minutes, not seconds."""
    import torch
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # WW needs it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(threads)


def ww_details(model: Any, **analyze: Any) -> Any:
    """WeightWatcher's `analyze()` table of `model` (its defaults but `analyze`)."""
    import weightwatcher as ww

    assert ww.__version__ == WW_VERSION, f"written against {WW_VERSION}, got {ww.__version__}"
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    return ww.WeightWatcher(model=model).analyze(**analyze)
