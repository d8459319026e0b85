"""What one `esd-sweep run` did: its id and `runs/<run_id>.json` (counts, failures, timings).

Owns the run id and the run report's encoding; the sweep decides what goes in it. The
report is for people and CI; nothing reads it back to decide what to run.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from esd_worker.layout import run_report_key
from esd_worker.store import Store


def new_run_id(now: datetime | None = None) -> str:
    """A sortable, unique run id: UTC time to the second, then 6 random hex digits.

    E.g. 20261123T070501Z-3fa9c2. Ids of runs started in different seconds sort by start
    time; the random part keeps two controllers started in the same second apart.
    """
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def _json_safe(value: Any) -> Any:
    """NaN/inf → None (JSON has neither); tuples and sets → lists; mappings → dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return value


def write_run_report(store: Store, run_id: str, report: Mapping[str, Any]) -> str:
    """Write the run report to `runs/<run_id>.json`; returns that key.

    NaN and inf become null; values JSON cannot hold (datetimes, paths) become strings.
    """
    key = run_report_key(run_id)
    text = json.dumps(_json_safe(report), indent=2, allow_nan=False, default=str)
    store.put_bytes(key, (text + "\n").encode("utf-8"))
    return key
