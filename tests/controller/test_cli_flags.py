"""Every numeric flag of `esd-sweep` (all subcommands) and `esd-worker`: a value that is not a
finite number in the flag's range is argparse's usage error (exit 2) naming the flag, never a
traceback, never accepted.

The flags are read from the two parsers themselves (argparse's actions), so a numeric flag
added later without a declared range (esd_worker.core.command.flags.Number) fails
test_every_numeric_flag_declares_a_range, and is then checked by the rest like the others.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller import cli as sweep_cli
from esd_worker import cli as worker_cli
from esd_worker.core.command.flags import Number, float_in, int_in, size_in

# Metavars that say "a number": a flag with one of these and no type reads its value as text,
# so nothing checks that it is finite or in range.
NUMERIC_METAVARS = frozenset({"N", "S", "SECONDS", "BYTES", "PORT", "MIB", "M", "R", "PER_S",
                              "GPUS", "ID", "N|auto"})
# Values no numeric flag takes: not finite, negative, or past any range a user could mean
# (the last: a whole number too long to be a float, 400 digits).
NEVER = ("nan", "inf", "-inf", "1e999", "-1", "1e300", "9" * 400)


@dataclass(frozen=True)
class Flag:
    """One flag of one command: how to reach it (`argv` before the flag) and its action."""

    command: str  # "esd-sweep run", "esd-worker", ...
    argv: tuple[str, ...]
    action: argparse.Action

    @property
    def name(self) -> str:
        return self.action.option_strings[0]

    def __str__(self) -> str:
        return f"{self.command} {self.name}"


def walk(parser: argparse.ArgumentParser, command: str,
         argv: tuple[str, ...] = ()) -> Iterator[Flag]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{command} {name}", (*argv, name))
        elif action.option_strings and action.nargs != 0:  # takes a value
            yield Flag(command, argv, action)


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "esd-sweep": sweep_cli.build_parser, "esd-worker": worker_cli.build_parser}
ALL_FLAGS = [flag for command, build in PARSERS.items() for flag in walk(build(), command)]


def is_numeric(flag: Flag) -> bool:
    """Whether the flag takes a number: a numeric type of any kind, or a numeric metavar."""
    kind = flag.action.type
    if kind is None:
        return flag.action.metavar in NUMERIC_METAVARS
    return kind not in (str, Path)


NUMERIC = [flag for flag in ALL_FLAGS if is_numeric(flag)]


def parse(flag: Flag, value: str) -> tuple[int, str]:
    """(exit status, stderr) of parsing `--flag=value` with the flag's own parser (the `=`
    form, so that argparse does not take -inf for an option)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        PARSERS[flag.command.split()[0]]().parse_args([*flag.argv, f"{flag.name}={value}"])
    return int(exc.value.code or 0), err.getvalue()


def test_every_numeric_flag_declares_a_range() -> None:
    """A bare int, float or parse_size type takes nan, inf, 1e999 or any size: each numeric
    flag's type is a Number, which says its range where the flag is declared."""
    bare = [str(flag) for flag in NUMERIC if not isinstance(flag.action.type, Number)]
    assert bare == []


def test_the_parsers_have_the_numeric_flags_this_test_expects() -> None:
    """The walk finds flags in subcommands, groups and both CLIs (a walk that found none
    would pass every other test here)."""
    names = {str(flag) for flag in NUMERIC}
    assert {"esd-sweep run --retry-backoff", "esd-sweep run --cache-budget",
            "esd-sweep run --ttl-after-finished", "esd-sweep run --wait-lock",
            "esd-sweep report --threads", "esd-sweep refit --min-evals",
            "esd-sweep doctor --worker-timeout", "esd-sweep gpu-exporter --port",
            "esd-worker --cache-budget", "esd-worker --hub-rate",
            "esd-worker --shard-index"} <= names
    assert len(NUMERIC) >= 50


@pytest.mark.parametrize("value", NEVER, ids=["nan", "inf", "-inf", "1e999", "-1", "1e300",
                                              "400-digits"])
@pytest.mark.parametrize("flag", NUMERIC, ids=str)
def test_a_value_no_flag_takes_is_a_usage_error_naming_the_flag(flag: Flag, value: str) -> None:
    """Exit 2 with argparse's one error line naming the flag; not accepted (exit 0 is not
    possible here: parse_args returns instead of exiting), not a traceback (which would
    escape pytest.raises(SystemExit) as OverflowError or ValueError)."""
    code, err = parse(flag, value)
    assert code == 2
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert f"argument {flag.name}" in line


def outside(kind: Number) -> list[str]:
    """Values just outside `kind`'s range: below lo (lo itself when above), above hi."""
    step = 1 if kind.kind != "float" else max(abs(kind.hi), 1.0) * 1e-6
    below = kind.lo if kind.above else kind.lo - step
    return [repr(int(below)) if kind.kind != "float" else repr(below),
            repr(int(kind.hi + step)) if kind.kind != "float" else repr(kind.hi + step)]


