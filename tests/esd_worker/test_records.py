"""Tests of esd_worker.core.store.records: failure records in a real LocalStore, exit classes,
redaction."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import FAILURES_PREFIX, failure_key
from esd_worker.core.store.records import (
    FailureRecord,
    clear_failure,
    read_failures,
    redact,
    utc_now,
    write_failure,
)
from esd_worker.core.store.stores import LocalStore

# --- builders -------------------------------------------------------------------------------


def make_record(model: str = "org/model", **kw: object) -> FailureRecord:
    fields: dict[str, object] = {
        "model": model,
        "model_key": model_key(model),
        "error": "PermanentModelError",
        "exit_code": 3,
        "signal": None,
        "retryable": False,
        "attempts": 1,
        "stderr_tail": ("loading org/model", "model not found: org/model"),
        "run_id": "20261123T070501Z-abcdef",
        "time": "2026-11-23T07:05:01Z",
    }
    fields.update(kw)
    return FailureRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "results")


# --- round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(make_record(), id="permanent"),
        pytest.param(make_record(error="KilledBySignal", exit_code=None, signal=9, retryable=True,
                                 attempts=3, stderr_tail=()), id="signal-no-stderr"),
        pytest.param(make_record("org/ünï@main", stderr_tail=("naïve → ü",)), id="unicode"),
    ],
)
def test_record_json_round_trip(record: FailureRecord) -> None:
    assert FailureRecord.from_json(record.to_json()) == record


def test_record_json_is_readable_by_people_and_scripts() -> None:
    doc = json.loads(make_record().to_json())
    assert doc["error"] == "PermanentModelError"
    assert doc["stderr_tail"] == ["loading org/model", "model not found: org/model"]
    assert doc["retryable"] is False and doc["signal"] is None


def test_stored_record_round_trip_and_listing(store: LocalStore) -> None:
    a = make_record("org/a")
    b = make_record("org/b@v1", error="TransientError", exit_code=4, retryable=True, attempts=2)
    write_failure(store, a)
    write_failure(store, b)
    assert sorted(store.list_keys(FAILURES_PREFIX)) == sorted(
        [f"_failures/{a.model_key}.json", f"_failures/{b.model_key}.json"]
    )
    assert read_failures(store) == {a.model_key: a, b.model_key: b}


def test_rewrite_replaces_record(store: LocalStore) -> None:
    write_failure(store, make_record(attempts=1))
    write_failure(store, make_record(attempts=2))
    (record,) = read_failures(store).values()
    assert record.attempts == 2


def test_clear_failure(store: LocalStore) -> None:
    record = make_record()
    write_failure(store, record)
    clear_failure(store, record.model_key)
    clear_failure(store, record.model_key)  # already gone: fine
    assert read_failures(store) == {}


def test_read_failures_on_empty_store(store: LocalStore) -> None:
    assert read_failures(store) == {}


def test_read_failures_skips_corrupt_and_foreign_files(
    store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad record is logged and ignored; stray files under _failures/ are not records."""
    good = make_record("org/good")
    write_failure(store, good)
    store.put_bytes("_failures/broken.json", b"{not json")
    store.put_bytes("_failures/partial.json", b'{"model": "x"}')
    store.put_bytes("_failures/notes.txt", b"hello")
    store.put_bytes("_failures/nested/deeper.json", make_record("org/n").to_json())
    store.put_bytes("org--x-1234/result.json", b"{}")
    with caplog.at_level(logging.WARNING, logger="esd_worker.core.store.records"):
        assert read_failures(store) == {good.model_key: good}
    assert "_failures/broken.json" in caplog.text
    assert "_failures/partial.json" in caplog.text


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"[1, 2]", "expected an object", id="not-object"),
        pytest.param(b'{"model_key": "k"}', "lacks 'model'", id="missing-model"),
        pytest.param(b'{"model": "m", "model_key": "k", "attempts": "2"}', "attempts must be int",
                     id="attempts-string"),
        pytest.param(b'{"model": "m", "model_key": "k", "retryable": 1}', "retryable must be bool",
                     id="retryable-int"),
        pytest.param(b'{"model": "m", "model_key": "k", "exit_code": true}',
                     "exit_code must be int", id="exit-code-bool"),
        pytest.param(b'{"model": "m", "model_key": "k", "stderr_tail": "x"}', "must be a list",
                     id="tail-string"),
        pytest.param(b"\xff\xfe", "not a JSON failure record", id="not-utf8"),
    ],
)
def test_from_json_rejects(data: bytes, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        FailureRecord.from_json(data)




# --- exit classes ---------------------------------------------------------------------------






def test_utc_now() -> None:
    """The one time format of records (worker- or controller-written) and run reports."""
    from datetime import datetime, timedelta, timezone

    cet = timezone(timedelta(hours=1))
    assert utc_now(datetime(2026, 11, 23, 8, 5, 1, 999, tzinfo=cet)) == "2026-11-23T07:05:01+00:00"
    assert utc_now().endswith("+00:00")


# --- redaction ------------------------------------------------------------------------------

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
AKID = "AKIA" + "IOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        pytest.param(f"HF_TOKEN={HF}", HF, id="hf-env"),
        pytest.param(f"401 for token {HF}: invalid", HF, id="hf-in-message"),
        pytest.param(f"key id {AKID} denied", AKID, id="aws-akia"),
        pytest.param("ASIA" + "ABCDEFGHIJKLMNOP used", "ASIAABCDEFGHIJKLMNOP", id="aws-asia"),
        pytest.param(f"aws_secret_access_key={SECRET}", SECRET, id="aws-secret-eq"),
        pytest.param(f"AWS_SECRET_ACCESS_KEY = '{SECRET}'", SECRET, id="aws-secret-env-quoted"),
        pytest.param(f'"aws_secret_access_key": "{SECRET}"', SECRET, id="aws-secret-json"),
        pytest.param("aws_session_token: FwoGZXIvYXdzEJr//////////wEaDEXAMPLE", "FwoGZXIvYXdzEJr",
                     id="aws-session-token"),
        pytest.param("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "eyJhbGci",
                     id="authorization-bearer"),
        pytest.param("{'authorization': 'Bearer abc.def-ghi'}", "abc.def-ghi", id="header-dict"),
        pytest.param("authorization: token ghp_abcdefgh12345678", "ghp_abcdefgh", id="auth-token"),
        pytest.param("Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz", id="auth-basic"),
        pytest.param("curl -H 'bearer sk-live-123456'", "sk-live-123456", id="bare-bearer"),
    ],
)
def test_redact_removes_secret(line: str, secret: str) -> None:
    out = redact(line)
    assert secret not in out
    assert "[REDACTED]" in out


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "model not found: meta-llama/Llama-2-7b-hf (private repos need HF_TOKEN)",
        "layers 12/48 analysed (model.layers.11.mlp.down_proj)",
        "shf_x and hf_short stay",  # not token-shaped
    ],
)
def test_redact_keeps_ordinary_lines(line: str) -> None:
    assert redact(line) == line


def test_stored_record_holds_no_secret(store: LocalStore) -> None:
    """Redaction happens on the way into the store, whatever the caller passed."""
    record = make_record(stderr_tail=(f"token {HF}", f"Authorization: Bearer {HF}", "plain"))
    write_failure(store, record)
    raw = store.get_bytes(failure_key(record.model_key))
    assert raw is not None and HF not in raw.decode()
    (back,) = read_failures(store).values()
    assert back.stderr_tail[-1] == "plain"
