"""The worker's hub rate limit: esd_worker.core.ratelimit's token bucket on an injected clock, the
429 hold as esd_worker.fetch.hub's retries apply it, `--hub-rate` on the command line, and a real
`esd-worker --hub-rate 5` against the hub double (tests/support/hubserver.py), timed from the
double's request log.

What a token bucket promises, and what is asserted: with `burst` B and `rate` r, any N
consecutive requests span at least (N - B) / r seconds.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from esd_worker.cli import build_parser
from esd_worker.core.errors import WorkerError
from esd_worker.core.ratelimit import TokenBucket
from esd_worker.fetch.hub import RetryPolicy, set_rate_limit, with_retries
from tests.support import REPO_ROOT
from tests.support.builders import make_llama, worker_command
from tests.support.hubserver import HubServer

SHARDED = "esd-test/sharded"


class FakeClock:
    """time.monotonic and time.sleep for a bucket: sleeping moves the clock (thread-safe)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def bucket(rate: float, clock: FakeClock, **kwargs: float) -> TokenBucket:
    return TokenBucket(rate, clock=clock, sleep=clock.sleep, **kwargs)


# --- the bucket, on a fake clock -------------------------------------------------------------


@pytest.mark.parametrize(("rate", "burst", "initial", "n"), [
    pytest.param(5.0, None, 5.0, 10, id="full-bucket-of-5"),
    pytest.param(5.0, None, 1.0, 10, id="fresh-bucket-one-token"),
    pytest.param(2.5, None, 2.5, 4, id="fractional-burst"),
    pytest.param(0.5, None, 1.0, 3, id="below-one-a-second"),
    pytest.param(10.0, 3.0, 3.0, 7, id="explicit-burst"),
])
def test_n_acquisitions_take_n_minus_the_tokens_there_over_the_rate(
    rate: float, burst: float | None, initial: float, n: int
) -> None:
    """The tokens there at the start go at once; each further one 1/r later: the n-th is due
    at (n - initial) / r, and burst defaults to max(1, rate)."""
    clock = FakeClock()
    limiter = bucket(rate, clock, initial=initial, **({} if burst is None else {"burst": burst}))
    assert limiter.burst == (burst if burst is not None else max(1.0, rate))
    waits = [limiter.acquire() for _ in range(n)]
    assert clock.now == pytest.approx((n - initial) / rate)
    assert sum(1 for w in waits if w == 0) == int(initial)


def test_an_idle_bucket_refills_up_to_its_burst_and_no_more() -> None:
    clock = FakeClock()
    limiter = bucket(4.0, clock)  # burst 4, one token at the start
    limiter.acquire()
    clock.sleep(100.0)  # idle far longer than it takes to fill
    start = clock.now
    waits = [limiter.acquire() for _ in range(6)]
    assert waits[:4] == [0.0] * 4  # the burst
    assert clock.now - start == pytest.approx((6 - 4) / 4.0)


@pytest.mark.parametrize(("hold", "expected"), [
    pytest.param(3.0, [3.0, 0.1, 0.1], id="a-hold-then-the-rate-without-burst"),
    pytest.param(0.05, [0.1, 0.1, 0.1], id="a-hold-shorter-than-the-next-token"),
    pytest.param(0.0, [0.1, 0.1, 0.1], id="no-hold"),
])
def test_a_hold_delays_every_later_token(hold: float, expected: list[float]) -> None:
    """Full bucket (rate 10, burst 10) spent: the next token is 0.1 s away. A hold of 3 s
    makes it 3 s, and those after it come at the rate, not in a burst: the hub said wait."""
    clock = FakeClock()
    limiter = bucket(10.0, clock, initial=10.0)
    for _ in range(10):
        assert limiter.acquire() == 0.0
    limiter.hold(hold)
    assert [limiter.acquire() for _ in expected] == pytest.approx(expected)


def test_threads_each_get_their_own_token() -> None:
    """Eight threads take 50 tokens each with the clock stopped: 400 distinct slots, one every
    1/r: no two threads were given the same token."""
    clock = FakeClock()
    limiter = bucket(10.0, clock)  # sleeping is not simulated: each wait is its slot
    waits: list[float] = []
    lock = threading.Lock()
    go = threading.Barrier(8)

    def take() -> None:
        go.wait()
        mine = [limiter.reserve() for _ in range(50)]
        with lock:
            waits.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(waits) == pytest.approx([i / 10.0 for i in range(400)])


@pytest.mark.parametrize(("rate", "burst", "initial"), [
    pytest.param(0.0, None, 1.0, id="zero"), pytest.param(-1.0, None, 1.0, id="negative"),
    pytest.param(float("nan"), None, 1.0, id="nan"),
    pytest.param(float("inf"), None, 1.0, id="inf"),
    pytest.param(1.0, 0.5, 1.0, id="burst-below-one"),
    pytest.param(5.0, None, 6.0, id="initial-over-burst"),
])
def test_bad_bucket(rate: float, burst: float | None, initial: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst=burst, initial=initial)


# --- esd_worker.fetch.hub: a token per request, a 429 holds them all
# ---------------------------------


@pytest.fixture
def limited() -> Iterator[tuple[TokenBucket, FakeClock]]:
    """A rate limit of 10 a second (full) in force for esd_worker.fetch.hub, removed after."""
    clock = FakeClock()
    limiter = bucket(10.0, clock, initial=10.0)
    previous = set_rate_limit(limiter)
    try:
        yield limiter, clock
    finally:
        set_rate_limit(previous)


