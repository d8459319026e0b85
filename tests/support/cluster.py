"""Shared pieces of the Kubernetes backend tests: a JobSimulator that writes markers as the worker
does, and polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from controller.plan import canonical_parameters
from esd_worker.layout import Marker, marker_key
from esd_worker.settings import AnalysisSettings
from esd_worker.store import Store
from tests.support.kubesim import JobSimulator

NS = "esd"
PARAMS = canonical_parameters(AnalysisSettings().as_dict())  # what `run` asks for by default


class MarkerSimulator(JobSimulator):
    """A JobSimulator whose successful Jobs write the model's marker first (the worker's
    last act before it exits 0)."""

    store: Store

    def succeed(self, name: str, *, log: str = "done\n") -> dict[str, Any]:
        job = self.job(name)
        annotations = job["metadata"]["annotations"]
        key = annotations["esd-sweep/model-key"]
        marker = Marker(model=annotations["esd-sweep/model-ref"], model_key=key,
                        parameters=PARAMS, summary={"layers": 1})
        self.store.put_bytes(marker_key(key), marker.to_json())
        return super().succeed(name, log=log)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")
