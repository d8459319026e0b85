"""What a bad row's problem shows of the row: never a password, always one bounded line.

A list comes from anyone (a shared CSV, a store URL): its cells may hold a URL with
credentials, 10 kB of garbage, or a newline followed by a forged log line. The problem
still names the row and why, and the rest of the list still loads.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from esd_worker.core.echo import ECHO_CHARS
from esd_worker.core.errors import ModelListError
from esd_worker.core.models.modellist import make_single, read_model_list
from tests.support.modellist import GOOD, HEADER, write_list

PASSWORD = "PASSW0RD-xyz"
# A problem line: source:line: a sentence of its own (≤ 200 chars) and up to two values cut
# at ECHO_CHARS each; far below the 10 kB of a garbage cell.
MAX_PROBLEM = 3 * ECHO_CHARS + 300


def _csv_row(*cells: str) -> str:
    """One CSV record, quoted as a spreadsheet writes it (a newline inside a cell included)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(cells)
    return out.getvalue()


@pytest.mark.parametrize(
    ("cells", "shown"),
    [
        pytest.param((f"https://bob:{PASSWORD}@huggingface.co/org/m", "", ""),
                     "'https://[REDACTED]@huggingface.co/org/m' is not a model id",
                     id="https-url"),
        pytest.param((f"bob:{PASSWORD}@huggingface.co/org/m", "", ""),
                     "'[REDACTED]@huggingface.co/org/m' is not a model id", id="no-scheme"),
        pytest.param((f"https://bob:PASS@{PASSWORD}@huggingface.co/org/m", "", ""),
                     "'https://[REDACTED]@huggingface.co/org/m' is not a model id",
                     id="at-in-password"),
        pytest.param((f"https://bob:{PASSWORD}/x@huggingface.co/org/m@main", "", ""),
                     "'https://[REDACTED]@main' is not a model id", id="slash-in-password"),
        pytest.param(("org/a", "adapter", f"https://bob:{PASSWORD}@huggingface.co/org/base"),
                     "source_model: 'https://[REDACTED]@huggingface.co/org/base' is not a "
                     "model id", id="source-model-url"),
    ],
)
def test_a_password_in_a_model_url_is_never_in_the_problem(
    tmp_path: Path, cells: tuple[str, str, str], shown: str
) -> None:
    """The id is split at its last '@' to find a revision; a message built from the part
    before it ('https://bob:PASS') no longer looks like a URL with a password, so the
    redaction cannot find it. A hub reference never holds ':', so a reference holding
    one is refused whole, shown with everything before its last '@' masked."""
    path = write_list(tmp_path, HEADER + GOOD + _csv_row(*cells))
    result = read_model_list(path)
    assert [row.model_id for row in result.rows] == ["org/good"]
    (problem,) = result.problems
    assert PASSWORD not in str(problem) and "PASS" not in str(problem)
    assert shown in str(problem)


@pytest.mark.parametrize(
    ("ref", "shown"),
    [
        pytest.param(f"https://bob:{PASSWORD}@huggingface.co/org/m",
                     "'https://[REDACTED]@huggingface.co/org/m' is not a model id", id="url"),
        pytest.param("./x\rkind: Secret", "'./x\\rkind: Secret'", id="carriage-return"),
    ],
)
def test_single_model_is_shown_as_a_list_row_is(ref: str, shown: str) -> None:
    """--single-model takes the same path as a list row (make_single → parse_ref); a CR,
    which a CSV file reads as a line break, can come this way."""
    (problem,) = make_single(ref).problems
    assert PASSWORD not in str(problem)
    assert shown in str(problem)
    assert len(str(problem).splitlines()) == 1


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        pytest.param(("/models/x\nkind: Secret", "", ""),
                     "control characters are not allowed in a model id: "
                     "'/models/x\\nkind: Secret'", id="newline-in-path"),
        pytest.param(("./x\x85kind: Secret", "", ""), "'./x\\x85kind: Secret'",
                     id="c1-next-line-in-path"),
        pytest.param(("/m\x1b[2J", "", ""), "'/m\\x1b[2J'", id="esc-in-path"),
        pytest.param(("/m\u2028kind: Secret", "", ""), "'/m\\u2028kind: Secret'",
                     id="line-separator-in-path"),
        pytest.param(("org/m@main\nkind: Secret", "", ""), "'org/m@main\\nkind: Secret'",
                     id="newline-in-revision"),
        pytest.param(("org/a", "adapter", "/base\nkind: Secret"),
                     "source_model: control characters are not allowed in a model id: "
                     "'/base\\nkind: Secret'", id="newline-in-source"),
        pytest.param(("org/a", "base\nkind: Secret", ""), "'base\\nkind: secret'",
                     id="newline-in-relation"),
    ],
)
def test_a_control_character_is_a_bad_row_shown_escaped(
    tmp_path: Path, cells: tuple[str, str, str], expected: str
) -> None:
    """A local path may hold a newline on Linux, but a model id that does would print raw in
    every log line, command line and failure record about it ('kind: Secret' on a line of
    its own): the row is refused, its problem one line with the newline as '\\n'."""
    path = write_list(tmp_path, HEADER + GOOD + _csv_row(*cells))
    result = read_model_list(path)
    assert [row.model_id for row in result.rows] == ["org/good"]
    (problem,) = result.problems
    assert expected in str(problem)
    assert len(str(problem).splitlines()) == 1


@pytest.mark.parametrize(
    "cells",
    [
        pytest.param(("!" * 10_000, "", ""), id="id-garbage"),
        pytest.param(("org/" + "a" * 10_000, "", ""), id="long-hub-id"),
        pytest.param(("org/a@" + "r" * 10_000, "", ""), id="long-revision"),
        pytest.param(("org/a", "x" * 10_000, ""), id="long-relation"),
        pytest.param(("org/a", "adapter", "!" * 10_000), id="long-source"),
        pytest.param(("org/a", "adapter", "./" + "n" * 10_000), id="long-local-source"),
        pytest.param(("/" + "p" * 10_000, "", ""), id="local-path-past-path-max"),
        pytest.param(("org/a", "", "", "x" * 10_000), id="extra-cells"),
    ],
)
def test_a_10kb_cell_gives_a_bounded_problem(tmp_path: Path, cells: tuple[str, ...]) -> None:
    """Each value a problem names is cut at ECHO_CHARS (with the count of the rest), so a
    list of 10 kB cells cannot make 10 kB log lines. A local path longer than PATH_MAX
    (4096) names no file on any system and is refused like any other bad id."""
    path = write_list(tmp_path, HEADER + GOOD + _csv_row(*cells))
    result = read_model_list(path)
    assert [row.model_id for row in result.rows] == ["org/good"]
    (problem,) = result.problems
    assert len(str(problem)) < MAX_PROBLEM, str(problem)[:400]


def test_a_header_of_garbage_gives_a_bounded_error(tmp_path: Path) -> None:
    """The whole list is unusable (no id column): the error names the header's cells, each
    cut, and stays one line."""
    path = write_list(tmp_path, _csv_row("x\n" * 5_000, "y" * 10_000) + "org/a,\n")
    with pytest.raises(ModelListError) as raised:
        read_model_list(path)
    message = str(raised.value)
    assert "no model_id or full_name column" in message
    assert len(message) < MAX_PROBLEM and len(message.splitlines()) == 1
