"""The optional `[report]` extra: matplotlib, imported only when a report is written.

Owns the one error that says how to install them. refit and compare never call this, so they
work without the extra; nothing here draws or writes.
"""

from __future__ import annotations

import importlib
from typing import Any

from controller.errors import ResultsError


def require(module: str) -> Any:
    """`module` imported; a ResultsError naming the extra to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ResultsError(
            f"the report needs {module.split('.')[0]}: pip install 'esd-sweep[report]'"
        ) from e
