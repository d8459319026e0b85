"""A model list's text as CSV records: a local file or a store URL, read as UTF-8 as it goes,
and quotes that do not balance found where they start.

Owns the bytes-to-records step; what a record means (header, columns, ids) is
esd_worker.core.models.modellist's.
"""

from __future__ import annotations

import csv
import io
import tempfile
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TextIO

from esd_worker.core.errors import ModelListError

# A model list kept in a store is read whole: 2M rows are ~200 MB; more is not a list.
LIST_BYTES = 4 * 2**30


def read_url(url: str) -> bytes:
    """The bytes of a list kept in a store: the store is the URL's folder, the key its name.

    The store's own errors (no credentials, no bucket) pass through: they are not the
    list's fault, and say what to fix.
    """
    from esd_worker.core.store.opener import open_store

    folder, _, name = url.rstrip("/").rpartition("/")
    if not name or folder.endswith(":/"):
        raise ModelListError(f"model list URL {url} names no file")
    data = open_store(folder).get_bytes(name, limit=LIST_BYTES)
    if data is None:
        raise ModelListError(f"model list not found: {url}")
    return data


class _Lines:
    """The list's lines as csv.reader takes them, keeping the lines of the record being read
    (a quoted cell may span lines), and lines given back to be read again first. Holds one
    record: csv's field limit (128 KiB) ends a quoted cell that never closes."""

    __slots__ = ("_again", "_source", "record")

    def __init__(self, text: TextIO) -> None:
        self._source = iter(text)
        self._again: deque[str] = deque()
        self.record: list[str] = []

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = self._again.popleft() if self._again else next(self._source)
        self.record.append(line)
        return line

    def take(self) -> list[str]:
        """The record's lines, read so far; the next record starts with none."""
        record, self.record = self.record, []
        return record

    def again(self, lines: list[str]) -> None:
        """Read these lines next, in this order."""
        self._again.extendleft(reversed(lines))


def csv_records(text: TextIO) -> Iterator[tuple[int, list[str] | str]]:
    """(line, cells) of each CSV record in file order, `line` the one it starts on, which is
    the line people see in an editor (quoted cells may span lines).

    A record spanning lines whose quotes do not balance (a quote opens a cell and never
    closes, or closes with more text after it) is (line, why): it would swallow the rows
    after it into one cell, silently, up to the next quote or the end of the file. Its
    lines after the first are read again as records of their own, so a stray quote costs
    its row and nothing more. A record on one line is read as csv reads by default (`"a"
    b` is `a b`), as it always was.
    """
    lines = _Lines(text)
    reader = csv.reader(lines, strict=True)  # strict: an unbalanced quote is an error
    end = 0  # the line the last record ended on
    while True:
        try:
            for cells in reader:
                start = end + 1
                end += len(lines.record)
                lines.record.clear()
                yield start, cells
            return
        except csv.Error as e:
            record = lines.take()
            end += 1
            if len(record) > 1:
                lines.again(record[1:])
                yield end, (
                    f"unbalanced quote: the quoted cell opened on this line runs on to line "
                    f"{end + len(record) - 1} ({e}); this row is left out and lines {end + 1}-"
                    f"{end + len(record) - 1} are read as rows (close the quote; a quote "
                    'inside a cell is written "")'
                )
                continue
            try:
                yield end, next(csv.reader(record), [])
            except csv.Error as lenient:  # a cell over csv's field limit
                yield end, f"not valid CSV: {lenient}"


@contextmanager
def open_text(path: str | Path) -> Iterator[TextIO]:
    """The list as a text stream: a local file read as it goes, or a store URL copied to a
    temporary file (deleted afterwards)."""
    source = str(path)
    if "://" in source:
        with tempfile.TemporaryFile() as tmp:
            tmp.write(read_url(source))
            tmp.seek(0)
            with _decoded(tmp, source) as text:
                yield text
        return
    try:
        raw = open(path, "rb")  # noqa: SIM115 (closed below, after decoding errors are mapped)
    except FileNotFoundError as e:
        raise ModelListError(f"model list not found: {path}") from e
    except IsADirectoryError as e:
        raise ModelListError(f"model list is a directory, not a CSV file: {path}") from e
    except OSError as e:
        raise ModelListError(f"cannot read model list {path}: {e.strerror or e}") from e
    with raw, _decoded(raw, source) as text:
        yield text


@contextmanager
def _decoded(raw: IO[bytes], source: str) -> Iterator[TextIO]:
    text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
    try:
        yield text
    except UnicodeDecodeError as e:
        raise ModelListError(f"model list {source} is not UTF-8 text: {e}") from e
    finally:
        text.detach()
