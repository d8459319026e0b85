"""The resume plan: which listed models are done (a whole result with the same parameters) and
which to run.

Owns the split of a model list against the store, for lists of any length: `ListPlan` reads
the list as a stream (twice: once to count, again to hand out the work), so a list of
millions of rows is never held, only hashes of the store's keys. Pure but for the store
reads it asks esd_worker.core.store.layout for (one listing of the store, with sizes; the markers of
listed models) and esd_worker.core.store.records (with skip_failed: one listing of _failures/,
then the records of listed models without a result, a batch at a time: a store of 100k
records never has them all in memory, and records of models not listed are not read).
A model is done when its marker has the same parameters and the files it vouches for are
listed at their sealed sizes: a deleted or truncated table makes the model run again (one
warning line each). Does not look at what is running: the backend knows that.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controller.keyset import Hashes, KeySet
from controller.results.counting import sealed_damage
from esd_worker.core.models.modellist import ModelRow, RowProblem, base_first
from esd_worker.core.store.layout import (
    MARKER_NAME,
    iter_failure_keys,
    iter_model_files,
    read_markers,
)
from esd_worker.core.store.marker import LAYERS_NAME, Marker, canonical_parameters
from esd_worker.core.store.records import FETCH_BATCH, FailureRecord, iter_failures
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

TODO, STALE, DONE, SKIPPED, REFIT = "todo", "stale", "done", "skipped", "refit"
# Markers of listed models read to compare their parameters. Beyond this many (a rerun of a
# list of millions), a marker counts as done by its presence in the listing: reading them
# all would cost one request each. The worker still compares parameters before it skips a
# model it is given, and `--overwrite` recomputes everything.
VERIFY_LIMIT = 100_000
# Adapters are put right after their base within chunks of this many rows (base_first needs
# the chunk in memory; a list ordered base-then-adapters loses nothing).
CHUNK_ROWS = 50_000
DAMAGE_LINES = 20  # damaged results named one line each, then only counted

Items = Callable[[], Iterable[ModelRow | RowProblem]]


@dataclass(frozen=True)
class StoreIndex:
    """What one listing of the store says about its models, as hashes (see KeySet).

    markers: keys with a result.json; whole: those that also have their layers.csv;
    files: (key, name, size) of every other file, to compare with a marker's seals.
    """

    markers: KeySet
    whole: KeySet
    files: KeySet

    @classmethod
    def of(cls, store: Store) -> StoreIndex:
        markers, tables, files = Hashes(), Hashes(), Hashes()
        for key, name, size in iter_model_files(store):
            if name == MARKER_NAME:
                markers.add(hash(key))
            else:
                files.add(hash((key, name, size)))
                if name == LAYERS_NAME:
                    tables.add(hash(key))
        marked = markers.unique()
        whole = np.intersect1d(marked, tables.unique(), assume_unique=True)
        return cls(KeySet.of_hashes(array("q", marked.tobytes())),
                   KeySet.of_hashes(array("q", whole.tobytes())),
                   KeySet.of_hashes(files.sorted()))

    def damage(self, key: str, marker: Marker) -> str | None:
        """What the listing shows wrong with the files `marker` seals (None: all there)."""
        return sealed_damage(key, marker, self.files)


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


@dataclass
class PlanCounts:
    """How many listed models are in each state (models: valid rows after duplicates and
    --limit; todo includes stale; refit: those of stale that ListPlan.refittable accepts,
    refitted from their eigenvalues rather than analysed unless `analyse_instead`)."""

    models: int = 0
    bad_rows: int = 0
    duplicates: int = 0
    done: int = 0
    todo: int = 0
    stale: int = 0
    damaged: int = 0
    skipped_failed: int = 0
    refit: int = 0

    @property
    def to_analyse(self) -> int:
        """The models a backend gets: todo less those refitted."""
        return self.todo - self.refit


@dataclass
class ListPlan:
    """A model list split against the store, read as a stream.

    items: a function that reads the list again each time it is called (rows and bad rows
    in file order: esd_worker.core.models.modellist.iter_model_list). `scan` reads it once: counts,
    bad
    rows (each handed to on_problem; the first 100 kept in `problems`), which markers have
    other parameters, which results are damaged (counted in todo and in `damaged`).
    `classify`, `rows` and `todo` read it again. on_done: given each marker the scan read
    and found done (the summary reuses them rather than reading them again). on_row: given
    each valid row the scan keeps, once (duplicates and rows past the limit are not).
    on_failure: with skip_failed, given (model_key, record) of each listed model that is
    not done and has a readable failure record, once (`esd-sweep status` lists them).
    Duplicates (same id and revision) are dropped, the first kept; `limit` applies to valid
    rows after that. overwrite / skip_failed: as `esd-sweep run` takes them.
    refittable: given each stale marker whose files the listing shows whole; True keeps the
    model out of `todo` (state REFIT: controller.run.refitrun refits it) until
    `analyse_instead` puts it back.
    """

    items: Items
    store: Store
    parameters: Mapping[str, Any]
    overwrite: bool = False
    skip_failed: bool = False
    limit: int | None = None
    verify_limit: int = VERIFY_LIMIT
    threads: int = 16
    on_problem: Callable[[RowProblem], None] | None = None
    on_done: Callable[[Marker], None] | None = None
    on_row: Callable[[ModelRow], None] | None = None
    on_failure: Callable[[str, FailureRecord], None] | None = None
    refittable: Callable[[Marker], bool] | None = None
    counts: PlanCounts = field(default_factory=PlanCounts)
    problems: list[RowProblem] = field(default_factory=list)
    verified: bool = True  # False: more markers than verify_limit, presence counted as done
    _present: KeySet = field(default_factory=KeySet)
    _markers: KeySet = field(default_factory=KeySet)
    _stale: set[str] = field(default_factory=set)
    _refit: set[str] = field(default_factory=set)  # of _stale: refitted, not analysed
    _unreadable: set[str] = field(default_factory=set)  # a marker that does not parse: todo
    _damaged: set[str] = field(default_factory=set)  # vouches for files not as sealed: todo
    _permanent: KeySet = field(default_factory=KeySet)  # listed, not done, permanent record
    _dropped: array[int] = field(default_factory=lambda: array("q"))  # duplicates' positions
    _scanned: bool = False

    def scan(self) -> ListPlan:
        """Read the store (one marker listing; with skip_failed, the listed models' failure
        records) and the list once; returns self."""
        if not self.overwrite:
            index = StoreIndex.of(self.store)
            self._markers, self._present = index.markers, index.whole
        # Which models have a record, from the listing alone (8 bytes each); a record is
        # read only for a listed model that is not done.
        failed = (KeySet(key for key, _ in iter_failure_keys(self.store))
                  if self.skip_failed else KeySet())
        permanent = Hashes()
        pending: list[str] = []  # listed, no result, a record: settled a batch at a time
        # One pass: a model without a marker is decided at once (or with its batch of
        # records); one with a marker is done, unless reading its marker (verify mode)
        # shows other parameters.
        to_verify: list[str] | None = []
        counts = self.counts
        present = 0
        for row in self._rows(count=True):
            key = row.key
            if key in self._present:
                present += 1
                if to_verify is not None:
                    to_verify.append(key)
                    if len(to_verify) > self.verify_limit:
                        to_verify = None
            elif key in failed:
                pending.append(key)
                if len(pending) >= FETCH_BATCH:
                    self._settle(pending, permanent)
                    pending = []
            else:
                self._todo(key)
        self._settle(pending, permanent)
        if to_verify is None:
            self.verified = False
            log.info("more than %d listed models have a result: a result counts as done "
                     "without reading its parameters (the worker checks them before it "
                     "skips a model; --overwrite recomputes all)", self.verify_limit)
        elif to_verify:
            wanted = canonical_parameters(self.parameters)  # once, not per marker
            markers = read_markers(self.store, to_verify, threads=self.threads)
            for key, marker in markers.items():
                if marker is None:
                    self._unreadable.add(key)
                elif marker.parameters != wanted:
                    self._stale.add(key)
                    if (self.refittable is not None and index.damage(key, marker) is None
                            and self.refittable(marker)):
                        self._refit.add(key)
                elif (damage := index.damage(key, marker)) is not None:
                    self._note_damaged(key, damage)
                elif self.on_done is not None:
                    self.on_done(marker)
            # Results that are not done after all (a damaged one without a table: counted
            # above) run again unless their record is permanent.
            redo = [key for key in self._stale | self._unreadable | self._damaged
                    if key in self._present]
            dead = set(self._permanent_among([key for key in redo if key in failed],
                                             permanent))
            for key in redo:
                if key in dead:
                    counts.skipped_failed += 1
                    self._refit.discard(key)
                else:
                    counts.todo += 1
                    counts.stale += key in self._stale
                    counts.refit += key in self._refit
                present -= 1
        self._permanent = KeySet.of_hashes(permanent.sorted())
        if counts.damaged > DAMAGE_LINES:
            log.warning("%d damaged result(s) in all run again (the first %d named above)",
                        counts.damaged, DAMAGE_LINES)
        counts.done = present
        return self

    def analyse_instead(self, key: str) -> None:
        """A model planned for a refit that could not be refitted: analysed after all."""
        if key in self._refit:
            self._refit.discard(key)
            self.counts.refit -= 1

    def _todo(self, key: str) -> None:
        """A listed model without a result (and no permanent record): to run."""
        self.counts.todo += 1
        if key in self._markers:  # a marker without its layer table
            self._note_damaged(key, f"{LAYERS_NAME} is missing")

    def _settle(self, keys: list[str], permanent: Hashes) -> None:
        """Listed models without a result that have a failure record: skipped when it is
        permanent, else to run (an unreadable record counts as none)."""
        dead = set(self._permanent_among(keys, permanent))
        for key in keys:
            if key in dead:
                self.counts.skipped_failed += 1
            else:
                self._todo(key)

    def _permanent_among(self, keys: list[str], permanent: Hashes) -> Iterator[str]:
        """Those of `keys` whose record is permanent (each added to `permanent`); every
        record read goes to on_failure."""
        for key, record in iter_failures(self.store, keys, threads=self.threads):
            if self.on_failure is not None:
                self.on_failure(key, record)
            if not record.retryable:
                permanent.add(hash(key))
                yield key

    def _note_damaged(self, key: str, damage: str) -> None:
        """A result whose files are not what its marker vouches for: not done, said once."""
        self._damaged.add(key)
        self.counts.damaged += 1
        if self.counts.damaged <= DAMAGE_LINES:
            log.warning("model_key=%s is not done: %s; it runs again", key, damage)

    def _rows(self, *, count: bool = False) -> Iterator[ModelRow]:
        """The list's valid rows without duplicates, up to limit. count (the scan): tally,
        find the duplicates with a set of (id, revision) hashes that lives for this pass
        only, and note their positions; later passes skip those positions and hold
        nothing (a set for 2M rows is ~130 MB, the controller's largest)."""
        if not count and not self._scanned:
            raise RuntimeError("ListPlan.scan() first")
        seen: set[int] = set()
        dropped = iter(self._dropped)
        next_dropped = next(dropped, -1)
        kept = 0
        for position, item in enumerate(self.items()):
            if isinstance(item, RowProblem):
                if count:
                    self.counts.bad_rows += 1
                    if len(self.problems) < 100:
                        self.problems.append(item)
                    if self.on_problem is not None:
                        self.on_problem(item)
                continue
            if self.limit is not None and kept >= self.limit:
                if count:
                    continue  # bad rows after the limit are still reported
                return
            if count:
                ident = hash((item.model_id, item.revision))
                if ident in seen:
                    self.counts.duplicates += 1
                    self._dropped.append(position)
                    continue
                seen.add(ident)
                self.counts.models += 1
                if self.on_row is not None:
                    self.on_row(item)
            elif position == next_dropped:
                next_dropped = next(dropped, -1)
                continue
            kept += 1
            yield item
        self._scanned = self._scanned or count

    def classify(self) -> Iterator[tuple[ModelRow, str]]:
        """Every listed model (list order) with its state: todo, stale, refit, done or
        skipped."""
        for row in self._rows():
            key = row.key
            if key in self._present and not (
                    key in self._stale or key in self._unreadable or key in self._damaged):
                yield row, DONE
            elif key in self._permanent:
                yield row, SKIPPED
            elif key in self._refit:
                yield row, REFIT
            else:
                yield row, STALE if key in self._stale else TODO

    def rows(self) -> Iterator[ModelRow]:
        """The listed models (valid, first of duplicates, up to limit), in list order."""
        return self._rows()

    def todo(self) -> Iterator[ModelRow]:
        """The models to analyse, in run order: list order, except that an adapter comes
        right after its base (within chunks of CHUNK_ROWS), so a worker downloads the base
        once for both."""
        chunk: list[ModelRow] = []
        for row, state in self.classify():
            if state in (TODO, STALE):
                chunk.append(row)
                if len(chunk) >= CHUNK_ROWS:
                    yield from base_first(chunk)
                    chunk = []
        yield from base_first(chunk)


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
    plan = ListPlan(lambda: models, store, parameters, overwrite=overwrite,
                    skip_failed=skip_failed, verify_limit=len(models), threads=threads).scan()
    split: dict[str, list[ModelRow]] = {TODO: [], STALE: [], DONE: [], SKIPPED: []}
    for row, state in plan.classify():
        split[state].append(row)
        if state == STALE:
            split[TODO].append(row)
    return Plan(todo=tuple(split[TODO]), done=tuple(split[DONE]),
                skipped_failed=tuple(split[SKIPPED]), stale=tuple(split[STALE]))
