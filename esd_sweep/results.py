"""`esd_sweep.load`: a sweep's store (a folder or s3://…) as DataFrames, read only.

Owns the notebook's view of a store: the done models (the models table), their layers
(the layers table, with WeightWatcher's columns: esd_sweep.frames), summary.csv, the
failure records, one model's eigenvalues. The reading is the controller's
(controller.results: newest row per model, parts a batch at a time, models no part holds
yet from their own files), so a DataFrame here and `esd-sweep report` agree. Never writes,
never takes the output's lease: it can read a store a sweep is writing.

"One run or all": a store holds every run made into it; `model_list` narrows every table
to the models of one list (the list a run was given), as `esd-sweep status` counts them.
"""

from __future__ import annotations

import io
import re
from collections.abc import Collection, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from controller.results.reader import ModelResult, open_results, read_eigs
from controller.results.reportfit import fit_of
from controller.results.tables import Tables
from esd_sweep.frames import typed, with_ww_columns
from esd_worker.core.echo import echo
from esd_worker.core.models.modellist import ListFile, ModelRow
from esd_worker.core.models.naming import ref_key
from esd_worker.core.store.layout import SUMMARY_BYTES, SUMMARY_KEY, read_marker
from esd_worker.core.store.records import read_failures
from esd_worker.core.store.stores import Store

_KEY = re.compile(r"[a-z0-9-]{0,80}-[0-9a-f]{10}")
TEXT_CHARS = 2000  # of a record's text in failures(): a whole error line, never a whole log
_INT_MODEL_COLUMNS = ("tensors_skipped",)  # may be NA: nullable Int64, not float
FAILURE_COLUMNS = ("model_id", "model_key", "error", "exit_code", "signal", "retryable",
                   "attempts", "last_error", "run_id", "time")


def load(output: str, *, model_list: str | None = None) -> Sweep:
    """The results at `output` (a folder, file://… or s3://bucket/prefix; S3 credentials
    from the environment, as `esd-sweep` takes them). model_list: a model-list CSV (a file
    or URL): only its models are read."""
    return Sweep(open_results(output), model_list=model_list)


class Sweep:
    """A store's results as DataFrames; each call reads the store anew (a sweep may be
    writing it)."""

    def __init__(self, store: Store, *, model_list: str | None = None) -> None:
        self.store = store
        self.keys: frozenset[str] | None = None
        if model_list is not None:
            self.keys = frozenset(_list_keys(model_list))

    def models(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """One row per done model: ids, relation, base, architecture, family, size, device,
        timings, its summary statistics (typed), its coverage (params_analysed_share,
        tensors_skipped: NA where not recorded; `coverage`: the marker's, as JSON) and its
        fit (`fit`: a label)."""
        frame = self._frame(Tables(self.store).models(self._columns(columns)))
        if "parameters" in frame and not frame.empty:  # as the report labels each model
            frame["fit"] = [fit_of(p).label if p else "" for p in frame["parameters"]]
        for column in _INT_MODEL_COLUMNS:  # a count stays a count beside NAs
            if column in frame:
                frame[column] = frame[column].astype("Int64")
        return frame

    def layers(self, columns: Sequence[str] | None = None, *,
               models: Collection[str] | None = None) -> pd.DataFrame:
        """One row per layer of every done model (or of `models`: model ids or keys), with
        WeightWatcher's column names and extras (esd_sweep.frames)."""
        wanted = None if models is None else {_key(m) for m in models}
        frame = self._frame(Tables(self.store).layers(self._columns(columns)), only=wanted)
        if columns is not None or frame.empty:
            return typed(frame)
        return with_ww_columns(typed(frame))

    def summary(self) -> pd.DataFrame:
        """summary.csv, as the last run or report wrote it (one row per done model)."""
        data = self.store.get_bytes(SUMMARY_KEY, limit=SUMMARY_BYTES)
        if data is None:
            raise FileNotFoundError(f"{SUMMARY_KEY} is not in the store yet: `esd-sweep run` "
                                    "writes it when a run ends; models() reads the same "
                                    "numbers from the results tables")
        frame = pd.read_csv(io.BytesIO(data))
        if self.keys is not None and "model_key" in frame:
            frame = frame[frame["model_key"].isin(self.keys)].reset_index(drop=True)
        return frame

    def failures(self) -> pd.DataFrame:
        """One row per failure record (`_failures/`): the model, the error class, exit code,
        whether a next run retries it, attempts and the last line the worker logged. The
        texts a record holds are shown as every output shows them (echo: redacted, control
        characters escaped): an older or hostile writer may have redacted nothing."""
        rows = [{
            "model_id": echo(r.model, limit=TEXT_CHARS), "model_key": r.model_key,
            "error": echo(r.error, limit=TEXT_CHARS), "exit_code": r.exit_code,
            "signal": r.signal, "retryable": r.retryable, "attempts": r.attempts,
            "last_error": echo(r.stderr_tail[-1], limit=TEXT_CHARS) if r.stderr_tail else "",
            "run_id": echo(r.run_id, limit=TEXT_CHARS), "time": r.time,
        } for key, r in sorted(read_failures(self.store).items())
            if self.keys is None or key in self.keys]
        return pd.DataFrame(rows, columns=list(FAILURE_COLUMNS))

    def eigenvalues(self, model: str, layer: str | None = None
                    ) -> dict[str, np.ndarray] | np.ndarray:
        """A done model's stored eigenvalues (eigs.npz): {layer: eigenvalues}, or one
        layer's (its `layer` name, with or without ".weight")."""
        key = _key(model)
        marker = read_marker(self.store, key)
        if marker is None:
            raise KeyError(f"{model} is not done in this store")
        eigs = read_eigs(self.store, ModelResult(key, marker, []))
        if eigs is None:
            raise KeyError(f"{model} was analysed without its eigenvalues (--no-eigs)")
        if layer is None:
            return eigs
        for name in (layer, f"{layer}.weight"):
            if name in eigs:
                return eigs[name]
        raise KeyError(f"{model} has no eigenvalues of a layer {layer!r}")

    def _columns(self, columns: Sequence[str] | None) -> list[str] | None:
        if columns is None:
            return None
        return list(dict.fromkeys([*columns, "model_key"]))  # the key filters by list

    def _frame(self, batches: Iterator[pa.RecordBatch],
               only: Collection[str] | None = None) -> pd.DataFrame:
        """The batches' rows of the listed models (and of `only`) as one DataFrame."""
        keep = self.keys if only is None else (
            frozenset(only) if self.keys is None else self.keys & frozenset(only))
        wanted = None if keep is None else pa.array(sorted(keep), pa.string())  # once a call
        tables = []
        for batch in batches:
            if wanted is not None:
                batch = batch.filter(pc.is_in(batch.column("model_key"), value_set=wanted))
            if batch.num_rows:
                tables.append(pa.Table.from_batches([batch]))
        if not tables:
            return pd.DataFrame()
        return pa.concat_tables(tables, promote_options="default").to_pandas()


def _key(model: str) -> str:
    """A model's key from its id (`org/name[@rev]`, a folder) or its key as given."""
    return model if _is_key(model) else ref_key(model)


def _is_key(text: str) -> bool:
    """A model key (esd_worker.core.models.naming: a slug, "-", 10 hex digits), not an id."""
    return _KEY.fullmatch(text) is not None


def _list_keys(model_list: str) -> Iterator[str]:
    listed = ListFile(model_list)
    try:
        for item in listed.items():
            if isinstance(item, ModelRow):
                yield item.key
    finally:
        listed.close()

