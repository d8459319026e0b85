"""Which store a URL names: a local folder, file:// or s3://bucket/prefix.

Owns open_store, the one place that picks a store for a URL, and the checks of an s3:// URL
(parse_s3_url) that come before any request. Imports the S3 store, and with it boto3, only
when an s3:// URL is opened, so a run on a local folder needs no boto3. Does not hold what a
store does (esd_worker.core.store.stores: the interface and LocalStore; .s3: S3Store).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from esd_worker.core.errors import UsageError
from esd_worker.core.store.stores import LocalStore, Store

# Lenient on purpose (older AWS buckets and S3-compatible stores allow more); the store has the
# last word. No ':' so that `s3://host:9000/...` is caught: endpoints go in AWS_ENDPOINT_URL.
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")


def parse_s3_url(url: str) -> tuple[str, str]:
    """Bucket and key prefix of `s3://bucket[/prefix]`; UsageError naming what is wrong."""
    parsed = urlparse(url)
    if "@" in parsed.netloc or ("@" in url and ":" in parsed.netloc):
        # Never echo it: the part before '@' may be a secret (one with a '/' in it, as AWS
        # secret keys have, ends the netloc early: s3://KEY:SEC/RET@bucket).
        raise UsageError("credentials in an s3:// URL are not supported: use the AWS "
                         "credential chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / IRSA)")
    bucket = parsed.netloc
    if not _BUCKET_RE.fullmatch(bucket):
        raise UsageError(
            f"invalid bucket name {bucket!r} in {url}: use s3://bucket/prefix (3-63 letters, "
            "digits, '.', '-'); an S3-compatible endpoint goes in AWS_ENDPOINT_URL"
        )
    if parsed.query or parsed.fragment or url.endswith(("?", "#")):
        raise UsageError(f"'?' and '#' are not allowed in an s3:// URL: {url}")
    parts = [p for p in parsed.path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(f"'.' and '..' are not allowed in an s3:// prefix: {url}")
    return bucket, "/".join(parts)


def open_store(url: str) -> Store:
    """A Store for `./dir`, `/abs/dir`, `file:///abs/dir` or `s3://bucket/prefix`.

    Opening checks the URL only; `Store.check()` asks the store itself.
    """
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        bucket, prefix = parse_s3_url(url)
        from esd_worker.core.store.s3 import S3Store  # boto3 only for s3:// URLs

        return S3Store(bucket, prefix)
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise UsageError(f"file URL with a host is not supported: {url}")
        return LocalStore(Path(path).expanduser().absolute())
    if len(parsed.scheme) == 1:  # a Windows drive letter, not a scheme
        return LocalStore(Path(url).absolute())
    shown = "" if "@" in parsed.netloc else f" in {url}"  # user:password@ stays unprinted
    raise UsageError(f"unsupported output URL scheme {parsed.scheme!r}{shown} "
                     "(use a directory, file:// or s3://bucket/prefix)")
