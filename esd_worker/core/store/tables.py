"""The results tables: every done model's row (`models`) and its layers' rows (`layers`) as
Parquet parts under `_tables/`, written whole as work finishes.

Derived data: the per-model files and their markers stay the source of truth; a part is a
copy of what they say, made by the worker that finished the models (serve.batch) or by
`esd-sweep compact` (controller.results.compact), which also merges small parts. Parts are
partitioned by architecture (`_tables/<table>/arch=<Arch>/<part_id>.parquet`, hive style)
so that a reader of one architecture reads only its parts; a part's two tables share one
part id and its layers part is written before its models part, so a models row always has
its layers in the store.

A model may sit in more than one part (analysed again with other settings, or a part that
compact has not yet merged): its newest row (by `finished_at`, then part id) is the one that
counts (controller.results.tables). Owns the columns, their types, the part keys and the
rows made from a marker; not how many parts are read (controller.results.tables).
"""

from __future__ import annotations

import io
import json
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from esd_worker.core.store.layout import MARKER_NAME, TABLES_PREFIX
from esd_worker.core.store.marker import Marker, canonical_parameters
from esd_worker.core.store.results import (
    LAYER_COLUMNS,
    SUMMARY_FIELDS,
    number,
    summarize_layers,
)
from esd_worker.core.store.stores import Store

MODELS_TABLE = "models"
LAYERS_TABLE = "layers"
TABLES = (MODELS_TABLE, LAYERS_TABLE)
PART_SUFFIX = ".parquet"
UNKNOWN_ARCH = "unknown"

_ARCH_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PART_KEY = re.compile(
    r"_tables/(models|layers)/arch=([A-Za-z0-9_.-]{1,64})/([A-Za-z0-9_.-]{1,120})\.parquet")
# The suffixes an architecture's class name carries after its family's name.
_ARCH_SUFFIX = re.compile(
    r"(For[A-Z][A-Za-z]*|LMHeadModel|Model|PreTrainedModel|Encoder|Decoder)$")

_INT_LAYER_COLUMNS = frozenset(
    {"M", "N", "num_params", "num_evals", "num_pl_spikes", "matrix_rank"})
_TEXT_LAYER_COLUMNS = frozenset(
    {"model_id", "revision", "layer", "layer_type", "fix_fingers", "status", "quantization"})
_INT_STATS = frozenset({"layers", "layers_ok"})

# models: who the model is, what it is, the summary statistics (typed, for queries), and
# `summary_part`: summary.csv's marker part as JSON, so that a summary read from the tables
# is byte for byte the one read from the markers (an int total_s stays an int).
MODEL_SCHEMA = pa.schema([
    ("model_key", pa.string()),
    ("model", pa.string()),
    ("model_id", pa.string()),
    ("revision", pa.string()),
    ("relation", pa.string()),
    ("base_model", pa.string()),
    ("architecture", pa.string()),
    ("family", pa.string()),
    ("num_params", pa.int64()),
    *((col, pa.int64() if col in _INT_STATS else pa.float64()) for col in SUMMARY_FIELDS),
    # What of the checkpoint the rows cover (coverage_cells; parts written before them have
    # none of these three): the share of its parameters analysed, the tensors skipped by a
    # rule, and the marker's `coverage` whole as JSON (the report's model pages show it).
    ("params_analysed_share", pa.float64()),
    ("tensors_skipped", pa.int64()),
    ("coverage", pa.string()),
    ("device", pa.string()),
    ("total_s", pa.float64()),
    ("finished_at", pa.string()),
    ("parameters", pa.string()),
    ("summary_part", pa.string()),
    # What the row vouches for: the size of its marker (result.json) and of each file the
    # marker seals, as JSON ({"layers.csv": 3013, "result.json": 2210}), so that a reader
    # counts the row only while one listing of the store shows those files at those sizes
    # (controller.results.tables). Parts written before it have no such column.
    ("files", pa.string()),
])
# Columns a part may lack (written by an older version): everything else must be there,
# with its type, or the part is not read (controller.results.tables).
OPTIONAL_COLUMNS = frozenset(
    {"files", "quantization", "params_analysed_share", "tensors_skipped", "coverage"})
LAYER_SCHEMA = pa.schema([
    ("model_key", pa.string()),
    ("finished_at", pa.string()),
    ("layer_index", pa.int64()),
    *((col, pa.int64() if col in _INT_LAYER_COLUMNS
       else pa.string() if col in _TEXT_LAYER_COLUMNS else pa.float64())
      for col in LAYER_COLUMNS),
])
SCHEMAS = {MODELS_TABLE: MODEL_SCHEMA, LAYERS_TABLE: LAYER_SCHEMA}


