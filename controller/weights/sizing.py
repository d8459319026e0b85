"""The bytes of a model's weights before any download, so that the shard plan can balance bytes.

Owns where a size comes from: the model list's size_bytes column, a local directory's weight
files, or the HF hub's file metadata, else a default; how many hub lookups a plan makes (a
bounded number; memoised; none once the hub is taken as down) and what a failed one means
(the default size, logged); and how the list's numeric columns are read (ListNumbers: a bad
cell is unknown, said once). Its lookups also serve controller.weights.weightmeta (the model
info's parameter count, a safetensors header's bytes through a Range request), within the
same limits. Which files count as weights is esd_worker.core.models.weightfiles' rule, the one
the worker downloads by; the HTTP requests (rate, retries, token) are
controller.weights.hubclient's. Does not download anything, parse headers
(controller.weights.weightmeta), decide which class or shard a model goes to
(controller.backends.kubernetes.sharded.plan), or report hub errors as the model's failure:
the worker meets them again and records them.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from controller.weights.hubclient import HubClient, HubInfo, LookupFailed
from esd_worker.core.command.flags import MAX_BYTES, parse_size
from esd_worker.core.echo import quoted
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import is_local_path, parse_ref
from esd_worker.core.models.weightfiles import weight_names

log = logging.getLogger(__name__)

SIZE_COLUMN = "size_bytes"  # an optional model-list column (ModelRow.metadata) that gives the size
MAX_MODEL_BYTES = MAX_BYTES  # 1000T: a size_bytes past it is no model's

# Lookups in a row that ran out of attempts: the hub is taken as down for the rest of the
# plan, rather than spending the retries' waits on each of thousands of models.
_DOWN_AFTER = 5
_WARNED_FAILURES = 5  # failed lookups logged one by one; the rest only in the stats

Source = Literal["column", "local", "hub", "default", "failed"]  # a SizeStats field


@dataclass
class SizeStats:
    """How many size() answers came from where. column, local, hub: found there; failed: a
    local directory or hub lookup that could not give a size; default: not looked up (offline,
    past the lookup limit, the hub taken as down). failed and default answers are the default
    size."""

    column: int = 0
    local: int = 0
    hub: int = 0
    default: int = 0
    failed: int = 0


class Sizer:
    """The bytes a model's weights take, before any download: the list's size_bytes column, else
    the weight files of a local directory (esd_worker.core.models.weightfiles: what the worker
    downloads and reads), else the hub's file metadata (GET
    {endpoint}/api/models/{id}/revision/{rev or main}?blobs=true: the siblings' sizes of the
    weight files; for an adapter, adapter_config.json among them: its adapter files), else
    `default_bytes` (counted in `stats`; log_stats() logs them once, at the end).

    Hub lookups go through `hub` (controller.weights.hubclient.HubClient: at most
    `rate_per_s` requests a second, 429 and 5xx retried up to 4 requests in all, honouring
    Retry-After; HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE from the environment unless given;
    clock and sleep injectable); at most `lookup_limit` lookups in all (beyond: the default,
    so that planning a 2M-row list never makes 2M hub calls; the log says to add a
    size_bytes column); 401/403/404 and other answers: the default (the worker reports the
    real error). After 5 lookups in a row that ran out of retries the hub is taken as down:
    the rest get the default. Results are memoised per ref (an adapter's base asked twice
    costs one call), those of the size_bytes column excepted (nothing to save, and a 2M-row
    list would be kept).
    hub_info (the same model-info answer) and read_range (a header's bytes) serve
    controller.weights.weightmeta; a read_range is a lookup of its own.
    """

    def __init__(
        self, *, endpoint: str | None = None, token: str | None = None,
        rate_per_s: float = 5.0, lookup_limit: int = 10_000, default_bytes: int = 2 * 1024**3,
        timeout_s: float = 10.0, offline: bool | None = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if lookup_limit < 0 or default_bytes < 0:
            raise ValueError("lookup_limit and default_bytes must be >= 0")
        self.hub = HubClient(endpoint=endpoint, token=token, rate_per_s=rate_per_s,
                             timeout_s=timeout_s, offline=offline, clock=clock, sleep=sleep)
        self.endpoint = self.hub.endpoint
        self.offline = self.hub.offline
        self.lookup_limit = lookup_limit
        self.default_bytes = default_bytes
        self.stats = SizeStats()
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[int, Source]] = {}  # ref -> (bytes, SizeStats field)
        self._infos: dict[str, tuple[HubInfo | None, Source]] = {}  # ref -> the hub's answer
        self._lookups = 0
        self._failures_in_a_row = 0
        self._hub_down = False
        self.cells = ListNumbers()  # also controller.weights.weightmeta's (num_params, matrix_dim)

    def size(self, row: ModelRow) -> int:
        """The weights' bytes of `row` (an estimate: the default when nothing else is known)."""
        column = self._column_size(row)
        if column is not None:
            return self._answer(column, "column")
        with self._lock:
            memo = self._memo.get(row.ref)
        if memo is not None:
            return self._answer(*memo)
        if is_local_path(row.model_id):
            size, source = self._local_size(row)
        else:
            size, source = self._hub_size(row)
        if source != "default":
            with self._lock:
                self._memo[row.ref] = (size, source)
        return self._answer(size, source)

    def base_size(self, source_model: str) -> int:
        """The bytes of an adapter's base, named as its row's source_model is (id[@revision]
        or a local path): sized as a model of its own (size()), so the hub is asked once per
        distinct base however many adapters name it (memoised per ref); 0 for a name that
        is no model reference (the worker reports that adapter's error). The list's own
        size_bytes of a listed base is the shard plan's to use first (plan.with_bases)."""
        row = base_row(source_model)
        return 0 if row is None else self.size(row)

    def log_stats(self) -> None:
        """One line on the sizes: where they came from, and how many are the default."""
        s = self.stats
        guessed = s.default + s.failed
        level = logging.WARNING if guessed else logging.INFO
        log.log(level, "model sizes: %d from the %s column, %d local, %d from the hub, %d the "
                "default %d bytes (%d lookups failed)%s", s.column, SIZE_COLUMN, s.local, s.hub,
                guessed, self.default_bytes, s.failed,
                f"; add a {SIZE_COLUMN} column to the list for balanced shards" if guessed
                else "")

    # --- where a size comes from --------------------------------------------------------------

    def _answer(self, size: int, source: Source) -> int:
        with self._lock:
            setattr(self.stats, source, getattr(self.stats, source) + 1)
        return size if source in ("column", "local", "hub") else self.default_bytes

    def _column_size(self, row: ModelRow) -> int | None:
        return self.cells.read(row, SIZE_COLUMN, parse_size, lo=0, hi=MAX_MODEL_BYTES,
                               what="a size from 0 to 1000T bytes")

    def _local_size(self, row: ModelRow) -> tuple[int, Source]:
        try:
            sizes = local_files(os.path.expanduser(row.model_id))
        except OSError as e:
            log.warning("model=%s: cannot size the local directory (%s); the default size is used",
                        row.ref, e.strerror or e)
            return 0, "failed"
        return sum(sizes[n] for n in weight_names(sizes)), "local"

    def _hub_size(self, row: ModelRow) -> tuple[int, Source]:
        info, source = self._hub_lookup(row)
        if info is None:
            return 0, source
        return sum(info.files[n] for n in weight_names(info.files)), "hub"

    # --- the hub's answers, for sizes and for controller.weights.weightmeta
    # -----------------------------

    def hub_info(self, row: ModelRow) -> HubInfo | None:
        """The hub's model info of `row` (one lookup, shared with size(): memoised), or None:
        offline, past the lookup limit, the hub taken as down, or the lookup failed."""
        return self._hub_lookup(row)[0]

    def read_range(self, row: ModelRow, filename: str, start: int, end: int) -> bytes | None:
        """Bytes start..end (inclusive) of one of `row`'s files on the hub (HubClient.
        read_range). A lookup of its own (the same limit, rate and retries); None when none
        may be made or it failed."""
        if not self._take_lookup():
            return None
        try:
            return self.hub.read_range(row.model_id, row.revision, filename, start, end)
        except LookupFailed as e:
            log.debug("model=%s: no bytes %d-%d of %s from the hub (%s)", row.ref, start, end,
                      filename, e)
            return None

    def _hub_lookup(self, row: ModelRow) -> tuple[HubInfo | None, Source]:
        with self._lock:
            known = self._infos.get(row.ref)
        if known is not None:
            return known
        if not self._take_lookup():
            return None, "default"
        answer: tuple[HubInfo | None, Source]
        try:
            answer = self.hub.model_info(row.model_id, row.revision), "hub"
        except LookupFailed as e:
            self._lookup_failed(row, e)
            answer = None, "failed"
        else:
            with self._lock:
                self._failures_in_a_row = 0
        with self._lock:
            self._infos[row.ref] = answer
        return answer

    def _take_lookup(self) -> bool:
        """Whether a hub lookup may be made now (counted when it may)."""
        with self._lock:
            if self.offline or self._hub_down:
                return False
            if self._lookups >= self.lookup_limit:
                if self._lookups == self.lookup_limit:
                    self._lookups += 1  # warn once
                    log.warning("%d hub lookups made, the limit: the other models get the "
                                "default size (%d bytes) and one GPU; add a %s column to the "
                                "list", self.lookup_limit, self.default_bytes, SIZE_COLUMN)
                return False
            self._lookups += 1
            return True

    def _lookup_failed(self, row: ModelRow, error: LookupFailed) -> None:
        with self._lock:
            failed = self.stats.failed + 1  # this one is counted by _answer
            self._failures_in_a_row = self._failures_in_a_row + 1 if error.transient else 0
            down = not self._hub_down and self._failures_in_a_row >= _DOWN_AFTER
            self._hub_down = self._hub_down or down
        if failed <= _WARNED_FAILURES:
            log.warning("model=%s: no metadata from the hub (%s); its size is the default and "
                        "it gets one GPU%s",
                        row.ref, error, "; further failures are only counted"
                        if failed == _WARNED_FAILURES else "")
        if down:
            log.warning("the hub at %s failed %d lookups in a row: the other models get the "
                        "default size and one GPU", self.endpoint, _DOWN_AFTER)

def local_files(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The bytes of a local model's files that the weights rule looks at: those at its top
    and in its folders (relative names, "/"-separated: unet/config.json), hidden ones left
    out. OSError when the directory cannot be read."""
    sizes: dict[str, int] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_file():
                sizes[entry.name] = entry.stat().st_size
            elif entry.is_dir():
                with os.scandir(entry.path) as inner:
                    sizes.update({f"{entry.name}/{f.name}": f.stat().st_size
                                  for f in inner if f.is_file()})
    return sizes


def base_row(source_model: str) -> ModelRow | None:
    """An adapter's base as a row of its own (no relation, no columns), from the name its
    source_model gives; None when that is no model reference."""
    model_id, revision, problem = parse_ref(source_model)
    return None if problem is not None else ModelRow(model_id, revision, "", None)


class ListNumbers:
    """The numbers of the list's optional numeric columns (size_bytes here; num_params and
    matrix_dim for controller.weights.weightmeta). A cell that is not a finite number in its
    column's range (NaN, inf, 1e999, negative, past any model, not a number) is unknown, as
    if empty, never an error; the first such cell of each column is logged (its line, the
    column, the cell, bounded), later ones are not: a list of millions of rows may have as
    many bad cells. Thread-safe (the local backend asks from a look-ahead thread)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def read(self, row: ModelRow, name: str, parse: Callable[[str], float | None], *,
             lo: int, hi: int, what: str) -> int | None:
        """`row`'s cell of column `name` through `parse` (None, ValueError, OverflowError or
        ArgumentTypeError: not a number), when it is within lo..hi; else None. `what`
        describes the range for the warning ("a size from 0 to 1000T bytes")."""
        raw = list_cell(row.metadata, name)
        if not raw:
            return None
        try:
            value = parse(raw)
            fits = value is not None and math.isfinite(value) and lo <= value <= hi
        except (ValueError, OverflowError, argparse.ArgumentTypeError):
            fits = False
        if fits and value is not None:
            return int(value)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            log.warning("line %d: %s %s is not %s: read as empty, as if the list had no %s "
                        "for the model (further bad %s cells are not logged)", row.line, name,
                        quoted(raw, limit=40), what, name, name)
        return None


def list_cell(metadata: Mapping[str, str], name: str) -> str:
    """An optional model-list column's cell (size_bytes, num_params, …; the header spelt in
    any case, '-' or ' ' for '_'), stripped; "" if none."""
    if name in metadata:
        return metadata[name].strip()
    for key, value in metadata.items():
        if key.strip().lower().replace("-", "_").replace(" ", "_") == name:
            return value.strip()
    return ""
