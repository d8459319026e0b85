"""The worker's HTTP side of the HuggingFace hub: one model-info call, file downloads into an
HF cache, bounded retries, and hub errors mapped to the worker's permanent/transient errors.

Owns: which hub failures are retried here (how many times and how long to wait is
esd_worker.core.hubretry.RetryPolicy's, the controller's hub client's policy too), the calls
to huggingface_hub (model_info, hf_hub_download), the cache folder of a repo, and
classify_hub_error. Does not: choose which files a model needs, or handle local directories
and offline mode (esd_worker.fetch.resolve does).

What huggingface_hub 2.4 already retries, so that this module does not multiply it:
- a file's HEAD /resolve answered 429/5xx or unreachable: hf_hub_download tries once, then
  again with http_backoff (5 retries, waits 1, 2, 4, 8, 8 s, or Retry-After + 1 s), then
  raises LocalEntryNotFoundError (cause: the last HTTP error);
- a file's GET answered 408/429, or cut off: retried (5 times, resuming with Range).
What it does not retry, and this module does: the model-info API call (any failure), and a
file GET answered 5xx. So the worst case is bounded: `attempts` model-info calls, and per file
`attempts` × (7 HEADs + 6 GETs).

Rate limit (`esd-worker --hub-rate R`, set once per process with `set_rate_limit`): each
model-info call and each file download started (every attempt of either) first takes a token
from one process-wide esd_worker.core.ratelimit.TokenBucket, whatever thread it runs in. A 429
that reaches this module holds the bucket for its wait, so the other downloads back off too;
a 429 that huggingface_hub retries by itself is seen (and held for) only once it gives up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from esd_worker.core.errors import PermanentModelError, TransientError, WorkerError
from esd_worker.core.files import write_atomic
from esd_worker.core.hubretry import RetryPolicy
from esd_worker.core.ratelimit import TokenBucket

log = logging.getLogger(__name__)
T = TypeVar("T")

_HF_RETRIED_STATUSES = (408, 429)  # what huggingface_hub retries on a GET itself
_MAX_PARALLEL_FILES = 8  # what snapshot_download uses: shards download side by side
_TOO_MANY_REQUESTS = 429

# The process's hub rate limit (None: none). Module state, not a setting passed down: every
# path to the hub (the prefetcher's threads, analyse_model's resolve) shares the one bucket.
_limiter: TokenBucket | None = None


def set_rate_limit(limiter: TokenBucket | None) -> TokenBucket | None:
    """Every later hub request of this process takes a token from `limiter` first (None: no
    limit); returns the one in force before, for a caller that restores it."""
    global _limiter
    previous, _limiter = _limiter, limiter
    return previous


def _take_token() -> None:
    limiter = _limiter
    if limiter is not None:
        waited = limiter.acquire()
        if waited >= 1.0:
            log.debug("hub rate limit: waited %.1fs for a request", waited)


def _hold_for_429(answer: BaseException, wait: float) -> None:
    """A 429 holds the bucket `wait` seconds: the next request of any thread waits at least
    as long as this one does, so parallel downloads stop asking together."""
    limiter = _limiter
    if limiter is not None and _status(answer) == _TOO_MANY_REQUESTS:
        log.info("hub rate limited (HTTP 429): hub requests held for %.1fs", wait)
        limiter.hold(wait)


def _retry_after(error: BaseException) -> str | None:
    """The Retry-After header of the hub's answer behind `error`, if any."""
    headers = getattr(getattr(error, "response", None), "headers", None) or {}
    value = headers.get("Retry-After")
    return str(value) if value is not None else None


def _status(error: BaseException | None) -> int | None:
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _hub_answer(error: BaseException) -> BaseException:
    """The HTTP error behind `error`: itself, or the one huggingface_hub wrapped in a
    cache-miss error (LocalEntryNotFoundError) after its own retries."""
    cause = error.__cause__
    if _status(error) is None and cause is not None and _status(cause) is not None:
        return cause
    return error