# -- keys --------------------------------------------------------------------------------------


def arch_partition(architecture: str | None) -> str:
    """The partition value of an architecture: its name with unsafe characters as `_`."""
    if not architecture:
        return UNKNOWN_ARCH
    return _ARCH_UNSAFE.sub("_", architecture)[:64] or UNKNOWN_ARCH


def family_of(architecture: str | None) -> str:
    """A model's family from its architecture's class name: `LlamaForCausalLM` → `llama`,
    `GPT2LMHeadModel` → `gpt2`, `BertModel` → `bert`; `unknown` without one."""
    if not architecture:
        return UNKNOWN_ARCH
    stem = _ARCH_SUFFIX.sub("", architecture) or architecture
    return stem.lower()


def table_prefix(table: str) -> str:
    return f"{TABLES_PREFIX}{table}/"


def part_key(table: str, arch: str, part_id: str) -> str:
    return f"{table_prefix(table)}arch={arch}/{part_id}{PART_SUFFIX}"


@dataclass(frozen=True)
class PartKey:
    """A part's place: its table, its architecture partition and its id."""

    table: str
    arch: str
    part_id: str

    @property
    def key(self) -> str:
        return part_key(self.table, self.arch, self.part_id)


def parse_part_key(key: str) -> PartKey | None:
    """The PartKey a store key names; None for anything else (temp files, strays)."""
    match = _PART_KEY.fullmatch(key)
    return None if match is None else PartKey(*match.groups())


def new_part_id() -> str:
    """Time first, so that ids sort by when parts were written, then 48 random bits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(6)


# -- rows --------------------------------------------------------------------------------------


def device_text(device: Mapping[str, Any] | None) -> str | None:
    """The marker's device object as text, e.g. `cuda (NVIDIA H100 80GB HBM3)`, `cpu (x86_64)`."""
    if device is None:
        return None
    kind, name = device.get("type"), device.get("name")
    if kind and name:
        return f"{kind} ({name})"
    return str(kind or name) if (kind or name) else None


def _count(value: Any) -> int | None:
    """A count a marker's coverage holds: an int >= 0 (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def coverage_cells(coverage: Mapping[str, Any] | None) -> tuple[float | None, int | None]:
    """(params_analysed_share, tensors_skipped) of a marker's `coverage`: the analysed
    parameters over those the checkpoint holds (None when it holds none) and the tensors
    skipped by every rule together; both None without a coverage (markers written before
    it) or where it does not hold those counts."""
    if not isinstance(coverage, Mapping):
        return None, None
    analysed = coverage.get("analysed")
    held = _count(coverage.get("parameters"))
    done = _count(analysed.get("parameters")) if isinstance(analysed, Mapping) else None
    share = done / held if held and done is not None else None
    skipped = coverage.get("skipped")
    counts = ([_count(rule.get("tensors")) if isinstance(rule, Mapping) else None
               for rule in skipped.values()] if isinstance(skipped, Mapping) else [None])
    return share, None if None in counts else sum(c for c in counts if c is not None)


def marker_part(marker: Marker, stats: Mapping[str, Any]) -> dict[str, Any]:
    """What a summary.csv row takes from the marker (the rest comes from the model list)."""
    base = marker.base_model
    share, skipped = coverage_cells(marker.coverage)
    return {
        "model_key": marker.model_key,
        "relation": marker.relation or "",
        "base_model": base.model if base is not None else None,
        **{col: stats.get(col) for col in SUMMARY_FIELDS},
        "params_analysed_share": share,
        "tensors_skipped": skipped,
        "device": device_text(marker.device),
        # As stored, not Marker.total_s: an int stays an int in the CSV.
        "total_s": marker.timings.get("total_s"),
        "finished_at": marker.finished_at,
    }


def parameters_text(parameters: Mapping[str, Any]) -> str:
    """A marker's parameters as one canonical JSON text (equal settings, equal text)."""
    return json.dumps(canonical_parameters(parameters), sort_keys=True, separators=(",", ":"))


def _int(value: Any) -> int | None:
    f = number(value)
    return int(f) if math.isfinite(f) else None


def _float(value: Any) -> float | None:
    f = number(value)
    return None if value is None or value == "" else f


