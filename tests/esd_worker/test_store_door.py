"""The one door every reader of a store comes through (Store.get_bytes / get_parts): regular
files only, a size bound per kind, a one-line refusal (StoreRefusal) and readers that leave
the refused key out and go on. A FIFO at a record's or summary.csv's name made
`Sweep.summary()`, `Sweep.failures()` and `esd-sweep report` block forever, and a link to
/dev/zero read until memory ran out; each reader here must finish within seconds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import esd_sweep
from controller.results.report import ReportSettings, write_report
from esd_worker.core.store.layout import (
    RECORD_BYTES,
    SUMMARY_KEY,
    failure_key,
    get_checked,
    marker_key,
    read_marker,
)
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.records import FailureRecord, read_failure, write_failure
from esd_worker.core.store.stores import LocalStore, Store, StoreRefusal
from esd_worker.core.store.tables import DoneModel, write_parts
from tests.support.results import analysed
from tests.support.s3server import STORE_KINDS, S3Server, serve_s3, store_url

DEADLINE_S = 30.0  # a reader that blocks on a FIFO never returns: far above any real read


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return open_store(store_url(request, tmp_path))


def within_deadline(call: Callable[[], Any]) -> Any:
    """call()'s value, or its exception; fails the test when it has not returned in time
    (the thread is a daemon: a reader stuck on a FIFO does not keep pytest alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still reading after {DEADLINE_S} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def record(key: str) -> FailureRecord:
    return FailureRecord(model=f"org/{key}", model_key=key, error="TransientError",
                         exit_code=4, signal=None, retryable=True, attempts=1,
                         stderr_tail=("boom",), run_id="r", time="t")


# --- the door itself -------------------------------------------------------------------------


def test_a_value_over_its_bound_is_refused_before_it_is_read(store: Store) -> None:
    """get_bytes and get_parts refuse a value larger than `limit` with one line naming the
    key and the bound; at the bound it is read whole."""
    store.put_bytes("_failures/big.json", b"x" * 1000)
    assert store.get_bytes("_failures/big.json", limit=1000) == b"x" * 1000
    for read in (lambda: store.get_bytes("_failures/big.json", limit=999),
                 lambda: list(store.get_parts("_failures/big.json", limit=999) or ())):
        with pytest.raises(StoreRefusal, match=r"refused to read .*big\.json: 1000 bytes, "
                                               r"more than the 999") as info:
            read()
        assert "\n" not in str(info.value)
    assert get_checked(store, "_failures/big.json", 999) is None  # one line, left out
    assert store.get_bytes("_failures/none.json") is None


def test_a_record_over_its_kind_bound_is_left_out(store: Store,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A failure record past RECORD_BYTES reads as no record (one warning), never whole."""
    store.put_bytes(failure_key("big"), b" " * (RECORD_BYTES + 1))
    write_failure(store, record("fine"))
    assert read_failure(store, "big") is None
    assert "refused to read" in caplog.text
    assert read_failure(store, "fine") is not None


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _folder(path: Path) -> None:
    path.mkdir()


NOT_FILES = [pytest.param(_fifo, "a FIFO", id="fifo"),
             pytest.param(_dev_zero, "a device", id="link-to-dev-zero"),
             pytest.param(_folder, "a folder", id="folder")]


@pytest.mark.parametrize(("plant", "kind"), NOT_FILES)
def test_what_is_not_a_regular_file_is_refused_without_reading(
        tmp_path: Path, plant: Callable[[Path], None], kind: str) -> None:
    """Opened without blocking (a FIFO has no writer), checked, refused: one line."""
    store = LocalStore(tmp_path)
    (tmp_path / "m").mkdir()
    plant(tmp_path / "m" / "result.json")
    for read in (lambda: store.get_bytes(marker_key("m")),
                 lambda: store.get_parts(marker_key("m"))):
        with pytest.raises(StoreRefusal, match=f"it is {kind}, not a regular file"):
            within_deadline(read)
    assert within_deadline(lambda: read_marker(store, "m")) is None  # unreadable: not done


def test_a_link_to_a_regular_file_is_read(tmp_path: Path) -> None:
    """A results folder assembled from links still reads: only what a link names counts."""
    store = LocalStore(tmp_path / "results")
    (tmp_path / "elsewhere.json").write_bytes(b"{}")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs.json").symlink_to(tmp_path / "elsewhere.json")
    assert store.get_bytes("runs.json") == b"{}"


# --- the readers people use ------------------------------------------------------------------


@pytest.mark.parametrize(("plant", "kind"), NOT_FILES[:2])
def test_readers_go_on_past_a_record_or_summary_that_is_not_a_file(
        tmp_path: Path, plant: Callable[[Path], None], kind: str) -> None:
    """A FIFO or a link to /dev/zero at a failure record's and at summary.csv's name:
    Sweep.failures() lists the other records, Sweep.summary() says why it cannot read the
    summary in one line, and the report is written; none of them blocks or runs out of
    memory."""
    root = tmp_path / "results"
    store = LocalStore(root)
    write_parts(store, analysed(store, [DoneModel(
        Marker(model="org/m", model_key="m", model_id="org/m", finished_at="t"),
        [{"layer": "h.0.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": 3.0,
          "status": "ok"}])]))
    write_failure(store, record("fine"))
    plant(root / failure_key("planted"))
    plant(root / SUMMARY_KEY)
    sweep = esd_sweep.load(str(root))
    failures = within_deadline(sweep.failures)
    assert list(failures["model_key"]) == ["fine"]
    with pytest.raises(StoreRefusal, match=f"summary.csv: it is {kind}"):
        within_deadline(sweep.summary)
    report = within_deadline(lambda: write_report(ReportSettings(
        results=str(root), out=str(tmp_path / "site"), max_model_plots=0)))
    assert report.models == 1
    assert "fine" in (tmp_path / "site" / "index.html").read_text()
