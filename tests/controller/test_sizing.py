"""Tests of controller.weights.sizing: model sizes from the list's column, local directories and
the hub.

The hub is tests.support.hubserver's double over real HTTP (its model-info route with blobs);
waits go through an injected clock and sleep (FakeTime), so retries and the rate limit are
checked by the waits asked for, not timed. The token test needs the request headers, which
the double does not keep: a small header-recording server (HeaderServer) stands in there.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller.weights.sizing import SIZE_COLUMN, Sizer, SizeStats
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import parse_ref
from esd_worker.core.ratelimit import TokenBucket
from tests.support.hubserver import HubServer, Request

DEFAULT = 7777  # the default size in these tests: no real size equals it
TOKEN = "hf_SECRETtoken123"
NO_HUB = "http://127.0.0.1:9"  # the discard port: nothing answers there

# --- builders -------------------------------------------------------------------------------


def make_row(ref: str, relation: str = "", source: str | None = None,
             metadata: Mapping[str, str] | None = None, line: int = 0) -> ModelRow:
    model_id, revision, problem = parse_ref(ref)
    assert problem is None, problem
    return ModelRow(model_id, revision, relation, source, line=line,
                    metadata=dict(metadata or {}))


def make_dir(path: Path, files: Mapping[str, int]) -> Path:
    """A directory holding `files` (name -> size in bytes; names may have a '/')."""
    for name, size in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(b"\0" * size)
    return path


@dataclass
class FakeTime:
    """A clock that moves only when slept on; records every sleep."""

    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.sleeps.append(seconds)
            self.now += seconds


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub, token, offline switch or proxy from the environment the tests run in."""
    for name in ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def hub_server() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture
def hub(hub_server: HubServer) -> HubServer:
    """One hub double for the module (stopping one takes half a second); each test's repos
    live under its own organisation (`org`), so tests never see each other's."""
    hub_server.clear_faults()
    return hub_server


_orgs = itertools.count()


@pytest.fixture
def org() -> str:
    return f"t{next(_orgs)}"


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


def make_sizer(hub: HubServer | str, fake_time: FakeTime, **kwargs: Any) -> Sizer:
    endpoint = hub if isinstance(hub, str) else hub.url
    options: dict[str, Any] = dict(endpoint=endpoint, offline=False, default_bytes=DEFAULT,
                                   rate_per_s=1000.0, clock=fake_time.clock,
                                   sleep=fake_time.sleep)
    return Sizer(**(options | kwargs))


def add_repo(hub: HubServer, tmp_path: Path, repo: str, files: Mapping[str, int],
             revision: str = "main") -> None:
    directory = make_dir(tmp_path / "repos" / repo / revision.replace("/", "_"), files)
    hub.add_repo(repo, directory, revision=revision)


def api_requests(hub: HubServer, org: str, at_least: int = 0) -> list[Request]:
    """The double's model-info requests about `org`'s repos in the order they arrived, once at
    least `at_least` are logged: it logs a request after answering it, so the last may land
    just after the client has its answer, and after a later one."""
    deadline = time.monotonic() + 10
    while True:
        calls = [c for c in hub.calls(kind="api") if (c.repo or "").startswith(f"{org}/")]
        if len(calls) >= at_least or time.monotonic() > deadline:
            return sorted(calls, key=lambda c: c.started)
        time.sleep(0.01)


# --- the size_bytes column ------------------------------------------------------------------


@pytest.mark.parametrize(("metadata", "expected"), [
    ({SIZE_COLUMN: "123"}, 123),
    ({SIZE_COLUMN: " 2G "}, 2 * 10**9),
    ({SIZE_COLUMN: "1.5GiB"}, int(1.5 * 2**30)),
    ({"Size-Bytes": "42", "note": "x"}, 42),
    ({SIZE_COLUMN: "0"}, 0),
], ids=["bytes", "unit", "binary-unit", "header-spelling", "zero"])
def test_size_from_the_column(hub: HubServer, org: str, fake_time: FakeTime,
                              metadata: dict[str, str], expected: int) -> None:
    """The list's own size wins and costs no lookup, even for a hub model."""
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model", metadata=metadata)) == expected
    assert sizer.stats == SizeStats(column=1)
    assert len(api_requests(hub, org)) == 0