def with_retries(
    call: Callable[[], T], model_id: str, revision: str | None, policy: RetryPolicy, *,
    retried_inside: Callable[[Exception], bool] = lambda e: False,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """call(), retried while it fails transiently, at most policy.attempts times in all.

    Permanent failures (401, 403, 404, malformed ids) raise PermanentModelError at once;
    `retried_inside(e)` says huggingface_hub already retried e itself: raised at once too.
    Each attempt is a hub request: it takes a token of the rate limit first (set_rate_limit).
    """
    for attempt in range(1, policy.attempts + 1):
        _take_token()
        try:
            return call()
        except WorkerError:
            raise
        except Exception as e:
            error = classify_hub_error(e, model_id, revision)
            answer = _hub_answer(e)
            wait = policy.wait_s(attempt, _retry_after(answer))
            _hold_for_429(answer, wait)
            if not isinstance(error, TransientError) or retried_inside(e):
                raise error from e
            if attempt == policy.attempts:
                raise TransientError(f"{error} (gave up after {attempt} attempts)") from e
            log.warning("%s; attempt %d of %d, retrying in %.1fs", error, attempt,
                        policy.attempts, wait)
            sleep(wait)
    raise AssertionError("unreachable: policy.attempts < 1")


def _retried_by_hf_hub_download(e: Exception) -> bool:
    """Whether hf_hub_download already retried this failure (see the module docstring)."""
    from huggingface_hub import errors

    if isinstance(e, errors.LocalEntryNotFoundError):  # the HEAD, after its own backoff
        return True
    if isinstance(e, errors.HfHubHTTPError):
        return _status(e) in _HF_RETRIED_STATUSES
    return type(e).__module__.startswith("httpx")  # a GET cut off: resumed 5 times already


def model_info(model_id: str, revision: str | None, policy: RetryPolicy) -> Any:
    """huggingface_hub's ModelInfo with file sizes (siblings[].size), retried as above."""
    from huggingface_hub import HfApi

    return with_retries(
        lambda: HfApi().model_info(model_id, revision=revision, files_metadata=True),
        model_id, revision, policy,
    )


def repo_cache_dir(model_id: str, cache_dir: Path | None = None) -> Path:
    """The models--org--name folder of `model_id` in cache_dir (default: the HF hub cache)."""
    from huggingface_hub import constants

    root = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    return root.expanduser().resolve() / ("models--" + model_id.replace("/", "--"))


def download_files(
    model_id: str, sha: str, names: Sequence[str], *, ref: str | None,
    cache_dir: Path | None, policy: RetryPolicy,
) -> Path:
    """Download `names` at commit `sha` into the cache; returns the snapshot folder.

    Files already in that snapshot cost no request. ref: the branch the caller asked for
    ("main" when None), recorded in refs/ so that an offline run finds this snapshot later.
    """
    from huggingface_hub import hf_hub_download

    def fetch(name: str) -> str:
        return with_retries(
            lambda: hf_hub_download(model_id, name, revision=sha, cache_dir=cache_dir),
            model_id, ref, policy, retried_inside=_retried_by_hf_hub_download,
        )

    with ThreadPoolExecutor(max_workers=max(1, min(_MAX_PARALLEL_FILES, len(names)))) as pool:
        futures = [pool.submit(fetch, name) for name in names]
        try:
            for future in futures:
                future.result()
        except BaseException:
            # One file failed for good: do not start the shards still queued.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    folder = repo_cache_dir(model_id, cache_dir)
    if (ref or "main") != sha:
        # hf_hub_download records refs only for what it resolved itself; it was given the sha.
        ref_path = folder / "refs" / (ref or "main")
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole and never through a symlink planted in a cache others may write
        # (a team's --cache-dir); no newline: huggingface_hub reads the file verbatim.
        write_atomic(ref_path, sha.encode("ascii"))
    return folder / "snapshots" / sha


def classify_hub_error(
    e: Exception, model_id: str, revision: str | None, *, offline: bool | None = None
) -> WorkerError:
    """Map huggingface_hub / network errors to permanent or transient, with what to do next.

    offline: whether HF_HUB_OFFLINE is in force (default: huggingface_hub's reading of it).
    """
    from huggingface_hub import constants, errors

    if offline is None:
        offline = bool(constants.HF_HUB_OFFLINE)
    what = model_id if revision is None else f"{model_id}@{revision}"
    cause = e.__cause__
    if (isinstance(e, errors.LocalEntryNotFoundError) and isinstance(cause, Exception)
            and (_status(cause) or 0) // 100 == 4 and _status(cause) not in _HF_RETRIED_STATUSES):
        # hf_hub_download wraps a HEAD answered e.g. 403 without X-Error-Code (or 404 without
        # one) as "not in the cache": the hub's answer is what matters.
        return classify_hub_error(cause, model_id, revision, offline=offline)
    if isinstance(e, errors.GatedRepoError):
        return PermanentModelError(
            f"{what} is gated: accept its licence on the hub and set HF_TOKEN to a token "
            "that has access"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return PermanentModelError(f"revision not found: {what}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return PermanentModelError(f"model not found: {what} (private repos need HF_TOKEN)")
    if offline and isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return PermanentModelError(
            f"{what} is not in the HF cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 is "
            "set: download it first, or unset HF_HUB_OFFLINE"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        # Not offline by choice: the hub failed (after huggingface_hub's own retries) or could
        # not be reached, and the cache lacks the files.
        if cause is not None and (status := _status(cause)) is not None:
            return TransientError(
                f"hub error for {what} (HTTP {status}) and it is not (fully) cached: retry later"
            )
        reason = f" ({_one_line(cause)})" if cause is not None else ""
        return TransientError(f"hub unreachable and {what} not (fully) cached{reason}")
    if isinstance(e, errors.EntryNotFoundError):
        return PermanentModelError(f"{what}: file not found on the hub: {_one_line(e)}")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return PermanentModelError(f"{what} is not in the HF cache and HF_HUB_OFFLINE=1 is set")
    if isinstance(e, errors.HfHubHTTPError):
        status = _status(e)
        if status in (401, 403):
            return PermanentModelError(f"{what}: access denied ({status}); set HF_TOKEN")
        if status == 404:
            return PermanentModelError(f"model not found: {what}")
        return TransientError(f"hub error for {what} (HTTP {status}): retry later")
    if isinstance(e, (ConnectionError, TimeoutError, OSError)) or type(e).__module__.startswith(
        ("httpx", "httpcore", "requests", "urllib3")
    ):
        return TransientError(f"network error fetching {what}: {type(e).__name__}: {_one_line(e)}")
    if isinstance(e, ValueError):  # e.g. HFValidationError for a malformed id
        return PermanentModelError(f"invalid model id {what}: {_one_line(e)}")
    return TransientError(f"unexpected error fetching {what}: {type(e).__name__}: {_one_line(e)}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
