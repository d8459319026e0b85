"""Store.get_parts / put_parts on the S3 store, against moto's standalone server over HTTP
through real boto3 (as tests/esd_worker/test_s3.py): a value larger than memory should hold
is written and read in parts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from esd_worker.core.store.s3 import MULTIPART_THRESHOLD
from esd_worker.core.store.stores import READ_PART
from tests.support.s3server import S3Server, make_store, serve_s3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


def test_parts_stream_through_one_multipart_upload(s3_server: S3Server) -> None:
    """put_parts of 2.5 thresholds in 1 MiB parts: one multipart upload of parts of
    MULTIPART_THRESHOLD bytes (S3 refuses a part under 5 MiB but the last), read as they
    come; get_parts reads it back in parts of at most READ_PART bytes."""
    store = make_store(s3_server)
    part = bytes(range(256)) * (2**20 // 256)
    count = (5 * MULTIPART_THRESHOLD // 2) // len(part)
    before = len(s3_server.requests)
    store.put_parts("summary.csv", (part for _ in range(count)))
    queries = [r[2] for r in s3_server.requests[before:]]
    assert "uploads" in queries
    assert sum("partNumber=" in q for q in queries) == 3
    parts = store.get_parts("summary.csv")
    assert parts is not None
    read = list(parts)
    assert b"".join(read) == part * count
    assert max(map(len, read)) <= READ_PART
    assert store.get_parts("missing.csv") is None


def test_small_parts_are_one_put(s3_server: S3Server) -> None:
    store = make_store(s3_server)
    before = len(s3_server.requests)
    store.put_parts("summary.csv", [b"a,b\n", b"", b"1,2\n"])
    assert [r[0] for r in s3_server.requests[before:]] == ["PUT"]
    assert store.get_bytes("summary.csv") == b"a,b\n1,2\n"