def test_bad_column_falls_through_to_the_hub(hub: HubServer, org: str, fake_time: FakeTime,
                                             tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 300})
    sizer = make_sizer(hub, fake_time)
    rows = [make_row(f"{org}/{name}", metadata={SIZE_COLUMN: "lots"})
            for name in ("model", "other")]
    with caplog.at_level(logging.WARNING, logger="controller.weights.sizing"):
        assert [sizer.size(r) for r in rows] == [300, DEFAULT]
    assert sum("is not a size" in r.getMessage() for r in caplog.records) == 1  # once


BAD_SIZES = {
    "nan": "NaN", "inf": "inf", "1e999": "1e999", "1e999-with-unit": "1e999G",
    "negative": "-5", "words": "lots", "past-any-model": "1e30", "2000T": "2000T",
    "400-digits": "9" * 400,
}


@pytest.mark.parametrize("cell", BAD_SIZES.values(), ids=BAD_SIZES.keys())
def test_a_bad_size_cell_is_unknown_and_said_once(
    fake_time: FakeTime, cell: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """No size from 0 to 1000T bytes (nan and 1e999 once raised ValueError / OverflowError
    from int(); 1e30 bytes is no model): sized as if the cell were empty, here the default
    (offline), and one warning for the three rows, naming the first one's line, the column
    and the cell."""
    sizer = make_sizer(NO_HUB, fake_time, offline=True)
    rows = [make_row(f"org/m{i}", metadata={SIZE_COLUMN: cell}, line=i + 2) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="controller.weights.sizing"):
        assert [sizer.size(r) for r in rows] == [DEFAULT] * 3
    (warning,) = [r.getMessage() for r in caplog.records if SIZE_COLUMN in r.getMessage()]
    assert warning.startswith(f"line 2: {SIZE_COLUMN} '{cell[:20]}")
    assert "is not a size" in warning
    assert sizer.stats == SizeStats(default=3)


# --- local directories ----------------------------------------------------------------------

LOCAL_CASES = {
    "safetensors": ({"model.safetensors": 1000, "config.json": 50, "pytorch_model.bin": 900},
                    "", 1000),
    "bin-fallback": ({"pytorch_model.bin": 900, "training_args.bin": 20}, "", 900),
    "pt-and-pth-not-weights": ({"a.pt": 30, "b.pth": 40}, "finetune", 0),
    "adapter": ({"adapter_model.safetensors": 60, "adapter_config.json": 5}, "lora", 60),
    "subfolder-ignored": ({"model.safetensors": 10, "sub/model.safetensors": 500}, "", 10),
}


@pytest.mark.parametrize(("files", "relation", "expected"), LOCAL_CASES.values(),
                         ids=LOCAL_CASES.keys())
def test_size_of_a_local_directory(fake_time: FakeTime, tmp_path: Path,
                                   files: dict[str, int], relation: str, expected: int) -> None:
    """Sizes on disk; no hub (the endpoint is unreachable: a lookup would count as failed)."""
    directory = make_dir(tmp_path / "model@v1", files)
    sizer = make_sizer(NO_HUB, fake_time)
    assert sizer.size(make_row(str(directory), relation)) == expected
    assert sizer.stats == SizeStats(local=1)


def test_missing_local_directory_is_default(fake_time: FakeTime, tmp_path: Path) -> None:
    sizer = make_sizer(NO_HUB, fake_time)
    assert sizer.size(make_row(str(tmp_path / "gone"))) == DEFAULT
    assert sizer.stats == SizeStats(failed=1)


# --- the hub --------------------------------------------------------------------------------

HUB_CASES = {
    "sharded-safetensors": (
        {"config.json": 10, "model.safetensors.index.json": 20,
         "model-00001-of-00002.safetensors": 3000, "model-00002-of-00002.safetensors": 2000},
        "", 5000),
    "bin-fallback": ({"config.json": 10, "pytorch_model.bin": 4000}, "", 4000),
    "adapter-files": ({"adapter_model.safetensors": 400, "adapter_config.json": 10,
                       "model.safetensors": 9000}, "lora", 400),
    "no-weights": ({"config.json": 10, "model.onnx": 5000}, "", 0),
    "gguf-only": ({"config.json": 10, "model.Q8_0.gguf": 5000}, "", 5000),
}


@pytest.mark.parametrize(("files", "relation", "expected"), HUB_CASES.values(),
                         ids=HUB_CASES.keys())
def test_size_from_the_hub(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path,
                           files: dict[str, int], relation: str, expected: int) -> None:
    """One model-info call with blobs; the weight files' sizes summed."""
    add_repo(hub, tmp_path, f"{org}/model", files)
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model", relation)) == expected
    assert sizer.stats == SizeStats(hub=1)
    assert [c.path for c in api_requests(hub, org, 1)] == [f"/api/models/{org}/model/revision/main"]


@pytest.mark.parametrize("revision", ["v1", "refs/pr/1"])
def test_size_of_a_revision(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path,
                            revision: str) -> None:
    """The revision asked for, not main (a '/' in it travels percent-encoded)."""
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 250}, revision=revision)
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model@{revision}")) == 250
    assert sizer.size(make_row(f"{org}/model")) == 100


