"""The worker's hub adapter (esd_worker.fetch.resolve / esd_worker.fetch.hub) against a local hub
double
(tests.support.hubserver) through the real huggingface_hub client.

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import (and CI exports
HF_HUB_OFFLINE=1), so the worker code that talks to the hub runs in a fresh interpreter with
the double's environment (`_client`). Asserted: what the worker returns or raises, and what
reached the hub (the double's request log): call counts, retries, waits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.errors import PermanentModelError, TransientError
from esd_worker.fetch.hub import RetryPolicy, classify_hub_error, repo_cache_dir
from tests.support import REPO_ROOT
from tests.support.hubserver import HubServer

REPO = "esd-test/tiny-llama"
FAST = {"attempts": 4, "backoff_s": 0.05}  # our retries, without the waits of production

# Runs in the child: argv[1] is a JSON job, stdout one JSON line of what happened.
_CLIENT = r"""
import json, os, sys, time
from pathlib import Path
from esd_worker.core.errors import WorkerError
from esd_worker.core.hubretry import RetryPolicy
from esd_worker.fetch.resolve import model_files, resolve_model

job = json.loads(sys.argv[1])
retry = RetryPolicy(**job["retry"]) if job.get("retry") else None
cache = Path(job["cache_dir"]) if job.get("cache_dir") else None
out, files = {"resolved": []}, None
for link, target in job.get("plant", []):  # "{pid}": a name guessed from this process's id
    link = Path(link.format(pid=os.getpid()))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
start = time.monotonic()
try:
    for step in job["steps"]:
        if step == "files":
            files = model_files(job["ref"], cache_dir=cache, retry=retry)
            out["files"] = {"sha": files.sha, "files": files.files, "total": files.total_bytes}
        else:
            given = files if step == "resolve-with-files" else None
            r = resolve_model(job["ref"], cache_dir=cache, retry=retry, files=given)
            out["resolved"].append({"dir": str(r.directory), "sha": r.resolved_revision})
except WorkerError as e:
    out["error"] = [type(e).__name__, str(e)]
out["elapsed"] = time.monotonic() - start
print(json.dumps(out))
"""


@pytest.fixture
def hub(llama_dir: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo(REPO, llama_dir)
        yield server


def _client(hub: HubServer, home: Path, ref: str = REPO, steps: tuple[str, ...] = ("resolve",),
            *, retry: dict[str, Any] | None = None, cache_dir: Path | None = None,
            offline: bool = False, plant: tuple[tuple[str, Path], ...] = ()) -> dict[str, Any]:
    """plant: symlinks (name, target) made in the child before it starts; "{pid}" in a
    name is the child's process id."""
    job = {"ref": ref, "steps": list(steps), "retry": retry or FAST,
           "cache_dir": str(cache_dir) if cache_dir else None,
           "plant": [(name, str(target)) for name, target in plant]}
    env = hub.env(home) | {"PYTHONPATH": str(REPO_ROOT)}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps(job)], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


def _served(directory: Path, *names: str) -> list[list[Any]]:
    return [[n, (directory / n).stat().st_size] for n in names]


def test_size_then_download_costs_one_api_call(hub: HubServer, llama_dir: Path,
                                               tmp_path: Path) -> None:
    """model_files sizes exactly the files the download fetches (configs and weights, not
    generation_config.json), and the download reuses its model-info answer. A second
    resolve asks for the commit again but downloads nothing."""
    out = _client(hub, tmp_path, steps=("files", "resolve-with-files", "resolve"))
    assert "error" not in out, out
    expected = _served(llama_dir, "config.json", "model.safetensors")
    assert out["files"]["files"] == expected
    assert out["files"]["total"] == sum(size for _, size in expected)
    sha = out["files"]["sha"]
    snapshot = tmp_path / "hub" / "models--esd-test--tiny-llama" / "snapshots" / sha
    assert [r["dir"] for r in out["resolved"]] == [str(snapshot)] * 2
    assert {p.name for p in snapshot.iterdir()} == {"config.json", "model.safetensors"}
    assert (snapshot / "model.safetensors").read_bytes() == (
        llama_dir / "model.safetensors").read_bytes()
    assert len(hub.calls("GET", kind="api")) == 2  # model_files, then the second resolve
    # The LFS weights come from the CDN (after a 302), the config from /resolve.
    assert [r.file for r in hub.calls("GET", kind="cdn")] == ["model.safetensors"]
    assert len(hub.calls("GET", file="config.json")) == 1
    assert len(hub.calls("GET", file="model.safetensors")) == 1
    assert len(hub.calls("HEAD")) == 2


