"""The bytes of a model's weights before any download, so that the shard plan can balance bytes.

Owns where a size comes from: the model list's size_bytes column, a local directory's weight
files, or the HF hub's file metadata (an HTTP adapter: stdlib urllib, rate-limited, bounded
retries, a bounded number of lookups), else a default; and how the list's numeric columns
are read (ListNumbers: a bad cell is unknown, said once). Which files count as weights is
esd_worker.core.models.weightfiles' rule, the one the worker downloads by.
Its hub client also serves controller.weights.weightmeta (the model info's parameter count, a
safetensors header's bytes through a Range request), within the same limits. Does not
download anything, parse headers (controller.weights.weightmeta), decide which class or shard a
model goes to (controller.backends.kubernetes.sharded.plan), or report hub errors as the model's
failure: the worker
meets them again and records them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any, Literal
from urllib.parse import quote, urlsplit

from esd_worker.core.echo import quoted
from esd_worker.core.flags import MAX_BYTES, parse_size
from esd_worker.core.models.modellist import ModelRow, is_local_path
from esd_worker.core.models.weightfiles import weight_names

log = logging.getLogger(__name__)

SIZE_COLUMN = "size_bytes"  # an optional model-list column (ModelRow.metadata) that gives the size
MAX_MODEL_BYTES = MAX_BYTES  # 1000T: a size_bytes past it is no model's
DEFAULT_ENDPOINT = "https://huggingface.co"

_ATTEMPTS = 4  # requests per lookup, in all, when the hub answers 429/5xx or is unreachable
_BACKOFF_S = 1.0  # the n-th wait is _BACKOFF_S * 2**(n-1) without a Retry-After
_MAX_WAIT_S = 60.0
# Lookups in a row that ran out of attempts: the hub is taken as down for the rest of the
# plan, rather than spending _ATTEMPTS waits on each of thousands of models.
_DOWN_AFTER = 5
_WARNED_FAILURES = 5  # failed lookups logged one by one; the rest only in the stats
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's reading of a boolean variable

Source = Literal["column", "local", "hub", "default", "failed"]  # a SizeStats field


@dataclass
class SizeStats:
    """How many size() answers came from where. column, local, hub: found there; failed: a
    local directory or hub lookup that could not give a size; default: not looked up (offline,
    past the lookup limit, the hub taken as down). failed and default answers are the default
    size."""

    column: int = 0
    local: int = 0
    hub: int = 0
    default: int = 0
    failed: int = 0


class RateLimiter:
    """At most rate_per_s acquisitions a second, one at a time (a token bucket holding one
    token: no burst). Thread-safe: each caller reserves its slot under the lock and sleeps
    outside it."""

    def __init__(self, rate_per_s: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        self._interval = 1.0 / rate_per_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = float("-inf")  # when the next acquisition may go

    def acquire(self) -> None:
        with self._lock:
            now = self._clock()
            start = max(self._next, now)
            self._next = start + self._interval
        if start > now:
            self._sleep(start - now)


@dataclass(frozen=True)
class HubInfo:
    """What one model-info answer says of a hub model: its root files' bytes (name -> bytes)
    and its parameter count when the hub gives one (the answer's safetensors.total: the hub
    reads it from the safetensors headers; None without it)."""

    files: Mapping[str, int]
    params: int | None = None


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


class _LookupFailed(Exception):
    """The hub gave no size; transient: 429/5xx or unreachable after every attempt."""

    def __init__(self, why: str, *, transient: bool) -> None:
        super().__init__(why)
        self.transient = transient


class Sizer:
    """The bytes a model's weights take, before any download: the list's size_bytes column, else
    the weight files of a local directory (esd_worker.core.models.weightfiles: what the worker
    downloads and reads), else the hub's file metadata (GET
    {endpoint}/api/models/{id}/revision/{rev or main}?blobs=true: the siblings' sizes of the
    weight files; for an adapter, adapter_config.json among them: its adapter files), else
    `default_bytes` (counted in `stats`; log_stats() logs them once, at the end).

    Hub lookups: at most `rate_per_s` requests a second (RateLimiter: injectable clock and
    sleep), at most `lookup_limit` lookups in all (beyond: the default, so that planning a
    2M-row list never makes 2M hub calls; the log says to add a size_bytes column); 429 and
    5xx retried up to 4 requests in all, honouring Retry-After (seconds); 401/403/404 and
    other answers: the default (the worker reports the real error). After 5 lookups in a row
    that ran out of retries the hub is taken as down: the rest get the default. HF_ENDPOINT
    (default https://huggingface.co), HF_TOKEN and HF_HUB_OFFLINE (1: no lookups) from the
    environment unless given; the token only ever goes in the Authorization header, never in
    a log. Results are memoised per ref (an adapter's base asked twice costs one call), those
    of the size_bytes column excepted (nothing to save, and a 2M-row list would be kept).
    hub_info (the same model-info answer) and read_range (a header's bytes) serve
    controller.weights.weightmeta; a read_range is a lookup of its own.
    """

    def __init__(
        self, *, endpoint: str | None = None, token: str | None = None,
        rate_per_s: float = 5.0, lookup_limit: int = 10_000, default_bytes: int = 2 * 1024**3,
        timeout_s: float = 10.0, offline: bool | None = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if lookup_limit < 0 or default_bytes < 0 or timeout_s <= 0:
            raise ValueError("lookup_limit and default_bytes must be >= 0, timeout_s > 0")
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        if urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ValueError(f"the hub endpoint must be an http(s) URL, got {self.endpoint!r}")
        self._token = token if token is not None else os.environ.get("HF_TOKEN") or None
        if offline is None:
            offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE
        self.offline = offline
        self.lookup_limit = lookup_limit
        self.default_bytes = default_bytes
        self.stats = SizeStats()
        self._timeout_s = timeout_s
        self._sleep = sleep
        self._limiter = RateLimiter(rate_per_s, clock=clock, sleep=sleep)
        self._opener = urllib.request.build_opener(_SameOriginAuth)
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[int, Source]] = {}  # ref -> (bytes, SizeStats field)
        self._infos: dict[str, tuple[HubInfo | None, Source]] = {}  # ref -> the hub's answer
        self._lookups = 0
        self._failures_in_a_row = 0
        self._hub_down = False
        self.cells = ListNumbers()  # also controller.weights.weightmeta's (num_params, matrix_dim)

    def size(self, row: ModelRow) -> int:
        """The weights' bytes of `row` (an estimate: the default when nothing else is known)."""
        column = self._column_size(row)
        if column is not None:
            return self._answer(column, "column")
        with self._lock:
            memo = self._memo.get(row.ref)
        if memo is not None:
            return self._answer(*memo)
        if is_local_path(row.model_id):
            size, source = self._local_size(row)
        else:
            size, source = self._hub_size(row)
        if source != "default":
            with self._lock:
                self._memo[row.ref] = (size, source)
        return self._answer(size, source)

    def log_stats(self) -> None:
        """One line on the sizes: where they came from, and how many are the default."""
        s = self.stats
        guessed = s.default + s.failed
        level = logging.WARNING if guessed else logging.INFO
        log.log(level, "model sizes: %d from the %s column, %d local, %d from the hub, %d the "
                "default %d bytes (%d lookups failed)%s", s.column, SIZE_COLUMN, s.local, s.hub,
                guessed, self.default_bytes, s.failed,
                f"; add a {SIZE_COLUMN} column to the list for balanced shards" if guessed
                else "")

    # --- where a size comes from --------------------------------------------------------------

    def _answer(self, size: int, source: Source) -> int:
        with self._lock:
            setattr(self.stats, source, getattr(self.stats, source) + 1)
        return size if source in ("column", "local", "hub") else self.default_bytes

    def _column_size(self, row: ModelRow) -> int | None:
        return self.cells.read(row, SIZE_COLUMN, parse_size, lo=0, hi=MAX_MODEL_BYTES,
                               what="a size from 0 to 1000T bytes")

    def _local_size(self, row: ModelRow) -> tuple[int, Source]:
        directory = os.path.expanduser(row.model_id)
        try:
            with os.scandir(directory) as entries:
                sizes = {e.name: e.stat().st_size for e in entries if e.is_file()}
        except OSError as e:
            log.warning("model=%s: cannot size the local directory (%s); the default size is used",
                        row.ref, e.strerror or e)
            return 0, "failed"
        return sum(sizes[n] for n in weight_names(sizes)), "local"

    def _hub_size(self, row: ModelRow) -> tuple[int, Source]:
        info, source = self._hub_lookup(row)
        if info is None:
            return 0, source
        return sum(info.files[n] for n in weight_names(info.files)), "hub"

    # --- the hub's answers, for sizes and for controller.weights.weightmeta
    # -----------------------------

    def hub_info(self, row: ModelRow) -> HubInfo | None:
        """The hub's model info of `row` (one lookup, shared with size(): memoised), or None:
        offline, past the lookup limit, the hub taken as down, or the lookup failed."""
        return self._hub_lookup(row)[0]

    def read_range(self, row: ModelRow, filename: str, start: int, end: int) -> bytes | None:
        """Bytes start..end (inclusive) of one of `row`'s files on the hub, through
        {endpoint}/{id}/resolve/{rev}/{file} with a Range header (the hub redirects LFS
        files to its CDN; the token is not sent there). A lookup of its own (the same
        limit, rate and retries); None when none may be made or it failed. At most
        end - start + 1 bytes are read, should the server ignore the Range."""
        if not self._take_lookup():
            return None
        url = (f"{self.endpoint}/{quote(row.model_id, safe='/')}/resolve/"
               f"{quote(row.revision or 'main', safe='')}/{quote(filename, safe='/')}")
        try:
            return self._get(url, accept="*/*", extra={"Range": f"bytes={start}-{end}"},
                             limit=end - start + 1, partial=start > 0)
        except _LookupFailed as e:
            log.debug("model=%s: no bytes %d-%d of %s from the hub (%s)", row.ref, start, end,
                      filename, e)
            return None

    def _hub_lookup(self, row: ModelRow) -> tuple[HubInfo | None, Source]:
        with self._lock:
            known = self._infos.get(row.ref)
        if known is not None:
            return known
        if not self._take_lookup():
            return None, "default"
        url = (f"{self.endpoint}/api/models/{quote(row.model_id, safe='/')}/revision/"
               f"{quote(row.revision or 'main', safe='')}?blobs=true")
        answer: tuple[HubInfo | None, Source]
        try:
            info = self._get_json(url)
            answer = HubInfo(_sibling_sizes(info), _safetensors_total(info)), "hub"
        except _LookupFailed as e:
            self._lookup_failed(row, e)
            answer = None, "failed"
        else:
            with self._lock:
                self._failures_in_a_row = 0
        with self._lock:
            self._infos[row.ref] = answer
        return answer

    def _take_lookup(self) -> bool:
        """Whether a hub lookup may be made now (counted when it may)."""
        with self._lock:
            if self.offline or self._hub_down:
                return False
            if self._lookups >= self.lookup_limit:
                if self._lookups == self.lookup_limit:
                    self._lookups += 1  # warn once
                    log.warning("%d hub lookups made, the limit: the other models get the "
                                "default size (%d bytes) and one GPU; add a %s column to the "
                                "list", self.lookup_limit, self.default_bytes, SIZE_COLUMN)
                return False
            self._lookups += 1
            return True

    def _lookup_failed(self, row: ModelRow, error: _LookupFailed) -> None:
        with self._lock:
            failed = self.stats.failed + 1  # this one is counted by _answer
            self._failures_in_a_row = self._failures_in_a_row + 1 if error.transient else 0
            down = not self._hub_down and self._failures_in_a_row >= _DOWN_AFTER
            self._hub_down = self._hub_down or down
        if failed <= _WARNED_FAILURES:
            log.warning("model=%s: no metadata from the hub (%s); its size is the default and "
                        "it gets one GPU%s",
                        row.ref, error, "; further failures are only counted"
                        if failed == _WARNED_FAILURES else "")
        if down:
            log.warning("the hub at %s failed %d lookups in a row: the other models get the "
                        "default size and one GPU", self.endpoint, _DOWN_AFTER)

    def _get_json(self, url: str) -> Any:
        """The JSON `url` answers, asked at most _ATTEMPTS times; _LookupFailed otherwise."""
        body = self._get(url, accept="application/json")
        try:
            return json.loads(body)
        except ValueError:
            raise _LookupFailed("the answer is not JSON", transient=False) from None

    def _get(self, url: str, *, accept: str, extra: Mapping[str, str] | None = None,
             limit: int | None = None, partial: bool = False) -> bytes:
        """The body `url` answers (at most `limit` bytes; None: all), asked at most _ATTEMPTS
        times; _LookupFailed otherwise. partial: only a 206 answer will do (a server that
        ignores the Range sends the file from its start)."""
        request = urllib.request.Request(url, headers={"Accept": accept,
                                                       "User-Agent": "esd-sweep", **(extra or {})})
        if self._token:
            # Unredirected: _SameOriginAuth decides whether a redirect gets it.
            request.add_unredirected_header("Authorization", f"Bearer {self._token}")
        for attempt in range(1, _ATTEMPTS + 1):
            self._limiter.acquire()
            retry_after: str | None = None
            try:
                with self._opener.open(request, timeout=self._timeout_s) as response:
                    if partial and response.status != 206:
                        raise _LookupFailed(f"HTTP {response.status}, not the range asked for",
                                            transient=False)
                    return bytes(response.read(limit))
            except urllib.error.HTTPError as e:
                retry_after = e.headers.get("Retry-After")
                e.close()
                if e.code != 429 and e.code < 500:
                    raise _LookupFailed(f"HTTP {e.code}", transient=False) from None
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                why = str(getattr(e, "reason", e)) or type(e).__name__
            if attempt == _ATTEMPTS:
                raise _LookupFailed(f"{why}, {attempt} attempts", transient=True)
            wait = _wait_s(attempt, retry_after)
            log.debug("GET %s: %s; attempt %d of %d, retrying in %.1fs", url, why, attempt,
                      _ATTEMPTS, wait)
            self._sleep(wait)
        raise AssertionError("unreachable")


class ListNumbers:
    """The numbers of the list's optional numeric columns (size_bytes here; num_params and
    matrix_dim for controller.weights.weightmeta). A cell that is not a finite number in its
    column's range (NaN, inf, 1e999, negative, past any model, not a number) is unknown, as
    if empty, never an error; the first such cell of each column is logged (its line, the
    column, the cell, bounded), later ones are not: a list of millions of rows may have as
    many bad cells. Thread-safe (the local backend asks from a look-ahead thread)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def read(self, row: ModelRow, name: str, parse: Callable[[str], float | None], *,
             lo: int, hi: int, what: str) -> int | None:
        """`row`'s cell of column `name` through `parse` (None, ValueError, OverflowError or
        ArgumentTypeError: not a number), when it is within lo..hi; else None. `what`
        describes the range for the warning ("a size from 0 to 1000T bytes")."""
        raw = list_cell(row.metadata, name)
        if not raw:
            return None
        try:
            value = parse(raw)
            fits = value is not None and math.isfinite(value) and lo <= value <= hi
        except (ValueError, OverflowError, argparse.ArgumentTypeError):
            fits = False
        if fits and value is not None:
            return int(value)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            log.warning("line %d: %s %s is not %s: read as empty, as if the list had no %s "
                        "for the model (further bad %s cells are not logged)", row.line, name,
                        quoted(raw, limit=40), what, name, name)
        return None


def list_cell(metadata: Mapping[str, str], name: str) -> str:
    """An optional model-list column's cell (size_bytes, num_params, …; the header spelt in
    any case, '-' or ' ' for '_'), stripped; "" if none."""
    if name in metadata:
        return metadata[name].strip()
    for key, value in metadata.items():
        if key.strip().lower().replace("-", "_").replace(" ", "_") == name:
            return value.strip()
    return ""


def _wait_s(attempt: int, retry_after: str | None) -> float:
    """Retry-After in seconds when the hub sent one, else exponential backoff; capped."""
    value = (retry_after or "").strip()
    try:
        wait = float(value) if value else _BACKOFF_S * 2 ** (attempt - 1)
    except ValueError:  # an HTTP-date: back off as if there were none
        wait = _BACKOFF_S * 2 ** (attempt - 1)
    return max(0.0, min(wait, _MAX_WAIT_S))


def _safetensors_total(info: Any) -> int | None:
    """The parameter count of a model-info answer ("safetensors": {"total": N}), if any."""
    block = info.get("safetensors") if isinstance(info, dict) else None
    total = block.get("total") if isinstance(block, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None


def _sibling_sizes(info: Any) -> dict[str, int]:
    """{file name: bytes} of a model-info answer with blobs (size, else lfs.size)."""
    siblings = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(siblings, list):
        raise _LookupFailed("the answer has no file list", transient=False)
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
