"""The S3 result store (boto3): keys under s3://bucket/prefix, errors sorted by retryability.

Endpoint and credentials come only from the standard AWS chain (environment, shared config and
credentials files, web identity / IRSA) plus AWS_ENDPOINT_URL for S3-compatible stores; nothing
here reads, logs or repeats a credential. Imported only by esd_worker.core.store.opener when
an s3:// URL is opened, so the other store modules stay free of boto3; URL parsing lives
there too.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple, NoReturn

import boto3
import botocore.session
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.utils import parse_timestamp

from esd_worker.core.errors import StoreError, StorePermanentError, WorkerError
from esd_worker.core.redact import without_userinfo
from esd_worker.core.store.s3dialect import (
    add_gcs_preconditions,
    checksum_settings,
    conditions,
    is_aws_endpoint,
    version_token,
)
from esd_worker.core.store.stores import READ_LIMIT, READ_PART, Store, StoreRefusal, normalize_key

log = logging.getLogger(__name__)

MULTIPART_THRESHOLD = 8 * 2**20  # bytes; larger values go through boto3's managed transfer
MAX_POOL_CONNECTIONS = 32  # concurrent marker reads by the controller
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# Total attempts (the first included) unless AWS_MAX_ATTEMPTS or max_attempts in the profile say
# otherwise: a worker writes once, at the end of a long analysis, so ride out a short outage.
DEFAULT_MAX_ATTEMPTS = 6
LIST_PAGE_SIZE = 1000  # the most ListObjectsV2 returns per request

CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a shared "
    "config/credentials file, or a web identity (IRSA: AWS_ROLE_ARN and "
    "AWS_WEB_IDENTITY_TOKEN_FILE)"
)
_NO_BUCKET = frozenset({"NoSuchBucket"})
_ACCESS_DENIED = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem"})
_BAD_KEY_ID = frozenset({"InvalidAccessKeyId", "InvalidClientTokenId", "InvalidToken"})
_BAD_SIGNATURE = frozenset({"SignatureDoesNotMatch", "IncompleteSignature"})
# Temporary credentials run out and the chain refreshes them; a clock skew is corrected by
# botocore on the next attempt: a retry can succeed.
_RETRYABLE_4XX = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired",
                            "RequestExpired", "RequestTimeout", "RequestTimeTooSkewed",
                            "SlowDown", "Throttling", "ThrottlingException",
                            "RequestLimitExceeded", "TooManyRequestsException"})
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
_BOTO_ERRORS = (ClientError, BotoCoreError)


def _quiet_wire_logs() -> None:
    # botocore's DEBUG lines show request headers: the Authorization header's access key id
    # and X-Amz-Security-Token (a credential). Keep them out of the logs even under -v.
    for name in ("botocore", "boto3", "s3transfer"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


def _parse_timestamp(value: str) -> datetime:
    """botocore's timestamp parsing, fast for the ISO 8601 form S3's XML uses.

    botocore's default goes through dateutil, about 0.1 ms a value: a third of the time of
    listing 10,000 markers went into the LastModified fields alone.
    """
    try:
        return datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except (TypeError, ValueError):
        return parse_timestamp(value)


def make_client() -> Any:
    """An S3 client from the standard AWS chain, with retries, timeouts and a connection pool.

    botocore itself reads AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (or `endpoint_url` in the
    profile), AWS_RETRY_MODE (standard unless set; adaptive allowed) and AWS_MAX_ATTEMPTS;
    here only what the user left unset gets a value. An endpoint that is not AWS's gets
    checksums only where required (AWS_REQUEST_CHECKSUM_CALCULATION and
    AWS_RESPONSE_CHECKSUM_VALIDATION, when set, still decide).
    """
    _quiet_wire_logs()
    try:
        core = botocore.session.Session()
        core.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=_parse_timestamp
        )
        retries: dict[str, Any] = {}
        if core.get_config_variable("max_attempts") is None:
            retries["total_max_attempts"] = DEFAULT_MAX_ATTEMPTS
        config = Config(
            retries=retries,
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            max_pool_connections=MAX_POOL_CONNECTIONS,
        )
        session = boto3.session.Session(botocore_session=core)
        client = session.client("s3", config=config)
        if is_aws_endpoint(client.meta.endpoint_url):
            return client
        # Another S3-compatible store (GCS, MinIO, R2, Ceph): no default checksums, which
        # they refuse or mishandle (esd_worker.core.store.s3dialect).
        return session.client(
            "s3", config=config.merge(Config(**checksum_settings(core.get_scoped_config()))))
    except ProfileNotFound as e:
        raise StorePermanentError(
            f"AWS profile {e.kwargs.get('profile')!r} (AWS_PROFILE) is not in the AWS config "
            "files: fix AWS_PROFILE, AWS_CONFIG_FILE or AWS_SHARED_CREDENTIALS_FILE"
        ) from e
    except (BotoCoreError, ValueError) as e:  # ValueError: e.g. a malformed AWS_ENDPOINT_URL
        raise StorePermanentError(f"cannot set up the S3 client: {type(e).__name__}: {e}") from e


class PartsReader:
    """A file-like reader of an iterable of byte strings, for boto3's upload_fileobj: read(n)
    returns exactly n bytes until the last read (s3transfer cuts a part at each read, and
    a part shorter than 5 MiB but the last is refused)."""

    def __init__(self, parts: Iterable[bytes]) -> None:
        self._parts = iter(parts)
        self._held = bytearray()
        self._ended = False

    def read(self, size: int = -1) -> bytes:
        while not self._ended and (size < 0 or len(self._held) < size):
            part = next(self._parts, None)
            if part is None:
                self._ended = True
            else:
                self._held += part
        size = len(self._held) if size < 0 else size
        out = bytes(self._held[:size])
        del self._held[:size]
        return out


class S3Store(Store):
    """Objects under s3://bucket/prefix; each key is `<prefix>/<key>` in the bucket.

    The client is thread-safe: one store may serve many concurrent reads (the connection pool
    holds MAX_POOL_CONNECTIONS). Errors come out as StorePermanentError (exit 3: wrong bucket,
    access denied, bad or missing credentials) or StoreError (exit 4: throttling, 5xx,
    connection trouble, after botocore's own retries).
    """

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None,
                 list_page_size: int = LIST_PAGE_SIZE) -> None:
        self.bucket = bucket
        self.list_page_size = list_page_size
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = client if client is not None else make_client()
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_THRESHOLD,
            max_concurrency=4,
        )
        self._bucket_seen = False  # set once the bucket is known to exist
        # Beside S3's conditions, GCS's own precondition header to any endpoint not AWS's.
        self._gcs_headers = not is_aws_endpoint(self._client.meta.endpoint_url)
        if self._gcs_headers:
            add_gcs_preconditions(self._client)

    @property
    def endpoint(self) -> str:
        return without_userinfo(str(self._client.meta.endpoint_url))

    def _object_key(self, key: str) -> str:
        key = normalize_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, e: Exception, what: str, *, bucket_level: bool = False) -> NoReturn:
        """Raise the store error that `e` (from boto3) means, naming what was being done."""
        raise classify_error(e, bucket=self.bucket, url=self.url, endpoint=self.endpoint,
                             what=what, bucket_level=bucket_level) from e

    def check(self) -> None:
        """Fail fast (before a long analysis) when the bucket is missing or not ours.

        A one-key listing rather than HeadBucket: both need s3:ListBucket, but a HEAD reply
        has no body, so a bad key id, a bad secret and a denying policy would all read "403".
        """
        try:
            self._client.list_objects_v2(Bucket=self.bucket, MaxKeys=1,
                                         Prefix=f"{self.prefix}/" if self.prefix else "")
        except _BOTO_ERRORS as e:
            self._fail(e, "check the bucket", bucket_level=True)
        self._bucket_seen = True

    def put_bytes(self, key: str, data: bytes) -> None:
        # A PUT is atomic: readers see the old object or the whole new one.
        name = self._object_key(key)
        try:
            if len(data) > MULTIPART_THRESHOLD:
                self._client.upload_fileobj(io.BytesIO(data), self.bucket, name,
                                            Config=self._transfer)
            else:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=data)
        except _BOTO_ERRORS as e:
            self._fail(e, f"write {name}")

    def put_parts(self, key: str, parts: Iterable[bytes]) -> None:
        # One managed transfer reading the parts as they come: a PUT below the threshold,
        # else a multipart upload (atomic when completed) holding at most s3transfer's
        # max_in_memory_upload_chunks (10) parts of MULTIPART_THRESHOLD bytes: 80 MiB.
        name = self._object_key(key)
        try:
            self._client.upload_fileobj(PartsReader(parts), self.bucket, name,
                                        Config=self._transfer)
        except _BOTO_ERRORS as e:
            self._fail(e, f"write {name}")

    def get_bytes(self, key: str, *, limit: int = READ_LIMIT) -> bytes | None:
        got = self._get(key, limit)
        return None if got is None else got[0]

    def _get(self, key: str, limit: int = READ_LIMIT) -> tuple[bytes, dict[str, Any]] | None:
        """The value of key and the GetObject reply, or None when the key does not exist."""
        got = self._get_object(key, limit)
        if got is None:
            return None
        name, response = got
        size = response.get("ContentLength")  # read(n) may allocate n first: what is there
        try:
            data = bytes(response["Body"].read((size if isinstance(size, int) else limit) + 1))
        except _BOTO_ERRORS as e:
            self._fail(e, f"read {name}")
        finally:
            response["Body"].close()
        if len(data) > limit:
            raise StoreRefusal(f"refused to read s3://{self.bucket}/{name}: more than the "
                               f"{limit} bytes it may hold")
        return data, response

    def get_parts(self, key: str, *, limit: int = READ_LIMIT) -> Iterator[bytes] | None:
        got = self._get_object(key, limit)
        return None if got is None else self._read_parts(got[1]["Body"], got[0])

    def move(self, key: str, new_key: str) -> None:
        # A server-side copy, then the delete: nothing passes through this machine.
        name, target = self._object_key(key), self._object_key(new_key)
        try:
            self._client.copy_object(Bucket=self.bucket, Key=target,
                                     CopySource={"Bucket": self.bucket, "Key": name})
        except ClientError as e:
            if _error_code(e) in _NOT_FOUND:
                return
            self._fail(e, f"copy {name} to {target}")
        except _BOTO_ERRORS as e:
            self._fail(e, f"copy {name} to {target}")
        self.delete(key)

    def _get_object(self, key: str,
                    limit: int = READ_LIMIT) -> tuple[str, dict[str, Any]] | None:
        """(the object's name, the GetObject reply, its body unread), or None when the key
        does not exist; the store error for any other refusal, StoreRefusal (its body
        closed unread) when the object is more than `limit` bytes."""
        name = self._object_key(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if _error_code(e) == "NoSuchKey":
                return None
            self._fail(e, f"read {name}")
        except _BOTO_ERRORS as e:
            self._fail(e, f"read {name}")
        self._bucket_seen = True
        size = response.get("ContentLength")
        if isinstance(size, int) and size > limit:
            response["Body"].close()
            raise StoreRefusal(f"refused to read s3://{self.bucket}/{name}: {size} bytes, "
                               f"more than the {limit} it may hold")
        return name, response

    def _read_parts(self, body: Any, name: str) -> Iterator[bytes]:
        try:
            yield from body.iter_chunks(READ_PART)
        except _BOTO_ERRORS as e:
            self._fail(e, f"read {name}")
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        name = self._object_key(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=name)
            return True
        except ClientError as e:
            # HEAD has no body: a missing key and a missing bucket are both a bare 404.
            if _error_code(e) in _NOT_FOUND:
                if not self._bucket_seen:
                    self.check()
                return False
            self._fail(e, f"look up {name}")
        except _BOTO_ERRORS as e:
            self._fail(e, f"look up {name}")

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Every key under prefix (a folder, as in LocalStore): ListObjectsV2 pages of
        list_page_size keys (1000, the most S3 gives), never a request per key."""
        for key, _size in self.list_sizes(prefix):
            yield key

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) under prefix: the listing's own Size field, no request per key."""
        folder = "/".join(p for p in prefix.split("/") if p)
        root = f"{self.prefix}/" if self.prefix else ""
        scan = f"{root}{folder}/" if folder else root
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=scan,
                                   PaginationConfig={"PageSize": self.list_page_size})
        try:
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"][len(root):], int(item.get("Size", 0))
        except _BOTO_ERRORS as e:
            self._fail(e, f"list {scan or '/'}")

    def delete(self, key: str) -> None:
        name = self._object_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name)
        except _BOTO_ERRORS as e:
            self._fail(e, f"delete {name}")

    # Conditional access (controller.output.lease): the store, not a read-then-write, decides who
    # wins when two writers race. AWS S3 takes If-None-Match / If-Match on PUT and If-Match
    # on DELETE (which also needs s3:GetObject), and so does moto's server, the tests' double;
    # GCS takes its own x-goog-if-generation-match (s3dialect; tests/support/gcsproxy.py is
    # its double). A store that ignores both writes unconditionally: nothing is decided.

    def get_versioned(self, key: str) -> Versioned | None:
        """The value of key with its version token and age, or None when the key does not
        exist. The token is what put_if / delete_if compare: the ETag, or on GCS the
        object's generation (s3dialect.version_token).

        Age: seconds since the object was last written, by the store's own clock (the
        reply's Date less the object's Last-Modified; this machine's clock only when the
        reply has no Date), so that machines with skewed clocks agree on it. Both are HTTP
        dates: whole seconds.
        """
        got = self._get(key)
        if got is None:
            return None
        data, response = got
        return Versioned(data, version_token(response), _age_s(response))

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """Write key only while it is absent (etag None) or still the version `etag`: the new
        version token, or None when the store refused because another writer got there first."""
        name = self._object_key(key)
        condition = conditions(etag, gcs_headers=self._gcs_headers)
        try:
            response = self._client.put_object(Bucket=self.bucket, Key=name, Body=data,
                                               **condition)
        except ClientError as e:
            if _refused(e, etag):
                return None
            self._fail(e, f"write {name}")
        except _BOTO_ERRORS as e:
            self._fail(e, f"write {name}")
        return version_token(response)

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete key only while it is the version `etag`; False when it is not (another
        writer replaced or deleted it)."""
        name = self._object_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name,
                                       **conditions(etag, gcs_headers=self._gcs_headers))
        except ClientError as e:
            if _refused(e, etag):
                return False
            self._fail(e, f"delete {name}")
        except _BOTO_ERRORS as e:
            self._fail(e, f"delete {name}")
        return True


class Versioned(NamedTuple):
    """A value read with its version (S3Store.get_versioned)."""

    data: bytes
    etag: str
    age_s: float


# 412: the condition failed; 409: a concurrent conditional write to the same key was in
# flight (S3 asks to retry, which for us means: read again, someone else is writing).
_CONDITION_FAILED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})


def _refused(e: ClientError, etag: str | None) -> bool:
    """Whether a conditional write was refused; If-Match on a missing key is a 404."""
    code = _error_code(e)
    return code in _CONDITION_FAILED or (etag is not None and code in _NOT_FOUND)


def _age_s(response: dict[str, Any]) -> float:
    written = response["LastModified"]
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        now = parsedate_to_datetime(date) if date else datetime.now(UTC)
    except (TypeError, ValueError):
        now = datetime.now(UTC)
    return max(0.0, (now - written).total_seconds())


def _error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def classify_error(e: Exception, *, bucket: str, url: str, endpoint: str, what: str,
                   bucket_level: bool = False) -> WorkerError:
    """One line saying what went wrong and what to do; never the server's text or a secret.

    Permanent (exit 3): no such bucket, access denied, unknown key id, bad signature, no
    credentials, other 4xx. Transient (exit 4): throttling, 5xx, expired temporary credentials,
    connection errors and timeouts, all after botocore's retries.
    """
    if isinstance(e, ClientError):
        code, status = _error_code(e), _status(e)
        label = f"{code}, HTTP {status}" if code and code != str(status) else f"HTTP {status}"
        if code in _NO_BUCKET or (status == 404 and bucket_level):
            return StorePermanentError(
                f"s3://{bucket}: bucket does not exist or is not yours ({label}) at {endpoint}"
            )
        if code in _BAD_KEY_ID:
            return StorePermanentError(
                f"{url}: the access key id is not known to the store ({label}): check "
                "AWS_ACCESS_KEY_ID / AWS_PROFILE / IRSA and AWS_ENDPOINT_URL"
            )
        if code in _BAD_SIGNATURE:
            return StorePermanentError(
                f"{url}: request signature rejected ({label}): check AWS_SECRET_ACCESS_KEY "
                "(it does not match the access key id) / AWS_PROFILE / IRSA"
            )
        if code in _ACCESS_DENIED or status in (401, 403):
            return StorePermanentError(
                f"{url}: access denied ({label}) trying to {what}: check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_PROFILE / IRSA) and the bucket policy"
            )
        if code in _RETRYABLE_4XX or status == 429 or status >= 500:
            return StoreError(
                f"{url}: the store is busy or failing ({label}) trying to {what}, after "
                "retries; retry later"
            )
        return StorePermanentError(f"{url}: the store refused to {what} ({label})")
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StorePermanentError(f"{url}: no usable AWS credentials found: {CREDENTIALS_HINT}")
    if isinstance(e, CredentialRetrievalError):
        # The provider's own text can echo a credential process's output: leave it out.
        return StoreError(f"{url}: fetching AWS credentials failed ({type(e).__name__}); "
                          "retry later, or check the web identity / profile setup")
    if isinstance(e, ConnectionError | HTTPClientError):
        return StoreError(f"{url}: cannot reach the store at {endpoint} ({type(e).__name__}) "
                          f"trying to {what}, after retries; retry later")
    return StorePermanentError(f"{url}: cannot {what}: {type(e).__name__}: {e}")
