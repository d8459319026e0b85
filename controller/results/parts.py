"""One results-table part read: checked against its table's schema and decoded whole, so
that a part is read entirely or not at all (BadPart says why not).

Owns what makes a part unreadable (bytes that are not Parquet, a missing column, a column of
another type: esd_worker.core.store.tables owns the schema and the columns a part may lack)
and the id a part's two tables share. Not which rows of a part count
(controller.results.counting) nor which parts are read (controller.results.tables).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from esd_worker.core.echo import quoted
from esd_worker.core.store.tables import OPTIONAL_COLUMNS, SCHEMAS, PartKey

COMPACT_HINT = ("its models are read from their own files; `esd-sweep compact` sets it "
                "aside and rebuilds them")
# What pyarrow raises for bytes that are not a Parquet file of the columns asked for.
_PART_ERRORS = (pa.ArrowException, OSError, ValueError, KeyError, TypeError, IndexError)


def pair_of(part: PartKey) -> str:
    """The id a part's two tables share: `<arch>/<part_id>`."""
    return f"{part.arch}/{part.part_id}"


def schema_problem(file: pq.ParquetFile, table: str) -> str | None:
    """What keeps a part's columns from being `table`'s (None: they are): a column missing
    (but OPTIONAL_COLUMNS, which older parts lack) or of another type."""
    found = file.schema_arrow
    for want in SCHEMAS[table]:
        index = found.get_field_index(want.name)
        if index < 0:
            if want.name in OPTIONAL_COLUMNS:
                continue
            return f"it has no column {want.name!r}"
        got = found.field(index).type
        if got != want.type:
            return f"its column {want.name!r} is {got}, not {want.type}"
    return None


def read_part(data: bytes, table: str, columns: Sequence[str] | None = None) -> pa.Table:
    """The part's `columns` (default: all of the schema it has), checked against `table`'s
    schema and decoded whole, so that a part is read entirely or not at all. BadPart with
    what is wrong."""
    try:
        file = pq.ParquetFile(io.BytesIO(data))
        problem = schema_problem(file, table)
        if problem is None:
            names = file.schema_arrow.names
            wanted = [c for c in (columns if columns is not None else SCHEMAS[table].names)
                      if c in names]
            return file.read(columns=wanted, use_threads=False)
    except _PART_ERRORS as e:
        raise BadPart(f"it is not a readable Parquet file ({type(e).__name__}: "
                      f"{quoted(str(e), limit=120)})") from e
    raise BadPart(problem)


class BadPart(Exception):
    """A part that is left out: why, in words that follow its key."""


def with_nulls(table: pa.Table, wanted: Sequence[str], schema: pa.Schema) -> pa.Table:
    """`table` with the columns of `wanted` it lacks (the OPTIONAL_COLUMNS an older part
    has not) added as nulls of the schema's type."""
    for name in wanted:
        if name not in table.column_names:
            table = table.append_column(schema.field(name),
                                        pa.nulls(table.num_rows, schema.field(name).type))
    return table
