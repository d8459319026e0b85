"""The model list: read and validate the CSV (or one --single-model), one problem per bad row.

Owns the CSV layouts users have (both old tools' column orders), relations, duplicates and
--limit. The file's text and its CSV records (quotes that do not balance included) are
esd_worker.core.models.listcsv's; what a name means (a local path or a hub id), its syntax,
its spelling and its key are esd_worker.core.models.naming's, which every row goes through
(parse_ref). Does not resolve models on the hub: the worker does that.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO

from esd_worker.core.echo import LineCap, echo, quoted
from esd_worker.core.errors import ModelListError
from esd_worker.core.models.listcsv import csv_records, open_text, read_url
from esd_worker.core.models.naming import (
    folder_warning,
    is_local_path,
    local_path,
    model_key,
    parse_ref,
)

RELATIONS: tuple[str, ...] = (
    "",
    "base",
    "finetune",
    "adapter",
    "lora",
    "peft",
    "quantized",
    "merge",
)
ADAPTER_RELATIONS: frozenset[str] = frozenset({"adapter", "lora", "peft"})

SINGLE_SOURCE = "--single-model"
# Relations whose source_model the worker may use as an adapter's base.
_BASE_USED = ADAPTER_RELATIONS | {""}

# Header names after normalisation (see _norm_header).
_ID_COLUMNS = ("model_id", "full_name")  # model_id wins when both are present
_RELATION_COLUMN = "base_model_relation"
_SOURCE_COLUMN = "source_model"

# A problem line at most (each value it names is cut at esd_worker.core.echo.ECHO_CHARS first).
_PROBLEM_CHARS = 1000


@dataclass(frozen=True)
class ModelRow:
    """One model to analyse.

    model_id: HF repo id (`org/name`) or a local path, absolute and normalised
    (esd_worker.core.models.naming.local_path: `./m` run in /data is `/data/m`); revision: branch,
    tag
    or commit (None when not given; always None for local paths). relation: lower-case
    base_model_relation ("" when unknown). source_model: base of an adapter (id[@rev], or a
    path spelled as model_id is; None when empty). line: 1-based line of the row in the CSV
    (0 for --single-model).
    metadata: the list's other columns, by header name; not part of equality or hashing.
    """

    model_id: str
    revision: str | None
    relation: str
    source_model: str | None
    line: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def ref(self) -> str:
        """What the worker takes as --model: `id@rev` or `id`."""
        return self.model_id if self.revision is None else f"{self.model_id}@{self.revision}"

    @cached_property
    def key(self) -> str:
        """Store key of this model's results (esd_worker.core.models.naming.model_key); computed
        once."""
        return model_key(self.model_id, self.revision)

    @property
    def is_adapter(self) -> bool:
        return self.relation in ADAPTER_RELATIONS


@dataclass(frozen=True)
class RowProblem:
    """Why one row of the list was left out."""

    source: str
    line: int
    message: str

    def __str__(self) -> str:
        # Under every message below, which names each value through esd_worker.core.echo: the
        # line printed is one line, bounded and redacted whatever a message holds.
        source = echo(self.source, limit=_PROBLEM_CHARS)
        where = source if self.line <= 0 else f"{source}:{self.line}"
        return f"{where}: {echo(self.message, limit=_PROBLEM_CHARS)}"


@dataclass(frozen=True)
class ModelList:
    """Valid rows in list order (deduplicated, limited), bad rows' problems, duplicates dropped."""

    rows: tuple[ModelRow, ...]
    problems: tuple[RowProblem, ...]
    duplicates: int