RANGED = [flag for flag in NUMERIC if isinstance(flag.action.type, Number)]


@pytest.mark.parametrize("flag", RANGED, ids=str)
def test_each_flag_takes_its_range_and_nothing_past_it(flag: Flag) -> None:
    """The ends of the declared range parse (through the flag's own parser); one step past
    either end is exit 2 naming the flag."""
    kind = flag.action.type
    assert isinstance(kind, Number)
    inside = [kind.hi] if kind.above else [kind.lo, kind.hi]
    for value in inside:
        text = repr(int(value)) if kind.kind != "float" else repr(float(value))
        assert kind(text) == value
    for text in outside(kind):
        code, err = parse(flag, text)
        assert code == 2 and f"argument {flag.name}" in err, (text, err)


@pytest.mark.parametrize(("argv", "flag"), [
    pytest.param(["run", "--cache-budget", "1e999"], "--cache-budget", id="sweep-cache-budget"),
    pytest.param(["run", "--retry-backoff", "nan"], "--retry-backoff", id="backoff-nan"),
    pytest.param(["run", "--retry-backoff", "1e999"], "--retry-backoff", id="backoff-1e999"),
    pytest.param(["run", "--retry-backoff", "1e9"], "--retry-backoff", id="backoff-30-years"),
    pytest.param(["doctor", "--worker-timeout", "1e300"], "--worker-timeout", id="timeout"),
])
def test_the_issues_values_through_esd_sweep_main(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """The values of issue 27 through the real entry point: exit 2, one line naming the flag,
    no traceback, nothing written (before: OverflowError / ValueError tracebacks with exit
    1, or a backoff of 1e999 seconds accepted)."""
    out = tmp_path / "out"
    code = sweep_cli.main([*argv, "--output-dir", str(out)] if argv[0] == "run" else argv)
    err = capsys.readouterr().err
    assert code == 2
    (line,) = err.splitlines()
    assert f"argument {flag}" in line and line.endswith("--help)")
    assert not out.exists()


def test_run_writes_its_report_also_when_a_flag_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """--report FILE.json is written whatever went wrong (CI reads it): a value argparse
    refuses is exit 2 there too, with the same reason."""
    report_file = tmp_path / "ci" / "report.json"
    code = sweep_cli.main(["run", "--model-list", "m.csv", "--output-dir", str(tmp_path / "o"),
                           "--report", str(report_file), "--retry-backoff", "nan"])
    assert code == 2
    report = json.loads(report_file.read_text())
    assert report["exit_code"] == 2 and report["run_id"] is None
    assert report["error"].startswith("argument --retry-backoff")
    assert report["error"] in capsys.readouterr().err


def test_a_bad_cache_budget_through_esd_worker_main(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    """esd-worker's usage error is one line (its parser's) naming the flag."""
    with pytest.raises(SystemExit) as exc:
        worker_cli.main(["--models", "m.csv", "--output", str(tmp_path), "--cache-budget",
                         "1e999"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and "argument --cache-budget" in err


REFUSED = "refused"  # an ArgumentTypeError
NUMBER_CASES = {
    "int": (int_in(1, 10), "10", 10),
    "int-below": (int_in(1, 10), "0", REFUSED),
    "int-not-whole": (int_in(1, 10), "2.5", REFUSED),
    "int-exponent": (int_in(1, 10), "1e1", REFUSED),
    "int-word": (int_in(0, 8, word="auto"), " Auto ", None),
    "int-word-number": (int_in(0, 8, word="auto"), "8", 8),
    "float-above-lo": (float_in(0, 1, above=True), "0", REFUSED),
    "float-small": (float_in(0, 1, above=True), "1e-9", 1e-9),
    "float-nan": (float_in(0, 1), "nan", REFUSED),
    "size-unit": (size_in(0), "50G", 50 * 10**9),
    "size-binary": (size_in(0), "1.5GiB", int(1.5 * 2**30)),
    "size-too-big": (size_in(0), "1001T", REFUSED),
    "size-nan": (size_in(0), "NaN", REFUSED),
    "size-1e999": (size_in(0), "1e999", REFUSED),
}


@pytest.mark.parametrize(("kind", "text", "value"), NUMBER_CASES.values(),
                         ids=NUMBER_CASES.keys())
def test_number(kind: Number, text: str, value: int | float | str | None) -> None:
    """A word means None ("auto"); a whole number is written as one (no 1e1, no 2.5); sizes
    take parse_size's units, within 1000T; nan and 1e999 are no number at all."""
    if value == REFUSED:
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            kind(text)
    else:
        assert kind(text) == value