@pytest.mark.parametrize("pin", ["main", "v2", "sha"])
def test_pinned_revision(hub: HubServer, llama_dir: Path, tmp_path: Path, pin: str) -> None:
    """org/name@branch and org/name@<commit> fetch that commit; a branch is recorded in
    refs/ so that an offline run finds the snapshot."""
    main = hub.add_repo(REPO, llama_dir)  # the same sha again: stable
    v2 = hub.add_repo(REPO, llama_dir, revision="v2")
    assert main != v2
    revision = main if pin == "sha" else pin
    want = v2 if pin == "v2" else main
    out = _client(hub, tmp_path, f"{REPO}@{revision}")
    assert out["resolved"] == [{"dir": str(tmp_path / "hub" / "models--esd-test--tiny-llama"
                                           / "snapshots" / want), "sha": want}]
    refs = tmp_path / "hub" / "models--esd-test--tiny-llama" / "refs"
    if pin == "sha":
        assert not (refs / main).exists()  # a commit is no ref
    else:
        assert (refs / pin).read_text() == want
    api = hub.calls(kind="api")
    assert len(api) == 1 and api[0].path.endswith(f"/revision/{revision}")


def test_a_ref_is_never_written_through_a_planted_link(hub: HubServer, llama_dir: Path,
                                                      tmp_path: Path) -> None:
    """A --cache-dir others may write (one cache for a team's workers): symlinks planted at
    the ref's temporary name (before: `.<ref>.<pid>.tmp`, the pid guessable, written
    through, so the file it named got the commit) and at the ref itself leave the files they
    name as they were; refs/v2 is a regular file holding the commit."""
    v2 = hub.add_repo(REPO, llama_dir, revision="v2")
    cache = tmp_path / "cache"
    refs = cache / "models--esd-test--tiny-llama" / "refs"
    victims = [tmp_path / "victim-tmp.txt", tmp_path / "victim-ref.txt"]
    for victim in victims:
        victim.write_bytes(b"the victim's own file\n")
    out = _client(hub, tmp_path / "home", f"{REPO}@v2", cache_dir=cache,
                  plant=((str(refs / ".v2.{pid}.tmp"), victims[0]), (str(refs / "v2"), victims[1])))
    assert out["resolved"] == [{"dir": str(refs.parent / "snapshots" / v2), "sha": v2}]
    assert [victim.read_bytes() for victim in victims] == [b"the victim's own file\n"] * 2
    assert not (refs / "v2").is_symlink() and (refs / "v2").read_text() == v2


@pytest.mark.parametrize(
    ("ref", "fault", "fragment", "failed"),
    [
        pytest.param(REPO, {"status": 401, "on": "api"}, "access denied (401)", "api", id="401"),
        pytest.param(REPO, {"status": 403, "on": "model.safetensors"}, "is gated",
                     "model.safetensors", id="403-gated"),
        pytest.param(REPO, {"status": 403, "on": "config.json", "error_code": ""},
                     "access denied (403)", "config.json", id="403-plain"),
        pytest.param("esd-test/missing", None, "model not found: esd-test/missing", "api",
                     id="404-repo"),
        pytest.param(f"{REPO}@nope", None, "revision not found: esd-test/tiny-llama@nope", "api",
                     id="404-revision"),
        pytest.param(REPO, {"status": 404, "on": "config.json"}, "file not found on the hub",
                     "config.json", id="404-file"),
    ],
)
def test_permanent_failures_are_not_retried(hub: HubServer, tmp_path: Path, ref: str,
                                            fault: dict[str, Any] | None, fragment: str,
                                            failed: str) -> None:
    if fault is not None:
        hub.fail(REPO, times=None, **fault)
    out = _client(hub, tmp_path, ref)
    assert out["error"][0] == PermanentModelError.__name__
    assert fragment in out["error"][1] and "\n" not in out["error"][1]
    errors = [r for r in hub.requests if r.status >= 400]
    assert len(errors) == 1, errors  # asked once, never again
    assert (errors[0].kind if failed == "api" else errors[0].file) == failed
    if failed == "api":
        assert not hub.calls(kind="file") and not hub.calls(kind="cdn")
    else:
        assert not [r for r in hub.calls("GET") if r.file == failed]