def _adapter_base_problem(model_id: str) -> str | None:
    """For a local adapter listed without source_model: why its base cannot be found."""
    directory = Path(model_id).expanduser()
    if not directory.is_dir():
        return None  # a missing model is the worker's failure to record, not a list problem
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        return (
            f"adapter {echo(model_id)} has no adapter_config.json and no source_model: "
            "its base model cannot be found"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return (f"adapter {echo(model_id)}: cannot read adapter_config.json ({echo(e)}); "
                "set source_model")
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base.strip():
        return (
            f"adapter {echo(model_id)}: adapter_config.json names no base_model_name_or_path "
            "and source_model is empty"
        )
    return None


def _source_problem(source: str) -> str | None:
    _, _, why = parse_ref(source)
    if why is not None:
        return f"source_model: {why}"
    if is_local_path(source) and not Path(source).expanduser().exists():
        return f"source model path does not exist: {echo(source)}"
    return None


def _build_row(
    ref: str, relation: str, source: str, *, line: int, metadata: Mapping[str, str]
) -> tuple[ModelRow | None, str | None]:
    """A valid row, or None and the first problem found (one per row)."""
    model_id, revision, why = parse_ref(ref)
    if why:
        return None, why
    relation = relation.strip().lower()
    if relation not in RELATIONS:
        expected = ", ".join(r for r in RELATIONS if r)
        return None, (f"unknown base_model_relation {quoted(relation)} (expected empty or "
                      f"{expected})")
    source_model = source.strip() or None
    if source_model is not None:
        # The worker uses source_model only as the base of an adapter (relation adapter/
        # lora/peft, or empty: it detects adapters by their config). For base, finetune,
        # quantized and merge rows it is information (hub metadata lists a merge's several
        # parents there), and a model that can be analysed is not dropped over it.
        if relation in _BASE_USED:
            why = _source_problem(source_model)
            if why:
                return None, why
            if is_local_path(source_model):
                # Spelled as a listed base's model_id is: base_first finds the base.
                source_model = local_path(source_model)
    elif relation in ADAPTER_RELATIONS and is_local_path(model_id):
        # Hub adapters are fine: the worker reads their adapter_config.json at run time.
        why = _adapter_base_problem(model_id)
        if why:
            return None, why
    row = ModelRow(model_id, revision, relation, source_model, line=line, metadata=metadata)
    return row, None


def _norm_header(name: str) -> str:
    return re.sub(r"[\s\-]+", "_", name.replace("\ufeff", "").strip().lower())


def _is_skipped(cells: list[str]) -> bool:
    """Blank lines and comment lines (first cell starts with '#')."""
    if not cells or all(not c.strip() for c in cells):
        return True
    return cells[0].lstrip().startswith("#")


def _finish(
    rows: list[ModelRow], problems: list[RowProblem], limit: int | None
) -> ModelList:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    seen: set[tuple[str, str | None]] = set()
    kept: list[ModelRow] = []
    duplicates = 0
    for row in rows:
        ident = (row.model_id, row.revision)
        if ident in seen:
            duplicates += 1
            continue
        seen.add(ident)
        kept.append(row)
    if limit is not None:
        kept = kept[:limit]
    return ModelList(rows=tuple(kept), problems=tuple(problems), duplicates=duplicates)


@dataclass(frozen=True)
class _Header:
    """Where the known columns are (-1: absent) and the other columns' (index, name)."""

    width: int
    id_col: int
    relation_col: int
    source_col: int
    extra: tuple[tuple[int, str], ...]


def _parse_header(cells: list[str], where: str) -> _Header:
    names = [_norm_header(c) for c in cells]
    id_col = next((names.index(c) for c in _ID_COLUMNS if c in names), -1)
    if id_col < 0:
        found = echo(", ".join(f"'{c.strip()}'" for c in cells))
        raise ModelListError(
            f"{where}: no model_id or full_name column in the header (found {found})"
        )
    relation_col = names.index(_RELATION_COLUMN) if _RELATION_COLUMN in names else -1
    source_col = names.index(_SOURCE_COLUMN) if _SOURCE_COLUMN in names else -1
    known = {id_col, relation_col, source_col}
    extra: list[tuple[int, str]] = []
    taken: set[str] = set()
    for i, (raw, norm) in enumerate(zip(cells, names, strict=True)):
        if i in known or norm in taken or not norm:
            continue  # a repeated or unnamed column: the first of a name is kept
        taken.add(norm)
        extra.append((i, raw.replace("\ufeff", "").strip()))
    return _Header(len(cells), id_col, relation_col, source_col, tuple(extra))


def _parse_row(header: _Header, cells: list[str], line: int) -> tuple[ModelRow | None, str | None]:
    if len(cells) > header.width and any(c.strip() for c in cells[header.width:]):
        return None, f"{len(cells)} cells, but the header has {header.width}"

    def cell(i: int) -> str:
        return cells[i] if 0 <= i < len(cells) else ""

    metadata = {name: cell(i).strip() for i, name in header.extra}
    return _build_row(
        cell(header.id_col), cell(header.relation_col), cell(header.source_col),
        line=line, metadata=metadata,
    )


def read_model_list(path: str | Path, *, limit: int | None = None) -> ModelList:
    """Read a model list CSV: valid rows in file order, one RowProblem per bad row.

    Header names are case- and whitespace-insensitive; the id column is `model_id` or
    `full_name` (model_id wins when both are present); `base_model_relation` and
    `source_model` are optional; other columns are kept as metadata. Blank lines, rows of
    empty cells and lines starting with '#' are skipped. Duplicates (same id and revision)
    are dropped and counted, the first kept; `limit` applies to valid rows after that.
    `path` is a local file or a store URL (s3://…, file://…).
    Raises ModelListError when the file as a whole cannot be used.
    """
    rows: list[ModelRow] = []
    problems: list[RowProblem] = []
    for item in iter_model_list(path):
        if isinstance(item, RowProblem):
            problems.append(item)
        else:
            rows.append(item)
    return _finish(rows, problems, limit)


def iter_model_list(path: str | Path, *, source: str | None = None,
                    ) -> Iterator[ModelRow | RowProblem]:
    """The list's rows and bad rows in file order, one at a time (lists of millions of rows
    are never held: a store URL is copied to a temporary file first). No duplicate removal
    and no limit (read_model_list and the controller's plan do those). Raises
    ModelListError when the file as a whole cannot be used. source: the name problems
    give (default: path)."""
    source = source or str(path)
    with open_text(path) as text:
        header: _Header | None = None
        data_rows = 0
        for line, cells in csv_records(text):
            if isinstance(cells, str):  # quotes that do not balance: the record's problem
                if header is None:
                    raise ModelListError(f"{source}:{line}: {cells}")
                data_rows += 1
                yield RowProblem(source, line, cells)
                continue
            if _is_skipped(cells):
                continue
            if header is None:
                header = _parse_header(cells, f"{source}:{line}")
                continue
            data_rows += 1
            row, why = _parse_row(header, cells, line)
            yield row if row is not None else RowProblem(source, line, why or "invalid row")
        if header is None:
            raise ModelListError(f"model list {source} is empty (no header row)")
        if not data_rows:
            raise ModelListError(f"model list {source} has a header but no models")


class ListFile:
    """A model list read more than once (the controller's plan reads it two or three
    times): a store URL is copied once to a temporary file, deleted with this object."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._copy: IO[bytes] | None = None

    def items(self) -> Iterator[ModelRow | RowProblem]:
        """iter_model_list of the list (of its local copy, for a URL)."""
        source = str(self.path)
        if "://" not in source:
            return iter_model_list(self.path)
        if self._copy is None:
            copy = tempfile.NamedTemporaryFile(prefix="esd-list-", suffix=".csv")  # noqa: SIM115
            copy.write(read_url(source))
            copy.flush()
            self._copy = copy
        return iter_model_list(self._copy.name, source=source)

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
            self._copy = None


def bad_rows_log(emit: Callable[[str], None]) -> LineCap:
    """Where a list's bad rows are shown (the sweep's log, a worker's): the first few, then
    one line that counts the rest and says where every one is (a list of garbage must not
    flood a log: esd_worker.core.echo). Call its `close` after the last row."""
    return LineCap(emit, what="bad row(s)",
                   hint=" (`esd-sweep status --bad-rows` lists every one)")


class FolderWarnings:
    """Where a list's hub ids that also name a folder here are shown (the sweep's log, a
    worker's): naming.folder_warning's line for each such row, the first few, then one line
    that counts the rest, as bad_rows_log does. Call it with every valid row (once: a
    duplicate is one name), then `close`."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._shown = LineCap(emit, what="hub id(s) that are also folders here",
                              hint=" (write ./name to analyse a folder)")
        self._here = _folders_here()

    def __call__(self, row: ModelRow) -> None:
        # A local row is a folder by the rule: no warning, and no stat of the disk. A hub
        # id can name a folder here only if its first part does: one listing of the working
        # directory spares a 2M-row list its 2M stats (~5 us each).
        if is_local_path(row.model_id):
            return
        if self._here is not None and row.ref.split("/", 1)[0] not in self._here:
            return
        warning = folder_warning(row.ref)
        if warning is not None:
            self._shown(warning)

    def close(self) -> None:
        self._shown.close()


