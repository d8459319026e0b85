"""The S3 store against Google Cloud Storage's XML API dialect: real boto3 through
tests/support/gcsproxy.py (GCS's refusals and preconditions) in front of moto's server.

boto3 >= 1.36 sends integrity checksums GCS refuses, and GCS's write preconditions are its
generation numbers: the store must write, read, list, delete, upload in parts and write
conditionally there as on S3 (esd_worker.core.store.s3dialect).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from esd_worker.core.errors import StorePermanentError
from esd_worker.core.store.s3 import MULTIPART_THRESHOLD
from esd_worker.core.store.s3dialect import is_aws_endpoint
from tests.support.gcsproxy import GcsProxy, serve_gcs
from tests.support.s3server import make_store


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsProxy]:
    yield from serve_gcs()


@pytest.mark.parametrize(("endpoint", "aws"), [
    (None, True),
    ("https://s3.us-east-2.amazonaws.com", True),
    ("https://bucket.s3.dualstack.eu-west-1.amazonaws.com", True),
    ("https://s3.cn-north-1.amazonaws.com.cn", True),
    ("https://s3express-usw2-az1.us-west-2.api.aws", True),
    ("https://storage.googleapis.com", False),
    ("https://ACCOUNT.r2.cloudflarestorage.com", False),
    ("http://minio.minio.svc:9000", False),
    ("https://amazonaws.com.example.org", False),
])
def test_which_endpoints_are_aws(endpoint: str | None, aws: bool) -> None:
    assert is_aws_endpoint(endpoint) is aws


def test_objects_are_written_read_listed_and_deleted(gcs: GcsProxy) -> None:
    """put / get / exists / list / delete through GCS's dialect: nothing refused."""
    store = make_store(gcs.upstream)
    store.check()
    store.put_bytes("a/layers.csv", b"layer,alpha\n")
    store.put_bytes("a/result.json", b"{}")
    assert store.get_bytes("a/layers.csv") == b"layer,alpha\n"
    assert store.exists("a/result.json") and not store.exists("a/none.json")
    assert sorted(store.list_sizes("a")) == [("a/layers.csv", 12), ("a/result.json", 2)]
    store.delete("a/result.json")
    assert list(store.list_keys()) == ["a/layers.csv"]
    assert store.get_bytes("a/result.json") is None
    assert gcs.refused == []


def test_a_big_summary_goes_up_in_parts(gcs: GcsProxy) -> None:
    """A summary.csv of 2.5 thresholds: one multipart upload of three parts (no checksum
    header on any of them), read back whole; a bytes value over the threshold as well."""
    store = make_store(gcs.upstream)
    part = bytes(range(256)) * (2**20 // 256)
    count = (5 * MULTIPART_THRESHOLD // 2) // len(part)
    before = len(gcs.upstream.requests)
    store.put_parts("summary.csv", (part for _ in range(count)))
    queries = [r[2] for r in gcs.upstream.requests[before:]]
    assert sum("partNumber=" in q for q in queries) == 3
    parts = store.get_parts("summary.csv")
    assert parts is not None and b"".join(parts) == part * count
    big = b"x" * (MULTIPART_THRESHOLD + 1)
    store.put_bytes("big.bin", big)
    assert store.get_bytes("big.bin") == big
    assert gcs.refused == []


def test_conditional_writes_use_the_generation(gcs: GcsProxy) -> None:
    """Create only while absent, replace and delete only the version read: GCS holds each
    to its generation (it ignores S3's If-None-Match / If-Match in the double)."""
    store = make_store(gcs.upstream)
    first = store.put_if("_lease.json", b"a", etag=None)
    assert first is not None and first.startswith("generation:")
    assert store.put_if("_lease.json", b"b", etag=None) is None  # exists already
    seen = store.get_versioned("_lease.json")
    assert seen is not None and (seen.data, seen.etag) == (b"a", first)
    second = store.put_if("_lease.json", b"c", etag=first)
    assert second is not None and second != first
    assert store.put_if("_lease.json", b"d", etag=first) is None  # a stale version
    assert store.delete_if("_lease.json", first) is False
    assert store.get_bytes("_lease.json") == b"c"
    assert store.delete_if("_lease.json", second) is True
    assert store.get_versioned("_lease.json") is None
    assert store.put_if("_lease.json", b"e", etag=second) is None  # gone: nothing to match


@pytest.mark.parametrize("setting", ["AWS_REQUEST_CHECKSUM_CALCULATION",
                                     "AWS_RESPONSE_CHECKSUM_VALIDATION"])
def test_a_checksum_setting_of_the_users_own_is_kept(
    setting: str, gcs: GcsProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user who asks for boto3's default checksums gets them, and GCS's refusal as one
    line naming the write (or read): the store changes only what the user left unset."""
    store = make_store(gcs.upstream)
    store.put_bytes("kept.csv", b"1\n")
    monkeypatch.setenv(setting, "when_supported")
    store = make_store(gcs.upstream)
    refused = len(gcs.refused)
    with pytest.raises(StorePermanentError, match=r"the store refused to (write|read) "
                       r"\S+ \(InvalidArgument, HTTP 400\)$"):
        if setting == "AWS_REQUEST_CHECKSUM_CALCULATION":
            store.put_bytes("refused.csv", b"1\n")
        else:
            store.put_bytes("kept.csv", b"1\n")
            store.get_bytes("kept.csv")
    assert len(gcs.refused) > refused
    assert "x-amz-" in gcs.refused[-1]
