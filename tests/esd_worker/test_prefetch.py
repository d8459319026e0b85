"""Downloads while analysing: the real `esd-worker --models` against the local hub double
(tests/support/hubserver.py) through the real huggingface_hub client. Asserted from what
reached the hub (its request log, with arrival times) and what is left on disk: the next
model is fetched while the current one is analysed, within the budget; a base is downloaded
once for its adapter; the worker's own cache is emptied as models finish, a user's is not."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from esd_worker.fetch.cachedir import CacheDir
from tests.support import REPO_ROOT
from tests.support.builders import make_llama, make_lora_adapter, worker_command
from tests.support.hubserver import HubServer

MODELS = [f"esd-test/model-{i}" for i in range(3)]
BASE, ADAPTER = "esd-test/base", "esd-test/base-lora"


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Square 768² layers in bf16: about a second of analysis for 14 MB, so a read-ahead has
    time to show whatever the machine's load."""
    return make_llama(tmp_path_factory.mktemp("wide") / "llama", hidden_size=768,
                      intermediate_size=768, num_layers=2, dtype=torch.bfloat16)


@pytest.fixture
def hub(llama_dir: Path, wide_llama: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    adapter = make_lora_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "adapter",
                                target_modules=("q_proj",), base_model_name_or_path=BASE)
    with HubServer() as server:
        for repo in MODELS:
            server.add_repo(repo, wide_llama)
        server.add_repo(BASE, llama_dir)
        server.add_repo(ADAPTER, adapter)
        yield server


def weights_size(llama_dir: Path) -> int:
    return sum(f.stat().st_size for f in llama_dir.glob("*.safetensors"))


def run(hub: HubServer, home: Path, out: Path, rows: list[str], *extra: str
        ) -> list[tuple[float, dict[str, Any]]]:
    """The worker over `rows`; its stdout events, each with the time it was read."""
    listed = out.parent / f"{out.name}.csv"
    listed.write_text("model_id,base_model_relation,source_model\n" + "\n".join(rows) + "\n")
    env = hub.env(home) | {"PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([*worker_command(), "--models", str(listed), "--output", str(out),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    got: list[tuple[float, dict[str, Any]]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        got.append((time.monotonic(), json.loads(line)))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return got


def result_time(events: list[tuple[float, dict[str, Any]]], repo: str) -> float:
    key_part = repo.replace("/", "--")
    return next(t for t, e in events if e["event"] == "result" and key_part in e["key"])


def first_body(hub: HubServer, repo: str) -> float:
    return min(r.started for r in hub.calls("GET", kind="cdn") if r.repo == repo)


@pytest.mark.parametrize(("extra", "overlaps"), [
    pytest.param((), True, id="prefetch-1"),
    pytest.param(("--prefetch", "0"), False, id="prefetch-0"),
    pytest.param(("--cache-budget", "1"), False, id="budget-too-small"),
])
def test_the_next_model_downloads_while_one_is_analysed(
    hub: HubServer, wide_llama: Path, tmp_path: Path, extra: tuple[str, ...], overlaps: bool
) -> None:
    """Throttled so each download takes ~0.5 s: with prefetch, model i+1's weights are being
    fetched before model i's result; without (or with no room in the budget), only after."""
    hub.throttle_bytes_per_s = weights_size(wide_llama) / 0.5
    events = run(hub, tmp_path / "hf", tmp_path / "out", MODELS, *extra)
    assert [e["status"] for _, e in events if e["event"] == "result"] == ["done"] * 3
    for before, after in itertools.pairwise(MODELS):
        assert (first_body(hub, after) < result_time(events, before)) is overlaps
    for repo in MODELS:  # each model's weights fetched once
        assert len([r for r in hub.calls("GET", kind="cdn") if r.repo == repo]) == 1


def test_the_workers_own_cache_is_emptied_and_a_base_is_fetched_once(
    hub: HubServer, tmp_path: Path
) -> None:
    """Listed adapter-first: the worker moves the adapter right after its base, downloads
    the base once for both, and with --cache-dir deletes each repo once no later model
    needs it; the user's HF cache (HF_HOME) gets nothing."""
    cache = tmp_path / "worker-cache"
    rows = [f"{ADAPTER},adapter,{BASE}", MODELS[0], f"{BASE},base,"]
    events = run(hub, tmp_path / "hf", tmp_path / "out", rows, "--cache-dir", str(cache))
    order = [e["key"] for _, e in events if e["event"] == "result"]
    assert [k.split("--")[1].rsplit("-", 1)[0] for k in order] == [
        "model-0", "base", "base-lora"]
    assert len([r for r in hub.calls("GET", kind="cdn") if r.repo == BASE]) == 1
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("models--")) == []
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_the_users_hf_cache_is_never_evicted(hub: HubServer, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    run(hub, home, tmp_path / "out", MODELS[:2])
    kept = sorted(p.name for p in (home / "hub").iterdir() if p.name.startswith("models--"))
    assert kept == ["models--esd-test--model-0", "models--esd-test--model-1"]
    hub.clear_log()
    again = run(hub, home, tmp_path / "out2", MODELS[:2])  # another output: analysed again
    assert [e["status"] for _, e in again if e["event"] == "result"] == ["done", "done"]
    assert hub.calls("GET", kind="cdn") == []  # from the cache, no download


def repo_files(folder: Path) -> dict[str, bytes]:
    """Every file under a repo folder (snapshot links followed) and its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_cache_dir_holding_the_users_repos_keeps_them(hub: HubServer, tmp_path: Path) -> None:
    """--cache-dir pointed at the user's own HF cache (model-0 downloaded there before, and a
    repo of theirs the sweep never names): model-0 is read from it and left whole; only
    model-1, which the worker downloaded, is evicted."""
    home = tmp_path / "hf"
    run(hub, home, tmp_path / "first", MODELS[:1])  # the user's earlier download
    cache = home / "hub"
    theirs = cache / "models--user--their-own" / "notes.txt"
    theirs.parent.mkdir()
    theirs.write_text("not the sweep's")
    before = repo_files(cache / "models--esd-test--model-0")
    assert any(name.endswith(".safetensors") for name in before)
    hub.clear_log()
    events = run(hub, tmp_path / "other-home", tmp_path / "out", MODELS[:2],
                 "--cache-dir", str(cache))
    assert [e["status"] for _, e in events if e["event"] == "result"] == ["done", "done"]
    assert [r.repo for r in hub.calls("GET", kind="cdn")] == [MODELS[1]]
    assert repo_files(cache / "models--esd-test--model-0") == before
    assert theirs.read_text() == "not the sweep's"
    assert not (cache / "models--esd-test--model-1").exists()


def test_a_repo_another_worker_holds_is_not_evicted_under_it(
    hub: HubServer, tmp_path: Path
) -> None:
    """Two workers share --cache-dir (the sweep's --cpu-workers, or one per GPU). This test
    process is the other worker: it holds model-0, as a worker does that has it queued and
    fetched ahead. The real worker analyses model-0 and leaves it; the other lets go last
    and evicts it."""
    cache = tmp_path / "shared-cache"
    other = CacheDir(cache)
    hold = other.hold(MODELS[0])
    events = run(hub, tmp_path / "hf", tmp_path / "out", MODELS[:1], "--cache-dir", str(cache))
    assert [e["status"] for _, e in events if e["event"] == "result"] == ["done"]
    folder = cache / "models--esd-test--model-0"
    assert any(name.endswith(".safetensors") for name in repo_files(folder))
    assert other.release(hold, evict=True) is True
    assert not folder.exists()