def _folders_here() -> frozenset[str] | None:
    """The names in the working directory that are folders (or links to one), as
    os.path.isdir sees them; None when it cannot be listed (then every name is looked at)."""
    try:
        with os.scandir(".") as entries:
            return frozenset(e.name for e in entries if e.is_dir())
    except OSError:
        return None


def make_single(ref: str, *, relation: str = "", source_model: str | None = None) -> ModelList:
    """The list for --single-model: one row, or no row and the problem with it."""
    row, why = _build_row(ref, relation, source_model or "", line=0, metadata={})
    if row is None:
        problem = RowProblem(SINGLE_SOURCE, 0, why or "invalid model")
        return ModelList(rows=(), problems=(problem,), duplicates=0)
    return ModelList(rows=(row,), problems=(), duplicates=0)


def base_first(rows: Sequence[ModelRow]) -> list[ModelRow]:
    """Rows in list order, except that each adapter follows right after its base when the
    base is listed (named by source_model); other adapters keep their place."""
    by_ref: dict[str, ModelRow] = {}
    for row in rows:
        by_ref.setdefault(row.ref, row)
        by_ref.setdefault(row.model_id, row)
    followers: dict[str, list[ModelRow]] = {}
    for row in rows:
        base = by_ref.get(row.source_model or "") if row.is_adapter else None
        if base is not None and base is not row:
            followers.setdefault(base.key, []).append(row)
    moved = {row.key for group in followers.values() for row in group}
    ordered: list[ModelRow] = []
    for row in rows:
        if row.key in moved:
            continue
        ordered.append(row)
        ordered.extend(followers.get(row.key, ()))
    return ordered
