"""A local double of Google Cloud Storage's S3-compatible XML API: an HTTP proxy in front of
moto's server (tests/support/s3server.py) that speaks GCS's dialect where it differs from S3.

- It refuses what GCS refuses from boto3 >= 1.36's default integrity checksums: a body sent
  as `Content-Encoding: aws-chunked`, and any x-amz-checksum-* / x-amz-sdk-checksum-algorithm
  / x-amz-trailer header: 400 with an XML error in GCS's form. (GCS's exact code for each is
  not documented; the double refuses x-amz-checksum-mode too, the stricter reading.)
- Its preconditions on writes are GCS's: x-goog-if-generation-match (0: no live object)
  against its own generation numbers, 412 PreconditionFailed when they do not hold. S3's
  If-Match / If-None-Match on a PUT or DELETE are dropped, not honoured: GCS does not
  document them as write preconditions, so the double assumes the worst.
- Replies to PUT, GET and HEAD of an object it knows carry x-goog-generation, as GCS's do.

Owns the wire dialect only; objects live in moto. Not a model of GCS's auth (HMAC keys are
SigV4 here as there; moto checks nothing unless asked).
"""

from __future__ import annotations

import http.client
import itertools
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.s3server import S3Server

_REFUSED_PREFIXES = ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm", "x-amz-trailer")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "expect", "host",
                         "content-length", "te", "trailer", "upgrade", "proxy-connection"})
_S3_WRITE_CONDITIONS = ("if-match", "if-none-match")
_ERROR = ("<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
          "<Message>{message}</Message></Error>")


class GcsProxy:
    """GCS's dialect on 127.0.0.1 (a free port) in front of `upstream` (a started S3Server)."""

    def __init__(self, upstream: S3Server) -> None:
        self.upstream = upstream
        self.refused: list[str] = []  # one line per request refused for its checksums
        self.generations: dict[str, int] = {}  # "/bucket/key" -> its live generation
        self.write_lock = threading.Lock()  # a precondition and its write, one at a time
        self._numbers = itertools.count(time.time_ns() // 1000)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"

    def start(self) -> GcsProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> GcsProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, **overrides: str | None) -> dict[str, str]:
        """The upstream's subprocess environment pointed at this proxy, region "auto" (as
        manifests/components/gcs sets)."""
        return self.upstream.subprocess_env(AWS_ENDPOINT_URL=self.endpoint, AWS_REGION="auto",
                                            AWS_DEFAULT_REGION=None, **overrides)

    def next_generation(self) -> int:
        return next(self._numbers)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for boto3's Expect header

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request
        pass

    @property
    def proxy(self) -> GcsProxy:
        return self.server.proxy  # type: ignore[attr-defined, no-any-return]

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def _serve(self) -> None:
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        refused = _refused_header(headers)
        if refused is not None:
            self.proxy.refused.append(f"{self.command} {self.path}: {refused}")
            self._reply_error(400, "InvalidArgument", f"Unsupported header: {refused}")
            return
        path, _, query = self.path.partition("?")
        bucket_and_key = path.lstrip("/").split("/", 1)
        obj = path if len(bucket_and_key) == 2 and bucket_and_key[1] else ""
        # A whole object written or deleted (not a part, nor a multipart upload aborted).
        if self.command == "PUT":
            whole_write = "partNumber=" not in query and "uploadId=" not in query
        elif self.command == "DELETE":
            whole_write = "uploadId=" not in query
        else:
            whole_write = self.command == "POST" and "uploadId=" in query
        whole_write = whole_write and bool(obj)
        if not whole_write:
            self._forward(body, headers, obj)
            return
        for name in _S3_WRITE_CONDITIONS:
            headers.pop(name, None)
        wanted = headers.pop("x-goog-if-generation-match", None)
        with self.proxy.write_lock:
            live = self.proxy.generations.get(obj, 0)
            if wanted is not None and int(wanted) != live:
                self._reply_error(412, "PreconditionFailed",
                                  "At least one of the pre-conditions you specified did not hold.")
                return
            self._forward(body, headers, obj, write=True)

    def _forward(self, body: bytes, headers: dict[str, str], obj: str, *,
                 write: bool = False) -> None:
        upstream = urlsplit(self.proxy.upstream.endpoint)
        conn = http.client.HTTPConnection(upstream.netloc, timeout=120)
        try:
            sent = {k: v for k, v in headers.items() if k not in _HOP_BY_HOP}
            sent["content-length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=sent)
            reply = conn.getresponse()
            data = reply.read()
            status, reply_headers = reply.status, reply.getheaders()
        finally:
            conn.close()
        extra: list[tuple[str, str]] = []
        if obj and 200 <= status < 300:
            generations = self.proxy.generations
            if write and self.command == "DELETE":
                generations.pop(obj, None)
            elif write:
                generations[obj] = self.proxy.next_generation()
            if obj in generations and self.command in ("PUT", "GET", "HEAD", "POST"):
                extra.append(("x-goog-generation", str(generations[obj])))
        self.send_response_only(status)  # the upstream's own Date and Server follow
        length = str(len(data))
        for name, value in reply_headers:
            low = name.lower()
            if low == "content-length" and self.command == "HEAD":
                length = value  # a HEAD reply says the object's length, with no body
            elif low not in _HOP_BY_HOP:
                self.send_header(name, value)
        for name, value in extra:
            self.send_header(name, value)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _read_body(self) -> bytes:
        """The whole request body: Content-Length bytes, or a chunked body decoded (the
        body is read before any refusal, so that the client sees the reply, not a reset)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply_error(self, status: int, code: str, message: str) -> None:
        data = _ERROR.format(code=code, message=message).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _refused_header(headers: dict[str, str]) -> str | None:
    """The first thing GCS's XML API refuses in these headers, or None."""
    if "aws-chunked" in headers.get("content-encoding", "").lower():
        return "Content-Encoding: aws-chunked"
    for name in headers:
        if name.startswith(_REFUSED_PREFIXES):
            return name
    return None


def serve_gcs() -> Iterator[GcsProxy]:
    """The body of a fixture: a GcsProxy (on its own S3Server) with the AWS_* environment of
    this process pointed at it, region "auto"."""
    with S3Server() as server, GcsProxy(server) as proxy, pytest.MonkeyPatch.context() as mp:
        server.apply_env(mp)
        mp.delenv("AWS_DEFAULT_REGION", raising=False)
        mp.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        mp.setenv("AWS_REGION", "auto")
        yield proxy
