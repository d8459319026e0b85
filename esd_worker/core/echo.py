"""How a value from outside (a list cell, a model id or path, a header) is shown in a line:
redacted, on one line, bounded; and how many lines a list's problems get.

Owns `echo` / `quoted` (one value), `has_control` (whether a value would break a line) and
`LineCap` (the first lines of many, then one that counts the rest). What counts as a secret
is esd_worker.core.redact's; where lines go is the caller's. Pure and cheap: both packages
import it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from esd_worker.core.redact import redact

# A list cell can be 10 kB of garbage: its first 200 characters say what it is.
ECHO_CHARS = 200
# Bad rows shown of one list: enough to see the pattern; the rest are counted in one line.
SHOWN_LINES = 20

# What would break a line or forge one on a terminal or in a log viewer: C0 and C1
# controls and DEL (newline, CR, ESC sequences), the Unicode line and paragraph
# separators, bidirectional and zero-width formatting (text shown in another order than
# stored), the BOM and lone surrogates (bytes that were not UTF-8).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# An escape that a cut at `limit` split in two (`\x1`, `\u20`, a lone `\`).
_SPLIT_ESCAPE = re.compile(r"\\(?:x[0-9a-f]?|u[0-9a-f]{0,3})?$")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _SHORT.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def has_control(value: str) -> bool:
    """Whether `value` holds a character `echo` escapes (one that breaks or reorders a line)."""
    return _CONTROL.search(value) is not None


def echo(value: object, *, limit: int = ECHO_CHARS) -> str:
    """`value` as text for one line: secrets redacted (esd_worker.core.redact), control
    characters escaped as `\\n`, `\\x1b`, `\\u2028`, and cut after `limit` characters with
    the count of the rest. Redacted first: a URL cut before its `@` would no longer be
    recognised as holding a password."""
    text = _CONTROL.sub(_escape, redact(str(value)))
    if len(text) <= limit:
        return text
    cut = _SPLIT_ESCAPE.sub("", text[:limit])
    return f"{cut}… [{len(text) - len(cut):,} more characters]"


def quoted(value: object, *, limit: int = ECHO_CHARS) -> str:
    """`echo(value)` between single quotes, where a message names a value (as `!r` would,
    without its unbounded length)."""
    return f"'{echo(value, limit=limit)}'"


class LineCap:
    """Emits the first `shown` lines it is given, counts the others, and at `close` emits
    one line saying how many were not shown: a list of 10,000 garbage rows gives
    `shown` + 1 lines, not 10,000. `what` names the lines (`bad row(s)`); `hint` says
    where all of them are."""

    def __init__(self, emit: Callable[[str], None], *, shown: int = SHOWN_LINES,
                 what: str = "line(s)", hint: str = "") -> None:
        self.emit, self.shown, self.what, self.hint = emit, shown, what, hint
        self.count = 0

    @property
    def hidden(self) -> int:
        return max(self.count - self.shown, 0)

    def __call__(self, line: object) -> None:
        self.count += 1
        if self.count <= self.shown:
            self.emit(str(line))

    def close(self) -> None:
        """The one line for those not shown (nothing when all were)."""
        if self.hidden:
            self.emit(f"… and {self.hidden:,} more {self.what} not shown{self.hint}")