@pytest.mark.parametrize("status", [401, 403, 404])
def test_refused_lookup_is_default_without_retry(hub: HubServer, org: str, fake_time: FakeTime,
                                                 tmp_path: Path, status: int) -> None:
    """401/403/404 will not change on a retry: the default, counted; the worker reports it."""
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    hub.fail(f"{org}/model", status, on="api")
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model")) == DEFAULT
    assert sizer.stats == SizeStats(failed=1)
    assert len(api_requests(hub, org, 1)) == 1 and fake_time.sleeps == []


def test_unknown_repo_is_default(hub: HubServer, org: str, fake_time: FakeTime) -> None:
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/nowhere")) == DEFAULT
    assert sizer.stats == SizeStats(failed=1)
    assert [c.status for c in api_requests(hub, org, 1)] == [404]


def test_429_waits_retry_after_then_succeeds(hub: HubServer, org: str, fake_time: FakeTime,
                                             tmp_path: Path) -> None:
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    hub.fail(f"{org}/model", 429, retry_after=3, on="api")
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model")) == 100
    assert fake_time.sleeps == [3.0]
    assert [c.status for c in api_requests(hub, org, 2)] == [429, 200]
    assert sizer.stats == SizeStats(hub=1)


def test_5xx_backs_off_then_succeeds(hub: HubServer, org: str, fake_time: FakeTime,
                                     tmp_path: Path) -> None:
    """Without Retry-After the waits double: 1 s, 2 s."""
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    hub.fail(f"{org}/model", 503, times=2, on="api")
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model")) == 100
    assert fake_time.sleeps == [1.0, 2.0]


def test_5xx_retries_are_bounded(hub: HubServer, org: str, fake_time: FakeTime,
                                 tmp_path: Path) -> None:
    """4 requests in all, then the default; a huge Retry-After is capped at a minute."""
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    hub.fail(f"{org}/model", 500, times=None, retry_after=86400, on="api")
    sizer = make_sizer(hub, fake_time)
    assert sizer.size(make_row(f"{org}/model")) == DEFAULT
    assert len(api_requests(hub, org, 4)) == 4
    assert fake_time.sleeps == [60.0, 60.0, 60.0]
    assert sizer.stats == SizeStats(failed=1)


def test_hub_down_stops_lookups(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path,
                                caplog: pytest.LogCaptureFixture) -> None:
    """After 5 lookups in a row ran out of retries the rest get the default without asking:
    planning a long list against a hub that is down ends in seconds, not hours."""
    for i in range(8):
        hub.fail(f"{org}/m{i}", 503, times=None, on="api")
    sizer = make_sizer(hub, fake_time)
    with caplog.at_level(logging.WARNING, logger="controller.weights.sizing"):
        sizes = [sizer.size(make_row(f"{org}/m{i}")) for i in range(8)]
    assert sizes == [DEFAULT] * 8
    assert len(api_requests(hub, org, 5 * 4)) == 5 * 4
    assert sizer.stats == SizeStats(failed=5, default=3)
    assert any("in a row" in r.getMessage() for r in caplog.records)


def test_rate_limit(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path) -> None:
    """N lookups at r per second wait (N-1)/r in all: the first goes at once."""
    n, rate = 6, 2.0
    for i in range(n):
        add_repo(hub, tmp_path, f"{org}/m{i}", {"model.safetensors": 10 + i})
    sizer = make_sizer(hub, fake_time, rate_per_s=rate)
    assert [sizer.size(make_row(f"{org}/m{i}")) for i in range(n)] == [10 + i for i in range(n)]
    assert sum(fake_time.sleeps) == pytest.approx((n - 1) / rate)
    assert len(api_requests(hub, org, n)) == n