@pytest.mark.parametrize("on", ["api", "model.safetensors"])
def test_429_waits_for_retry_after(hub: HubServer, tmp_path: Path, on: str) -> None:
    """Rate limited twice with Retry-After: 1, then served. The model-info call is retried by
    the worker (waits 1 s twice); a file's HEAD by huggingface_hub itself (tries once without
    waiting, then waits Retry-After + 1 s): either way ≥ 2 s and three requests."""
    hub.fail(REPO, 429, times=2, retry_after=1, on=on)
    out = _client(hub, tmp_path)
    assert "error" not in out, out
    assert out["elapsed"] >= 1.9
    asked = hub.calls(kind="api") if on == "api" else hub.calls("HEAD", file=on)
    assert [r.status for r in asked] == [429, 429, 200 if on == "api" else 302]


def test_503_on_model_info_gives_up_after_the_attempts(hub: HubServer, tmp_path: Path) -> None:
    hub.fail(REPO, 503, times=None, on="api")
    out = _client(hub, tmp_path, retry={"attempts": 3, "backoff_s": 0.1})
    assert out["error"][0] == TransientError.__name__
    assert "HTTP 503" in out["error"][1] and "gave up after 3 attempts" in out["error"][1]
    assert len(hub.calls(kind="api")) == 3
    assert out["elapsed"] >= 0.1 + 0.2  # exponential backoff between the attempts


def test_503_on_a_file_head_is_not_retried_twice(hub: HubServer, tmp_path: Path) -> None:
    """huggingface_hub retries a file's HEAD itself (1 + 6 tries; Retry-After: 0 makes each
    wait 1 s): the worker then gives up at once instead of multiplying those tries."""
    hub.fail(REPO, 503, times=None, retry_after=0, on="config.json", method="HEAD")
    out = _client(hub, tmp_path)
    assert out["error"][0] == TransientError.__name__
    assert "(HTTP 503) and it is not (fully) cached" in out["error"][1]
    assert len(hub.calls("HEAD", file="config.json")) == 7
    assert not hub.calls("GET", file="config.json")


def test_5xx_on_a_file_get_is_retried_by_the_worker(hub: HubServer, tmp_path: Path) -> None:
    """huggingface_hub does not retry a GET answered 5xx: the worker does (HEAD again, GET)."""
    hub.fail(REPO, 502, times=2, on="config.json", method="GET")
    out = _client(hub, tmp_path)
    assert "error" not in out, out
    assert [r.status for r in hub.calls("GET", file="config.json")] == [502, 502, 200]
    assert len(hub.calls("HEAD", file="config.json")) == 3


def test_throttled_download_takes_its_time(hub: HubServer, tmp_path: Path) -> None:
    """200 KB at 100 KB/s: the download takes about 2 s (the double's pacing, end to end)."""
    import numpy as np

    from tests.support.builders import make_tensor_model

    model = make_tensor_model(tmp_path / "big", {"w.weight": np.zeros((250, 200), np.float32)},
                              config={"model_type": "esd-test"})
    hub.add_repo("esd-test/big", model)
    hub.throttle_bytes_per_s = 100_000
    out = _client(hub, tmp_path / "home", "esd-test/big", steps=("files", "resolve-with-files"))
    assert "error" not in out, out
    size = dict(map(tuple, out["files"]["files"]))["model.safetensors"]
    assert 200_000 <= size < 201_000
    assert 1.9 <= out["elapsed"] < 10