def _layer_cell(column: str, value: Any) -> Any:
    if column in _TEXT_LAYER_COLUMNS:
        return None if value is None or value == "" else str(value)
    if column in _INT_LAYER_COLUMNS:
        return _int(value)
    return number(value)


@dataclass(frozen=True)
class DoneModel:
    """One done model as the tables hold it: its marker and its layer rows (dicts as in
    layers.csv: the CSV's strings or the worker's numbers). marker_size: the bytes of the
    marker as stored, when it was read from the store (else the size of marker.to_json(),
    which is what write_model_result writes)."""

    marker: Marker
    layers: Sequence[Mapping[str, Any]]
    marker_size: int | None = None

    def vouched_sizes(self) -> dict[str, int]:
        """The size of each file this row is made from: the marker and what it seals."""
        sizes = {name: seal.size for name, seal in self.marker.files.items()}
        sizes[MARKER_NAME] = (self.marker_size if self.marker_size is not None
                              else len(self.marker.to_json()))
        return sizes

    @property
    def arch(self) -> str:
        return arch_partition(self.marker.architecture)

    def model_row(self) -> dict[str, Any]:
        marker = self.marker
        stats = marker.summary if marker.summary is not None else summarize_layers(self.layers)
        part = marker_part(marker, stats)
        params = [_int(row.get("num_params")) for row in self.layers]
        row: dict[str, Any] = {
            "model_key": marker.model_key,
            "model": marker.model,
            "model_id": marker.model_id,
            "revision": marker.revision,
            # As people read it: an adapter without a listed relation is an "adapter".
            "relation": marker.relation or ("adapter" if marker.adapter is not None else ""),
            "base_model": part["base_model"],
            "architecture": marker.architecture,
            "params_analysed_share": part["params_analysed_share"],
            "tensors_skipped": part["tensors_skipped"],
            "coverage": (None if marker.coverage is None else
                         json.dumps(marker.coverage, sort_keys=True, separators=(",", ":"))),
            "family": family_of(marker.architecture),
            "num_params": sum(p for p in params if p is not None) if self.layers else None,
            "device": part["device"],
            "total_s": _float(marker.timings.get("total_s")),
            "finished_at": marker.finished_at,
            "parameters": parameters_text(marker.parameters),
            "summary_part": json.dumps(part, separators=(",", ":")),
            "files": json.dumps(self.vouched_sizes(), sort_keys=True, separators=(",", ":")),
        }
        for col in SUMMARY_FIELDS:
            row[col] = _int(stats.get(col)) if col in _INT_STATS else _float(stats.get(col))
        return row

    def layer_rows(self) -> Iterable[dict[str, Any]]:
        key, finished = self.marker.model_key, self.marker.finished_at
        for i, layer in enumerate(self.layers):
            row = {"model_key": key, "finished_at": finished, "layer_index": i}
            for col in LAYER_COLUMNS:
                row[col] = _layer_cell(col, layer.get(col))
            yield row


def _table(schema: pa.Schema, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=schema)


def part_tables(models: Iterable[DoneModel]) -> dict[str, tuple[pa.Table, pa.Table]]:
    """arch → (models table, layers table) of these models."""
    rows: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for done in models:
        model_rows, layer_rows = rows.setdefault(done.arch, ([], []))
        model_rows.append(done.model_row())
        layer_rows.extend(done.layer_rows())
    return {arch: (_table(MODEL_SCHEMA, m), _table(LAYER_SCHEMA, ly))
            for arch, (m, ly) in rows.items()}


def table_bytes(table: pa.Table) -> bytes:
    """A whole Parquet file (zstd; statistics kept, so a reader can skip row groups)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=256 * 1024)
    return buf.getvalue()


def write_part(store: Store, arch: str, models: pa.Table, layers: pa.Table,
               part_id: str | None = None) -> PartKey:
    """Write one part's two tables (each whole: Store.put_bytes writes a temp name and then
    the key), layers first; the models part, written last, is what makes it count."""
    part_id = part_id or new_part_id()
    store.put_bytes(part_key(LAYERS_TABLE, arch, part_id), table_bytes(layers))
    store.put_bytes(part_key(MODELS_TABLE, arch, part_id), table_bytes(models))
    return PartKey(MODELS_TABLE, arch, part_id)


def write_parts(store: Store, models: Iterable[DoneModel]) -> list[PartKey]:
    """One part (models + layers) per architecture of these models; their PartKeys."""
    return [write_part(store, arch, m, ly) for arch, (m, ly) in part_tables(models).items()]
