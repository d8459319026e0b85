"""The controller's HTTP client of the HuggingFace hub: what a model's files are and weigh, its
parameter count (the model-info API with blobs), and a byte range of one of its files, all
before any download.

Owns the requests: stdlib urllib (the controller never imports huggingface_hub); the
endpoint, token and offline switch (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, read as
huggingface_hub reads them, unless given); the token, sent only in the Authorization header,
only to the hub's own origin across redirects, never logged; the rate
(esd_worker.core.ratelimit.TokenBucket, no burst); retries of 429, 5xx and an unreachable hub
(esd_worker.core.hubretry.RetryPolicy, the worker's policy: 4 requests in all, waits of 1, 2,
4 s or the hub's Retry-After, at most 60 s). Does not count or cap lookups, decide what a
failure means for a model, or take the hub as down (controller.weights.sizing's Sizer does);
logs nothing above debug.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import quote, urlsplit

from esd_worker.core.hubretry import RetryPolicy
from esd_worker.core.ratelimit import TokenBucket

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's reading of a boolean variable


@dataclass(frozen=True)
class HubInfo:
    """What one model-info answer says of a hub model: its files' bytes (name -> bytes, with
    their folders) and its parameter count when the hub gives one (the answer's
    safetensors.total, or gguf.total: the hub reads them from the files' headers; None
    without)."""

    files: Mapping[str, int]
    params: int | None = None


class LookupFailed(Exception):
    """The hub gave no answer; transient: 429/5xx or unreachable after every attempt."""

    def __init__(self, why: str, *, transient: bool) -> None:
        super().__init__(why)
        self.transient = transient


class HubClient:
    """Requests to the hub at `endpoint`: at most `rate_per_s` a second (a token bucket
    holding one token: the first goes at once; clock and sleep injectable), each retried per
    `retry` when the hub answers 429 or 5xx or cannot be reached; 401/403/404 and other
    answers are not retried. `offline`: no request may be made (the caller asks first)."""

    def __init__(
        self, *, endpoint: str | None = None, token: str | None = None,
        rate_per_s: float = 5.0, timeout_s: float = 10.0, offline: bool | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        if urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ValueError(f"the hub endpoint must be an http(s) URL, got {self.endpoint!r}")
        self._token = token if token is not None else os.environ.get("HF_TOKEN") or None
        if offline is None:
            offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE
        self.offline = offline
        self.retry = retry or RetryPolicy()
        self._timeout_s = timeout_s
        self._sleep = sleep
        # One token, no burst: a plan's lookups go evenly at the rate, from the first one.
        self._bucket = TokenBucket(rate_per_s, burst=1.0, clock=clock, sleep=sleep)
        self._opener = urllib.request.build_opener(_SameOriginAuth)

    def model_info(self, model_id: str, revision: str | None) -> HubInfo:
        """GET {endpoint}/api/models/{id}/revision/{rev or main}?blobs=true: the files'
        sizes and the parameter count. LookupFailed when the hub gives none."""
        url = (f"{self.endpoint}/api/models/{quote(model_id, safe='/')}/revision/"
               f"{quote(revision or 'main', safe='')}?blobs=true")
        body = self._get(url, accept="application/json")
        try:
            info = json.loads(body)
        except ValueError:
            raise LookupFailed("the answer is not JSON", transient=False) from None
        return HubInfo(_sibling_sizes(info), _safetensors_total(info))

    def read_range(self, model_id: str, revision: str | None, filename: str, start: int,
                   end: int) -> bytes:
        """Bytes start..end (inclusive) of a file, through {endpoint}/{id}/resolve/{rev}/{file}
        with a Range header (the hub redirects LFS files to its CDN; the token is not sent
        there). At most end - start + 1 bytes are read, should the server ignore the Range;
        past byte 0 only a 206 answer will do. LookupFailed otherwise."""
        url = (f"{self.endpoint}/{quote(model_id, safe='/')}/resolve/"
               f"{quote(revision or 'main', safe='')}/{quote(filename, safe='/')}")
        return self._get(url, accept="*/*", extra={"Range": f"bytes={start}-{end}"},
                         limit=end - start + 1, partial=start > 0)

    def _get(self, url: str, *, accept: str, extra: Mapping[str, str] | None = None,
             limit: int | None = None, partial: bool = False) -> bytes:
        """The body `url` answers (at most `limit` bytes; None: all), asked at most
        retry.attempts times; LookupFailed otherwise. partial: only a 206 answer will do (a
        server that ignores the Range sends the file from its start)."""
        request = urllib.request.Request(url, headers={"Accept": accept,
                                                       "User-Agent": "esd-sweep", **(extra or {})})
        if self._token:
            # Unredirected: _SameOriginAuth decides whether a redirect gets it.
            request.add_unredirected_header("Authorization", f"Bearer {self._token}")
        attempts = self.retry.attempts
        for attempt in range(1, attempts + 1):
            self._bucket.acquire()
            retry_after: str | None = None
            try:
                with self._opener.open(request, timeout=self._timeout_s) as response:
                    if partial and response.status != 206:
                        raise LookupFailed(f"HTTP {response.status}, not the range asked for",
                                           transient=False)
                    return bytes(response.read(limit))
            except urllib.error.HTTPError as e:
                retry_after = e.headers.get("Retry-After")
                e.close()
                if e.code != 429 and e.code < 500:
                    raise LookupFailed(f"HTTP {e.code}", transient=False) from None
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                why = str(getattr(e, "reason", e)) or type(e).__name__
            if attempt == attempts:
                raise LookupFailed(f"{why}, {attempt} attempts", transient=True)
            wait = self.retry.wait_s(attempt, retry_after)
            log.debug("GET %s: %s; attempt %d of %d, retrying in %.1fs", url, why, attempt,
                      attempts, wait)
            self._sleep(wait)
        raise AssertionError("unreachable: retry.attempts < 1")


class _SameOriginAuth(urllib.request.HTTPRedirectHandler):
    """Follows the hub's redirects (a renamed repo answers 307), sending the token on only to
    the same scheme, host and port: urllib's own handler would copy it to any host."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: http.client.HTTPMessage,
                         newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        token = req.unredirected_hdrs.get("Authorization")
        if new is not None and token is not None and _origin(newurl) == _origin(req.full_url):
            new.add_unredirected_header("Authorization", token)
        return new


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _safetensors_total(info: Any) -> int | None:
    """The parameter count of a model-info answer ("safetensors": {"total": N}; for a GGUF
    repo, which has none, "gguf": {"total": N}), if any."""
    for field in ("safetensors", "gguf"):
        block = info.get(field) if isinstance(info, dict) else None
        total = block.get("total") if isinstance(block, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total
    return None


def _sibling_sizes(info: Any) -> dict[str, int]:
    """{file name: bytes} of a model-info answer with blobs (size, else lfs.size)."""
    siblings = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(siblings, list):
        raise LookupFailed("the answer has no file list", transient=False)
    sizes: dict[str, int] = {}
    for sibling in siblings:
        if not isinstance(sibling, dict) or not isinstance(sibling.get("rfilename"), str):
            continue
        size = sibling.get("size")
        if not isinstance(size, int):
            lfs = sibling.get("lfs")
            size = lfs.get("size") if isinstance(lfs, dict) else None
        sizes[sibling["rfilename"]] = size if isinstance(size, int) and size >= 0 else 0
    return sizes