def test_cache_dir_then_offline(hub: HubServer, llama_dir: Path, tmp_path: Path) -> None:
    """cache_dir= downloads there (not into HF_HOME); later, offline, the same cache serves
    model_files and resolve_model with no request."""
    cache = tmp_path / "own-cache"
    home = tmp_path / "home"
    out = _client(hub, home, steps=("files", "resolve-with-files"), cache_dir=cache)
    sha = out["files"]["sha"]
    folder = cache / "models--esd-test--tiny-llama"
    assert out["resolved"] == [{"dir": str(folder / "snapshots" / sha), "sha": sha}]
    assert repo_cache_dir(REPO, cache) == folder.resolve()
    assert not (home / "hub").exists() or not any((home / "hub").glob("models--*"))
    asked = len(hub.requests)
    offline = _client(hub, home, steps=("files", "resolve"), cache_dir=cache, offline=True)
    assert offline["files"] == {"sha": sha, "files": _served(llama_dir, "config.json",
                                                             "model.safetensors"),
                                "total": out["files"]["total"]}
    assert offline["resolved"] == out["resolved"]
    assert len(hub.requests) == asked
    shutil.rmtree(repo_cache_dir(REPO, cache))  # what a caller evicting its download does
    gone = _client(hub, home, cache_dir=cache, offline=True)
    assert gone["error"][0] == PermanentModelError.__name__ and "HF_HUB_OFFLINE=1" in gone[
        "error"][1]


# --- in this process: no hub involved -----------------------------------------------------


@pytest.mark.parametrize(("env", "attempts"), [(None, 4), ("0", 1), ("2", 3)])
def test_retries_from_env(monkeypatch: pytest.MonkeyPatch, env: str | None,
                          attempts: int) -> None:
    monkeypatch.delenv("ESD_HUB_RETRIES", raising=False)
    if env is not None:
        monkeypatch.setenv("ESD_HUB_RETRIES", env)
    assert RetryPolicy.from_env().attempts == attempts
    assert RetryPolicy.from_env(attempts=9).attempts == 9


def _http_error(status: int, headers: dict[str, str]) -> Exception:
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://hub.invalid/x")
    response = httpx2.Response(status, headers=headers, request=request)
    return errors.HfHubHTTPError(f"HTTP {status}", response=response)


def test_a_403_behind_a_cache_miss_is_permanent() -> None:
    """hf_hub_download reports a HEAD answered 403 (no X-Error-Code) as a cache miss; the
    hub's answer decides: permanent, not 'unreachable'."""
    from huggingface_hub import errors

    miss = errors.LocalEntryNotFoundError("not cached")
    miss.__cause__ = _http_error(403, {})
    error = classify_hub_error(miss, "org/name", None, offline=False)
    assert type(error) is PermanentModelError and "access denied (403)" in str(error)
    miss.__cause__ = _http_error(503, {})
    assert type(classify_hub_error(miss, "org/name", None, offline=False)) is TransientError


def test_double_serves_ranges_and_logs(llama_dir: Path) -> None:
    """What huggingface_hub sends when it resumes a cut-off download: Range: bytes=N-."""
    import httpx2

    with HubServer() as server, httpx2.Client(trust_env=False) as http:  # no proxy
        sha = server.add_repo(REPO, llama_dir)
        url = f"{server.url}/{REPO}/resolve/{sha}/config.json"
        whole = (llama_dir / "config.json").read_bytes()
        response = http.get(url, headers={"Range": "bytes=10-"})
        assert response.status_code == 206 and response.content == whole[10:]
        assert response.headers["Content-Range"] == f"bytes 10-{len(whole) - 1}/{len(whole)}"
        assert response.headers["X-Repo-Commit"] == sha
        assert http.get(url, headers={"Range": f"bytes={len(whole)}-"}).status_code == 416
    assert [(r.method, r.status, r.file) for r in server.requests] == [
        ("GET", 206, "config.json"), ("GET", 416, "config.json")]


def test_env_for_a_client_drops_tokens_and_offline(tmp_path: Path) -> None:
    with HubServer() as server:
        env = server.env(tmp_path, {"HF_TOKEN": "x", "HF_HUB_OFFLINE": "1", "PATH": os.defpath})
    assert "HF_TOKEN" not in env and env["HF_HUB_OFFLINE"] == "0"
    assert env["HF_ENDPOINT"] == server.url and env["HF_HOME"] == str(tmp_path)