def test_rate_limiter_is_thread_safe() -> None:
    """The hub client's bucket (one token, no burst): threads that acquire at the same instant
    each get their own slot: with a clock that stands still, the waits are 1/r, 2/r, ...
    exactly once each, whatever the interleaving."""
    fake = FakeTime()
    limiter = TokenBucket(4.0, burst=1.0, clock=lambda: 0.0, sleep=fake.sleep)
    threads = [threading.Thread(target=limiter.acquire) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fake.sleeps) == [i / 4.0 for i in range(1, 16)]


def test_lookup_limit(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path,
                      caplog: pytest.LogCaptureFixture) -> None:
    """Past lookup_limit lookups the rest get the default, without asking; the log says so
    once and says to add a size_bytes column, and log_stats counts them."""
    for i in range(5):
        add_repo(hub, tmp_path, f"{org}/m{i}", {"model.safetensors": 10 + i})
    sizer = make_sizer(hub, fake_time, lookup_limit=2)
    with caplog.at_level(logging.INFO, logger="controller.weights.sizing"):
        sizes = [sizer.size(make_row(f"{org}/m{i}")) for i in range(5)]
        sizer.log_stats()
    assert sizes == [10, 11, DEFAULT, DEFAULT, DEFAULT]
    assert len(api_requests(hub, org, 2)) == 2
    assert sizer.stats == SizeStats(hub=2, default=3)
    limit_lines = [r for r in caplog.records if "limit" in r.getMessage()]
    assert len(limit_lines) == 1 and SIZE_COLUMN in limit_lines[0].getMessage()
    assert "3 the default" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_offline_makes_no_lookups(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    if how == "argument":
        sizer = make_sizer(hub, fake_time, offline=True)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        sizer = make_sizer(hub, fake_time, offline=None)
    assert sizer.size(make_row(f"{org}/model")) == DEFAULT
    assert sizer.stats == SizeStats(default=1)
    assert len(api_requests(hub, org)) == 0


def test_endpoint_from_the_environment(hub: HubServer, org: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    add_repo(hub, tmp_path, f"{org}/model", {"model.safetensors": 100})
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")
    assert Sizer(offline=False).size(make_row(f"{org}/model")) == 100


def test_memoised_per_ref(hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path) -> None:
    """An adapter's base asked twice costs one call, and so does a failure; another revision
    of the same repo is another model."""
    add_repo(hub, tmp_path, f"{org}/base", {"model.safetensors": 100})
    add_repo(hub, tmp_path, f"{org}/base", {"model.safetensors": 200}, revision="v2")
    sizer = make_sizer(hub, fake_time)
    for _ in range(3):
        assert sizer.size(make_row(f"{org}/base")) == 100
        assert sizer.size(make_row(f"{org}/base@v2")) == 200
        assert sizer.size(make_row(f"{org}/missing")) == DEFAULT
    assert sorted(c.path for c in api_requests(hub, org, 3)) == [
        f"/api/models/{org}/base/revision/main", f"/api/models/{org}/base/revision/v2",
        f"/api/models/{org}/missing/revision/main"]
    assert sizer.stats == SizeStats(hub=6, failed=3)


# --- an adapter's base ------------------------------------------------------------------------


def test_an_adapters_base_is_sized_once_per_distinct_base(
        hub: HubServer, org: str, fake_time: FakeTime, tmp_path: Path) -> None:
    """The shard plan sizes a LoRA with its base (both are on disk while it is analysed):
    the base is sized as a model of its own, from one hub lookup per distinct base however
    many adapters name it (a revision is a base of its own); a local base from its files;
    a base that is no model reference is 0 (the worker reports it)."""
    add_repo(hub, tmp_path, f"{org}/base", {"model.safetensors": 5000})
    add_repo(hub, tmp_path, f"{org}/base", {"model.safetensors": 6000}, revision="v2")
    local = make_dir(tmp_path / "local-base", {"model.safetensors": 300})
    sizer = make_sizer(hub, fake_time)
    sources = [f"{org}/base"] * 50 + [f"{org}/base@v2"] * 50 + [str(local), "bad\nref"]
    assert [sizer.base_size(s) for s in sources] == [5000] * 50 + [6000] * 50 + [300, 0]
    assert len(api_requests(hub, org, 2)) == 2
