"""The resume plan: which listed models are done (marker with the same parameters) and which to run.

Owns the split of a model list against the store. Pure but for the store reads it asks
esd_worker.layout for (the markers of listed models, one listing) and esd_worker.records
(failure records). Does not look at what is running: the backend knows that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from esd_worker.layout import Marker, canonical_parameters, list_markers, read_markers
from esd_worker.modellist import ModelRow
from esd_worker.records import read_failures
from esd_worker.store import Store


@dataclass(frozen=True)
class Plan:
    """The listed models split by what a run must do with them, each in list order.

    todo: to analyse (includes stale); done: marker with the same parameters;
    skipped_failed: permanent failure record and --skip-failed; stale: marker with other
    parameters (recomputed, so also in todo).
    """

    todo: tuple[ModelRow, ...]
    done: tuple[ModelRow, ...]
    skipped_failed: tuple[ModelRow, ...]
    stale: tuple[ModelRow, ...]


def plan_run(
    models: Sequence[ModelRow],
    store: Store,
    parameters: Mapping[str, Any],
    *,
    overwrite: bool = False,
    skip_failed: bool = False,
    threads: int = 16,
) -> Plan:
    """Split models into todo / done / skipped_failed (and stale, a part of todo).

    done iff `<key>/result.json` exists and its "parameters" equal `parameters` (compared
    after a JSON round trip, as the worker stores them). overwrite: every model is todo and
    no marker is read. skip_failed: models whose failure record is not retryable go to
    skipped_failed unless done (also with overwrite); by default they are tried again.
    Only the markers of listed models are read.
    """
    wanted = canonical_parameters(parameters)  # once, not per marker (lists of 10^5 models)
    markers: dict[str, Marker | None] = {}
    if not overwrite:
        present = list_markers(store)
        markers = read_markers(
            store, [m.key for m in models if m.key in present], threads=threads
        )
    permanent: set[str] = set()
    if skip_failed:
        permanent = {
            key for key, record in read_failures(store, threads=threads).items()
            if not record.retryable
        }

    todo: list[ModelRow] = []
    done: list[ModelRow] = []
    skipped: list[ModelRow] = []
    stale: list[ModelRow] = []
    for model in models:
        key = model.key
        marker = markers.get(key)
        if marker is not None and marker.parameters == wanted:
            done.append(model)
            continue
        if key in permanent:
            skipped.append(model)
            continue
        if marker is not None:
            stale.append(model)
        todo.append(model)
    return Plan(
        todo=tuple(todo), done=tuple(done), skipped_failed=tuple(skipped), stale=tuple(stale)
    )
