"""`esd-worker --model/--base-model` holding a control character: a usage error whose one line
shows the value escaped, never a raw newline that forges a log line of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from esd_worker import cli
from esd_worker.core.errors import EXIT_USAGE, FAILURE_CHARS, PermanentModelError, failure_message

pytestmark = pytest.mark.usefixtures("restore_logging")

FORGED = "kind: Secret"


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        pytest.param(("--model", f"/models/x\n{FORGED}"), f"'/models/x\\n{FORGED}'",
                     id="newline-in-path"),
        pytest.param(("--model", f"org/m@main\n{FORGED}"), f"'org/m@main\\n{FORGED}'",
                     id="newline-in-revision"),
        pytest.param(("--model", "org/m\x1b[2J"), "'org/m\\x1b[2J'", id="esc-in-id"),
        pytest.param(("--model", "org/m", "--base-model", f"org/b\r{FORGED}"),
                     f"'org/b\\r{FORGED}'", id="cr-in-base"),
    ],
)
def test_a_control_character_in_a_model_flag_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: tuple[str, ...], shown: str
) -> None:
    """The worker used to take the value as it was: a hub id was looked up (its retries
    logged with the raw newline), a path was looked for. A list row with the same value is
    refused (esd_worker.core.models.modellist), so is the flag: exit 2 before any lookup, the value
    escaped as esd_worker.core.echo shows it."""
    code = cli.main(["--device", "cpu", "--output", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert not [line for line in err.splitlines() if line.startswith(FORGED)], err
    assert code == EXIT_USAGE
    assert "control characters are not allowed" in err and shown in err


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(PermanentModelError(f"model_type 'x\x1b[2J\u2028{FORGED}' unknown"),
                     f"model_type 'x\\x1b[2J {FORGED}' unknown", id="esc-and-separator"),
        pytest.param(PermanentModelError(f"bad\n{FORGED}"), f"bad {FORGED}", id="newline"),
        pytest.param(PermanentModelError("x" * 50_000),
                     "x" * FAILURE_CHARS + "… [48,000 more characters]", id="50k-characters"),
    ],
)
def test_a_failure_line_is_one_bounded_line(error: Exception, expected: str) -> None:
    """What a model's files say (a config value, an id) reaches the worker's error line, the
    controller's log and the failure record through failure_message: whitespace folds to
    one space as before (U+2028 is whitespace to str.split), other control characters
    are escaped (ESC, which would clear a terminal), and the line is cut at
    FAILURE_CHARS with the count of the rest."""
    assert failure_message(error, "org/m") == expected
