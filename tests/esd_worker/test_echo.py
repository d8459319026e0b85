"""echo, quoted and LineCap: a value from outside is one bounded line with no secret in it, and
a list's many problems are a bounded number of lines."""

from __future__ import annotations

import pytest

from esd_worker.core.echo import ECHO_CHARS, LineCap, echo, has_control, quoted


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("org/model", "org/model", id="plain-as-is"),
        pytest.param("café/ünï", "café/ünï", id="printable-unicode-as-is"),
        pytest.param("/m\nkind: Secret", "/m\\nkind: Secret", id="newline"),
        pytest.param("/m\r\nx", "/m\\r\\nx", id="crlf"),
        pytest.param("a\x1b[2Jb", "a\\x1b[2Jb", id="esc-sequence"),
        pytest.param("a\x85b", "a\\x85b", id="c1-next-line"),
        pytest.param("a\u2028b", "a\\u2028b", id="unicode-line-separator"),
        pytest.param("a\u202eb", "a\\u202eb", id="bidi-override"),
        pytest.param("a\x00b\x7f", "a\\x00b\\x7f", id="nul-and-del"),
        pytest.param("https://bob:PASSW0RD@huggingface.co/org/m",
                     "https://[REDACTED]@huggingface.co/org/m", id="url-password"),
    ],
)
def test_echo_is_one_line_without_secrets(value: str, expected: str) -> None:
    """Control characters become the escapes Python's repr uses (\\n, \\x1b, \\u2028), so
    a value can never start a line of its own; printable text, non-ASCII included, is kept
    as the user wrote it; URL userinfo is redacted as esd_worker.core.redact does."""
    shown = echo(value)
    assert shown == expected
    assert not has_control(shown) and len(shown.splitlines()) == 1


def test_a_long_value_is_cut_and_the_rest_counted() -> None:
    """10,000 characters: the first ECHO_CHARS are kept and the other 9,800 counted, so a
    reader knows the value went on."""
    shown = echo("x" * 10_000)
    assert shown == "x" * ECHO_CHARS + "… [9,800 more characters]"


def test_a_secret_past_the_cut_is_redacted_before_the_cut() -> None:
    """The password of a URL whose '@' lies past the cut: cut first, the redaction would no
    longer see a URL with userinfo and the password's start would be printed."""
    value = "https://bob:" + "P" * (ECHO_CHARS + 50) + "@host/x"
    assert "PPPP" not in echo(value)


@pytest.mark.parametrize("tail", ["\n", "\x1b", "\u2028"], ids=["newline", "esc", "u2028"])
def test_the_cut_never_splits_an_escape(tail: str) -> None:
    """An escape straddling the cut is dropped whole: a dangling `\\x1` would read as
    garbage (or, in a line that is parsed again, as the start of an escape)."""
    shown = echo("x" * (ECHO_CHARS - 1) + tail + "y" * 50)
    assert shown.startswith("x" * (ECHO_CHARS - 1) + "…")


def test_quoted_is_echo_in_quotes() -> None:
    assert quoted("a\nb") == "'a\\nb'"


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        pytest.param(0, [], id="none"),
        pytest.param(3, ["p0", "p1", "p2"], id="fewer-than-shown"),
        pytest.param(5, ["p0", "p1", "p2", "p3", "p4"], id="exactly-shown"),
        pytest.param(10_000, ["p0", "p1", "p2", "p3", "p4",
                              "… and 9,995 more bad row(s) not shown (see status)"],
                     id="ten-thousand"),
    ],
)
def test_line_cap_shows_the_first_and_counts_the_rest(count: int, expected: list[str]) -> None:
    """shown=5: up to five lines pass as they come; past that, one line at close counts the
    others (10,000 - 5 = 9,995), whatever their number."""
    lines: list[str] = []
    cap = LineCap(lines.append, shown=5, what="bad row(s)", hint=" (see status)")
    for i in range(count):
        cap(f"p{i}")
    cap.close()
    assert lines == expected
    assert cap.count == count