def _http_error(status: int, headers: dict[str, str]) -> Exception:
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://hub.invalid/x")
    response = httpx2.Response(status, headers=headers, request=request)
    return errors.HfHubHTTPError(f"HTTP {status}", response=response)


def _cache_miss(cause: Exception) -> Exception:
    """What hf_hub_download raises once its own retries of a file's HEAD gave up."""
    from huggingface_hub import errors

    miss = errors.LocalEntryNotFoundError("not cached")
    miss.__cause__ = cause
    return miss


@pytest.mark.parametrize(("error", "held"), [
    pytest.param(lambda: _http_error(429, {"Retry-After": "3"}), 3.0, id="429-retry-after"),
    pytest.param(lambda: _http_error(429, {}), 1.0, id="429-backoff"),
    pytest.param(lambda: _cache_miss(_http_error(429, {"Retry-After": "5"})), 5.0,
                 id="429-behind-a-cache-miss"),
    pytest.param(lambda: _http_error(503, {"Retry-After": "3"}), 0.0, id="503-no-hold"),
])
def test_a_429_holds_the_bucket_for_every_thread(
    limited: tuple[TokenBucket, FakeClock], error: Callable[[], Exception], held: float
) -> None:
    """A request rate limited by the hub: whatever thread asks next waits at least the wait
    the 429 asked for (Retry-After, else the policy's backoff); other errors hold nothing."""
    limiter, clock = limited
    calls: list[float] = []

    def call() -> None:
        calls.append(clock())
        raise error()

    # Transient, or permanent where HF_HUB_OFFLINE=1 makes a cache miss final: either way
    # the hub's answer was seen once.
    with pytest.raises(WorkerError):
        with_retries(call, "org/name", None, RetryPolicy(attempts=1, backoff_s=1.0),
                     sleep=clock.sleep)
    assert len(calls) == 1
    next_wait = limiter.reserve()  # another thread's request, at the same instant
    assert next_wait == pytest.approx(held)  # 10 of 10 tokens left minus one: no other wait


def test_each_attempt_takes_a_token(limited: tuple[TokenBucket, FakeClock]) -> None:
    """Three attempts (two 503s, then an answer) after the full bucket is spent: each waits
    for its own token (0.1 s apart), longer than the retry's backoff (0.01 s, 0.02 s)."""
    limiter, clock = limited
    for _ in range(10):
        limiter.acquire()
    started: list[float] = []
    answers = iter([_http_error(503, {}), _http_error(503, {}), None])

    def call() -> str:
        started.append(clock())
        answer = next(answers)
        if answer is not None:
            raise answer
        return "ok"

    assert with_retries(call, "org/name", None, RetryPolicy(attempts=3, backoff_s=0.01),
                        sleep=clock.sleep) == "ok"
    # One token for all three would give 0.1, 0.11, 0.13.
    assert started == pytest.approx([0.1, 0.2, 0.3])


# --- the flag --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_bad_hub_rate_is_a_usage_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--model", "x", "--output", "o", "--hub-rate", value])
    assert exc.value.code == 2
    assert "--hub-rate" in capsys.readouterr().err


# --- a real worker against the hub double --------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in many small files: a dozen downloads, each a hub request of its own."""
    return make_llama(tmp_path_factory.mktemp("sharded") / "llama", max_shard_size="10KB")


def token_requests(hub: HubServer) -> list[float]:
    """When each rate-limited request reached the hub, in order: a model-info call, and the
    HEAD that starts each file download (its GET or CDN GET follows without a token)."""
    return sorted(r.started for r in hub.requests if r.kind == "api" or r.method == "HEAD")


def fastest_window(times: list[float], burst: float, rate: float) -> float:
    """The least of span(window) - (N - burst)/rate over windows of N >= burst requests:
    >= 0 when every window respects the bucket."""
    return min(times[j] - times[i] - (j - i + 1 - burst) / rate
               for i, j in itertools.combinations(range(len(times)), 2)
               if j - i + 1 > burst)


@pytest.mark.parametrize(("rate", "limited"), [
    pytest.param("5", True, id="hub-rate-5"),
    pytest.param(None, False, id="no-limit"),
])
def test_a_worker_spaces_its_hub_requests(
    sharded_llama: Path, tmp_path: Path, rate: str | None, limited: bool
) -> None:
    """With --hub-rate 5 (burst 5) every run of N requests spans at least (N - 5)/5 s, less a
    slack for the time a request takes from its token to the hub (the first one sets up the
    HTTP client); without it the same downloads come far faster than that (the control)."""
    listed = tmp_path / "models.csv"
    listed.write_text(f"model_id\n{SHARDED}\n")
    with HubServer() as hub:
        hub.add_repo(SHARDED, sharded_llama)
        env = hub.env(tmp_path / "hf") | {"PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run(
            [*worker_command(), "--models", str(listed), "--output", str(tmp_path / "out"),
             "--device", "cpu", *(("--hub-rate", rate) if rate else ())],
            env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        times = token_requests(hub)
    assert len(times) >= 10  # model info + config, index and the shards
    slack = 0.6  # measured: -0.03 to +0.25 with the limit, -1.9 without it
    assert (fastest_window(times, 5, 5.0) >= -slack) is limited, times
