"""Stale results that differ from the run's parameters only in the fit: refitted in place.

Owns which stale results `esd-sweep run` refits instead of analysing (`fit_only`: every
parameter but the fit's, esd_worker.core.command.flags.FIT_FIELDS, is the run's, and the
marker seals an eigs.npz) and the refit in place (`refit_planned`): from the stored
eigenvalues, a new layers.csv (controller.results.refit.refit_rows: the worker's fit, so
the table is the one the worker would write), then the marker, last (the run's parameters,
the summary by esd_worker.core.store.results.summarize_layers, the worker's), then the
results tables' parts. No download, no worker: it only touches the store, so it is the same
for every backend and store. A result whose files do not hold up (eigs.npz missing, not as
sealed, unreadable, or its layers not the table's) is analysed instead: never lost.
Not here: the fit (esd_worker.core.powerlaw), the write order (layout.write_model_result),
the tables' rows (esd_worker.core.store.tables).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from controller.output.tenure import Tenure
from controller.progress import Progress
from controller.results.reader import parse_eigs, read_table
from controller.results.refit import refit_rows
from controller.run.plan import REFIT, ListPlan
from esd_worker.core.command.flags import FIT_FIELDS
from esd_worker.core.store.layout import (
    EIGS_BYTES,
    EIGS_NAME,
    fetch_all,
    marker_key,
    model_file_key,
    parse_marker,
    write_model_result,
)
from esd_worker.core.store.marker import (
    LAYERS_NAME,
    DamagedResult,
    Marker,
    canonical_parameters,
    check_data,
)
from esd_worker.core.store.results import layers_from_csv, layers_to_csv, summarize_layers
from esd_worker.core.store.stores import Store
from esd_worker.core.store.tables import DoneModel, write_parts

log = logging.getLogger(__name__)

BATCH = 16  # models whose three files are fetched at once (concurrently: stores may be remote)
FETCH_THREADS = 16
TABLE_MODELS = 500  # refitted models whose table rows are written as one part
FALLBACK_LINES = 20  # models analysed instead named one line each, then only counted


def fit_only(parameters: Mapping[str, Any]) -> Callable[[Marker], bool]:
    """Whether a stale marker can be refitted to `parameters` (the run's): the same keys,
    the values that differ all fit fields, and an eigs.npz it seals (so its bytes can be
    checked before they are used)."""
    wanted = canonical_parameters(parameters)

    def refittable(marker: Marker) -> bool:
        stored = marker.parameters
        if marker.eigs_name is None or marker.eigs_name not in marker.files:
            return False
        if set(stored) != set(wanted):
            return False
        changed = {name for name, value in wanted.items() if stored[name] != value}
        return bool(changed) and changed <= set(FIT_FIELDS)

    return refittable


@dataclass
class RefitTally:
    """What refit_planned did: models refitted, and those analysed instead (with why)."""

    refitted: int = 0
    analysed: int = 0
    seconds: float = 0.0
    stopped: bool = False  # the output's lease was lost: nothing more written
    pending: list[DoneModel] = field(default_factory=list)  # rows not yet in a part


def refit_planned(store: Store, plan: ListPlan, parameters: Mapping[str, Any], *,
                  tenure: Tenure | None = None, threads: int = 0) -> RefitTally:
    """Refit every model the plan holds for a refit (state REFIT), a batch at a time; a
    model that cannot be refitted goes back to the plan's work (ListPlan.analyse_instead).
    threads: layers fitted at once (0: one per CPU)."""
    tally = RefitTally()
    total = plan.counts.refit
    if not total:
        return tally
    t0 = time.perf_counter()
    wanted = canonical_parameters(parameters)
    fit = _Fit(wanted, fit_only(wanted))
    progress = Progress(total)
    instead: list[str] = []
    workers = threads or os.cpu_count() or 1
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for batch in _batches(plan):
                for key, files in zip(batch, _fetch(store, batch), strict=True):
                    if tenure is not None and tenure.lost:
                        tally.stopped = True
                        return tally
                    why = fit.refit(store, key, files, pool, tally)
                    if why is not None:
                        instead.append(key)
                        _fallback_line(key, why, len(instead))
                    progress.update(done=tally.refitted, failed=len(instead), running=0,
                                    waiting=0)
                if len(tally.pending) >= TABLE_MODELS:
                    _write_parts(store, tally, tenure)
    finally:
        if not tally.stopped:
            _write_parts(store, tally, tenure)
        progress.close()
        for key in instead:
            plan.analyse_instead(key)
        tally.analysed = len(instead)
        tally.seconds = time.perf_counter() - t0
    log.info("%d model(s) refitted from their stored eigenvalues in %.1fs (only fit settings "
             "changed; --reanalyse analyses them again)%s", tally.refitted, tally.seconds,
             f"; {len(instead)} could not be and are analysed" if instead else "")
    return tally


@dataclass(frozen=True)
class _Fit:
    """One refit in place: the run's parameters and the check the plan made."""

    wanted: dict[str, Any]
    refittable: Callable[[Marker], bool]

    def refit(self, store: Store, key: str, files: tuple[bytes | None, ...],
              pool: ThreadPoolExecutor, tally: RefitTally) -> str | None:
        """Refit model `key` from its fetched (marker, table, eigs); None when written,
        else why it is analysed instead."""
        started = time.perf_counter()
        marker = parse_marker(key, files[0])
        if marker is None:
            return "its marker is missing or unreadable"
        if not self.refittable(marker) or marker.eigs_name is None:
            return "its parameters are no longer a fit away from the run's"
        if (marker.layers_name, marker.eigs_name) != (LAYERS_NAME, EIGS_NAME):
            return f"its marker names {marker.layers_name} and {marker.eigs_name}"
        try:
            rows = read_table(marker, LAYERS_NAME, check_data(marker, LAYERS_NAME, files[1]))
            eigs = parse_eigs(marker, EIGS_NAME, files[2])
        except DamagedResult as e:
            return str(e)
        if not set(eigs) <= {row.get("layer") for row in rows}:
            return f"{marker.eigs_name} names layers that {marker.layers_name} does not"
        new, counts = refit_rows(rows, eigs, fix_fingers=self.wanted["fix_fingers"],
                                 evals_thresh=self.wanted["evals_thresh"],
                                 bins=self.wanted["bins"], pool=pool)
        if counts.no_eigs:
            return f"{counts.no_eigs} fitted layer(s) have no eigenvalues in {marker.eigs_name}"
        data = layers_to_csv(new)
        stored = layers_from_csv(data)  # as readers will see them: the CSV's strings
        statuses = Counter(str(row.get("status", "")) for row in stored)
        written = write_model_result(store, dataclasses.replace(
            marker, parameters=self.wanted, layer_count=len(stored),
            status_counts=dict(sorted(statuses.items())), summary=summarize_layers(stored),
            timings={**marker.timings, "refit_s": round(time.perf_counter() - started, 4)},
            finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        ), layers=data, eigs_kept=marker.files[marker.eigs_name])
        tally.refitted += 1
        tally.pending.append(DoneModel(written, stored))
        return None


def _batches(plan: ListPlan) -> Iterator[list[str]]:
    """The keys of the models held for a refit, in list order, BATCH at a time."""
    batch: list[str] = []
    for row, state in plan.classify():
        if state == REFIT:
            batch.append(row.key)
            if len(batch) >= BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _fetch(store: Store, keys: list[str]) -> list[tuple[bytes | None, ...]]:
    """Each model's marker, layers.csv and eigs.npz (by the names a worker gives them; the
    marker is checked to name the same before they are used)."""
    names = [marker_key(k) for k in keys] + [
        model_file_key(k, name) for name in (LAYERS_NAME, EIGS_NAME) for k in keys]
    blobs = fetch_all(store, names, threads=FETCH_THREADS, limit=EIGS_BYTES)
    n = len(keys)
    return [(blobs[i], blobs[n + i], blobs[2 * n + i]) for i in range(n)]


def _write_parts(store: Store, tally: RefitTally, tenure: Tenure | None) -> None:
    """The buffered models' rows into the results tables, so that their newest row there
    is the refit (readers take the latest finished_at)."""
    if tally.pending and (tenure is None or not tenure.lost):
        write_parts(store, tally.pending)
    tally.pending.clear()


def _fallback_line(key: str, why: str, count: int) -> None:
    if count <= FALLBACK_LINES:
        log.warning("model_key=%s is not refitted (%s): it is analysed", key, why)
    elif count == FALLBACK_LINES + 1:
        log.warning("more models are not refitted and are analysed (counted at the end)")
