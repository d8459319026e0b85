"""`esd-sweep status` lists the listed models that failed: after the counts, one line each
(model, cause, attempts, retryable, last error), permanent first, the first N then a count;
with --json the same as a `failures` list beside the counts it printed before.

Real stores (a folder, and S3 through moto's server), records written by the real writer
(esd_worker.core.store.records), markers by the real one (layout.write_model_result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.cli import main
from controller.results.failurelist import FailureList
from controller.run.plan import ListPlan
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import FAILURES_PREFIX, write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.records import FETCH_BATCH, FailureRecord, write_failure
from esd_worker.core.store.stores import READ_LIMIT, LocalStore, Store
from tests.support import REPO_ROOT
from tests.support.s3server import STORE_KINDS, S3Server, serve_s3, store_url

pytestmark = pytest.mark.usefixtures("restore_logging")

PARAMS = AnalysisSettings().as_dict()
# Keys `status` printed before it listed failures: scripts read them, they stay as they were.
COUNT_KEYS = ["models", "bad_rows", "done", "todo", "stale", "damaged", "failed_permanent"]
FAILURE_KEYS = {"model_id", "model_key", "cause", "exit_code", "attempts", "retryable",
                "last_error"}
SHAPED = "hf_" + "Zq9" * 12  # the shape of an HF token
ENV_TOKEN = "envTokenValue-0123456789"  # no token shape: only HF_TOKEN says it is a secret


def record(model: str, *, retryable: bool = False, attempts: int = 1, error: str = "",
           exit_code: int | None = None, signal: int | None = None,
           tail: tuple[str, ...] = ()) -> FailureRecord:
    code = exit_code if exit_code is not None or signal else (4 if retryable else 3)
    return FailureRecord(
        model=model, model_key=model_key(model, None),
        error=error or ("TransientError: connection reset" if retryable
                        else "PermanentModelError: repository not found"),
        exit_code=code, signal=signal, retryable=retryable, attempts=attempts,
        stderr_tail=tail, run_id="r1", time="2026-11-23T07:05:01+00:00")


def done(store: Store, model: str) -> None:
    """A result as the worker writes it: layers.csv, then the marker sealing it."""
    marker = Marker(model=model, model_key=model_key(model, None), model_id=model,
                    parameters=dict(PARAMS))
    write_model_result(store, marker, layers=b"layer,alpha\nl0,3.0\n")


@dataclass(frozen=True)
class Case:
    """Models listed; records written (and which models are done); what status shows."""

    listed: tuple[str, ...]
    records: tuple[FailureRecord, ...]
    done: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()  # the failure lines on stderr, in order (exactly)
    counts: tuple[tuple[str, int], ...] = ()


MANY = tuple(f"org/m{i:02d}" for i in range(25))
HEADING_1P = "1 listed model(s) with a failure record (1 permanent, 0 retryable):"

CASES = [
    pytest.param(Case(
        listed=("org/ok", "org/gone"), records=(record("org/gone"),), done=("org/ok",),
        lines=(HEADING_1P,
               "  org/gone: PermanentModelError (exit 3: retrying cannot help); 1 attempt(s); "
               "permanent: run --skip-failed skips it | repository not found"),
        counts=(("done", 1), ("todo", 0), ("failed_permanent", 1))), id="permanent"),
    pytest.param(Case(
        listed=("org/flaky",),
        records=(record("org/flaky", retryable=True, attempts=3, tail=(
            "INFO downloading", "esd-worker: error: read timed out after 3 tries", "")),),
        lines=("1 listed model(s) with a failure record (0 permanent, 1 retryable):",
               "  org/flaky: TransientError (exit 4: network, storage or preemption trouble); "
               "3 attempt(s); retryable: the next run tries it again | read timed out after "
               "3 tries"),
        counts=(("todo", 1), ("failed_permanent", 0))), id="retryable-3-attempts"),
    pytest.param(Case(
        listed=("org/later",), records=(record("org/later"),), done=("org/later",),
        counts=(("done", 1), ("failed_permanent", 0))), id="failed-then-done"),
    pytest.param(Case(
        listed=("org/b", "org/a", "org/c"),
        records=(record("org/b", retryable=True), record("org/c"),
                 record("org/a", retryable=True),
                 record("org/killed", signal=9, retryable=True)),  # not listed: not shown
        argv=("--failures", "all"),
        lines=("3 listed model(s) with a failure record (1 permanent, 2 retryable):",
               "  org/c: PermanentModelError (exit 3: retrying cannot help); 1 attempt(s); "
               "permanent: run --skip-failed skips it | repository not found",
               "  org/a: TransientError (exit 4: network, storage or preemption trouble); "
               "1 attempt(s); retryable: the next run tries it again | connection reset",
               "  org/b: TransientError (exit 4: network, storage or preemption trouble); "
               "1 attempt(s); retryable: the next run tries it again | connection reset"),
        counts=(("models", 3), ("todo", 2), ("failed_permanent", 1))),
        id="permanent-first-then-by-id-listed-only"),
    pytest.param(Case(
        listed=MANY, records=tuple(record(m, retryable=i % 2 == 0) for i, m in enumerate(MANY))),
        id="more-than-n"),
    pytest.param(Case(
        listed=MANY, records=tuple(record(m) for m in MANY), argv=("--failures", "2"),
        lines=("25 listed model(s) with a failure record (25 permanent, 0 retryable):",
               "  org/m00: PermanentModelError (exit 3: retrying cannot help); 1 attempt(s); "
               "permanent: run --skip-failed skips it | repository not found",
               "  org/m01: PermanentModelError (exit 3: retrying cannot help); 1 attempt(s); "
               "permanent: run --skip-failed skips it | repository not found",
               "  … and 23 more (--failures all)")), id="failures-2"),
    pytest.param(Case(listed=MANY, records=tuple(record(m) for m in MANY),
                      argv=("--failures", "0"), counts=(("failed_permanent", 25),)),
                 id="failures-0"),
    pytest.param(Case(
        listed=("org/crash",),
        records=(record("org/crash", error="not a class: weird", signal=9, retryable=True),),
        lines=("1 listed model(s) with a failure record (0 permanent, 1 retryable):",
               "  org/crash: KilledBySignal (killed by SIGKILL); 1 attempt(s); retryable: the "
               "next run tries it again | weird"),), id="cause-from-the-signal"),
]


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=STORE_KINDS)
def output(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request, tmp_path)


def status(tmp_path: Path, output: str, listed: tuple[str, ...], *argv: str,
           capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, object], list[str]]:
    models = tmp_path / "models.csv"
    models.write_text("model_id\n" + "".join(f"{m}\n" for m in listed))
    code = main(["status", "--model-list", str(models), "--output-dir", output, *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [line for line in captured.err.splitlines()
             if line.startswith(("  ", "… ")) or "with a failure record" in line]
    return json.loads(captured.out), lines


@pytest.mark.parametrize("case", CASES)
def test_status_lists_the_listed_failures(case: Case, output: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(output)
    for each in case.records:
        write_failure(store, each)
    for model in case.done:
        done(store, model)
    counts, lines = status(tmp_path, output, case.listed, *case.argv, capsys=capsys)
    assert list(counts) == COUNT_KEYS  # without --json: exactly what it printed before
    for key, value in case.counts:
        assert counts[key] == value, key
    if case.listed == MANY and not case.argv:  # the default: 20 lines, then a count
        assert len(lines) == 1 + 20 + 1
        assert lines[1].startswith("  org/m01: PermanentModelError")  # odd ones permanent
        assert lines[13].startswith("  org/m00: TransientError")
        assert lines[-1] == "  … and 5 more (--failures all)"
    else:
        assert lines == list(case.lines)


@pytest.mark.parametrize(("argv", "shown"), [((), 20), (("--failures", "3"), 3),
                                             (("--failures", "all"), 25)],
                         ids=["default", "three", "all"])
def test_status_json_has_the_counts_and_the_failures(
        argv: tuple[str, ...], shown: int, output: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--json: the counts' keys as before, then `failures` (the first N, in the order of
    the lines) and `failures_total`; nothing on stderr but logs."""
    store = open_store(output)
    for i, model in enumerate(MANY):
        write_failure(store, record(model, retryable=i < 5, attempts=i + 1))
    doc, lines = status(tmp_path, output, MANY, "--json", *argv, capsys=capsys)
    assert list(doc) == [*COUNT_KEYS, "failures", "failures_total"]
    assert lines == []
    assert doc["failures_total"] == 25 and doc["failed_permanent"] == 20
    failures = doc["failures"]
    assert isinstance(failures, list) and len(failures) == shown
    assert all(set(item) == FAILURE_KEYS for item in failures)
    assert failures[0] == {
        "model_id": "org/m05", "model_key": model_key("org/m05", None),
        "cause": "PermanentModelError (exit 3: retrying cannot help)", "exit_code": 3,
        "attempts": 6, "retryable": False, "last_error": "repository not found"}
    ordered = [(item["retryable"], item["model_id"]) for item in failures]
    assert ordered == sorted(ordered)


def test_a_records_secrets_and_control_characters_never_reach_the_terminal(
        tmp_path: Path) -> None:
    """A record holds what a worker wrote: a token-shaped string (the writer redacts it), the
    value of HF_TOKEN (a secret only where HF_TOKEN is set: here, in `status`), an escape
    sequence that would repaint the terminal and a newline that would forge a line. Lines
    and JSON show them redacted and escaped, on one line each."""
    out = tmp_path / "out"
    hostile = f"org/x\x1b[2J\u202e\nforged: {ENV_TOKEN}"
    write_failure(LocalStore(out), FailureRecord(
        model="org/x\x1b[1m", model_key=model_key("org/x", None),
        error=f"PermanentModelError: token {SHAPED} and {ENV_TOKEN}\x1b[31m red\u202e",
        exit_code=3, signal=None, retryable=False, attempts=1,
        stderr_tail=(f"esd-worker: error: {hostile}",), run_id="r", time="t"))
    models = tmp_path / "models.csv"
    models.write_text("model_id\norg/x\n")
    env = os.environ | {"HF_TOKEN": ENV_TOKEN, "PYTHONPATH": str(REPO_ROOT),
                        "HF_HUB_OFFLINE": "1"}
    ran = [subprocess.run([sys.executable, "-m", "controller.cli", "status", "--model-list",
                           str(models), "--output-dir", str(out), *extra],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
           for extra in ((), ("--json",))]
    for done_ in ran:
        assert done_.returncode == 0, done_.stderr
        for text in (done_.stdout, done_.stderr):
            assert SHAPED not in text and ENV_TOKEN not in text
            assert "\x1b" not in text and "\u202e" not in text
    (line,) = [line for line in ran[0].stderr.splitlines() if line.startswith("  org/x")]
    assert line.startswith("  org/x\\x1b[1m: PermanentModelError (exit 3")
    assert line.endswith("| org/x\\x1b[2J\\u202e\\nforged: [REDACTED]")
    (item,) = json.loads(ran[1].stdout)["failures"]
    assert item["model_id"] == "org/x\\x1b[1m"
    assert item["last_error"] == "org/x\\x1b[2J\\u202e\\nforged: [REDACTED]"


class CountingStore(LocalStore):
    """A folder store that notes each record fetched and when a record reached the list."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fetched: list[str] = []

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        if key.startswith(FAILURES_PREFIX):
            self.fetched.append(key)
        return super().get_bytes(key, limit=limit)


def test_records_are_read_a_batch_at_a_time_and_only_the_listed_ones(tmp_path: Path) -> None:
    """2,500 listed failures, 100 records of models not listed, one listed model done since
    it failed: only the listed, not-done models' records are fetched, the first reaches the
    list before a second batch is fetched, and the list keeps 2·N at most."""
    store = CountingStore(tmp_path / "out")
    listed = [f"org/l{i:04d}" for i in range(2_500)]
    for model in [*listed, *(f"org/other{i}" for i in range(100))]:
        write_failure(store, record(model, retryable=model.endswith("1")))
    done(store, listed[0])
    failures = FailureList(5)
    seen_at: list[int] = []
    held: list[int] = []

    def add(key: str, each: FailureRecord) -> None:
        seen_at.append(len(store.fetched))
        failures.add(key, each)
        held.append(len(failures._kept))

    rows = [ModelRow(m, None, "", None) for m in listed]
    plan = ListPlan(lambda: rows, store, PARAMS, skip_failed=True, on_failure=add).scan()
    wanted = {f"{FAILURES_PREFIX}{model_key(m, None)}.json" for m in listed[1:]}
    assert sorted(store.fetched) == sorted(wanted)
    assert seen_at[0] <= FETCH_BATCH and max(held) < 2 * 5
    assert failures.total == len(seen_at) == 2_499
    assert plan.counts.skipped_failed == failures.permanent == 2_499 - 250
    assert [f.model_id for f in failures.shown()] == listed[2:7]

