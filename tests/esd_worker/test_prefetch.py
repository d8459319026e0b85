"""Downloads while analysing: the real `esd-worker --models` against the local hub double
(tests/support/hubserver.py) through the real huggingface_hub client. Asserted from what
reached the hub (its request log, with arrival times) and what is left on disk: the next
model is fetched while the current one is analysed, within the budget; a base is downloaded
once for its adapter; the worker's own cache is emptied as models finish, a user's is not;
--cache-budget is a hard bound (a model that does not fit with its base fails before a byte of
it is downloaded, and the read-ahead never pushes what is held past it)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from esd_worker.core.protocol import MODEL_END
from esd_worker.fetch.cachedir import CacheDir
from esd_worker.fetch.resolve import model_files
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


@pytest.fixture(scope="module")
def adapter_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "adapter",
                             target_modules=("q_proj",), base_model_name_or_path=BASE)


@pytest.fixture
def hub(llama_dir: Path, wide_llama: Path, adapter_dir: Path) -> Iterator[HubServer]:
    adapter = adapter_dir
    with HubServer() as server:
        for repo in MODELS:
            server.add_repo(repo, wide_llama)
        server.add_repo(BASE, llama_dir)
        server.add_repo(ADAPTER, adapter)
        yield server


def weights_size(llama_dir: Path) -> int:
    return sum(f.stat().st_size for f in llama_dir.glob("*.safetensors"))


def fetched_bytes(folder: Path) -> int:
    """What the worker sizes a repo of this folder's files at (the same choice of files)."""
    return model_files(str(folder)).total_bytes


def run(hub: HubServer, home: Path, out: Path, rows: list[str], *extra: str, code: int = 0,
        stderr: list[str] | None = None) -> list[tuple[float, dict[str, Any]]]:
    """The worker over `rows`; its stdout events, each with the time it was read (its
    stderr lines onto `stderr`)."""
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
    assert proc.returncode == code, err
    if stderr is not None:
        stderr.extend(err.splitlines())
    return got


def result_time(events: list[tuple[float, dict[str, Any]]], repo: str) -> float:
    key_part = repo.replace("/", "--")
    return next(t for t, e in events if e["event"] == "result" and key_part in e["key"])


def first_body(hub: HubServer, repo: str) -> float:
    return min(r.started for r in hub.calls("GET", kind="cdn") if r.repo == repo)


@pytest.mark.parametrize(("extra", "overlaps"), [
    pytest.param((), True, id="prefetch-1"),
    pytest.param(("--prefetch", "0"), False, id="prefetch-0"),
    pytest.param(("--cache-budget", "1.5 models"), False, id="budget-for-one"),
])
def test_the_next_model_downloads_while_one_is_analysed(
    hub: HubServer, wide_llama: Path, tmp_path: Path, extra: tuple[str, ...], overlaps: bool
) -> None:
    """Throttled so each download takes ~0.5 s: with prefetch, model i+1's weights are being
    fetched before model i's result; without (or with no room in the budget), only after."""
    hub.throttle_bytes_per_s = weights_size(wide_llama) / 0.5
    if extra[1:] == ("1.5 models",):
        extra = ("--cache-budget", str(fetched_bytes(wide_llama) * 3 // 2))
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



# The real Prefetcher in a process of its own (huggingface_hub reads HF_ENDPOINT at import):
# the read-ahead thread is sizing the queued model (the hub holds that request) when the main
# thread takes it, fetches it, is done with it and closes.
_RACE = """
import sys
from pathlib import Path
from esd_worker.core.protocol import Request
from esd_worker.serve.inbox import Inbox
from esd_worker.serve.prefetch import Prefetcher

request = Request(key="k", model=sys.argv[2])
inbox = Inbox([request], closed=True)
prefetcher = Prefetcher(inbox, depth=1, cache_dir=Path(sys.argv[1]), own_cache=True)
sys.stdin.readline()  # the read-ahead is sizing it now
assert inbox.take() is request
prefetcher.resolve(request.model)
prefetcher.finished(request)
prefetcher.close()
"""


def test_a_model_taken_while_the_read_ahead_sizes_it_is_fetched_once_and_evicted(
    hub: HubServer, tmp_path: Path
) -> None:
    """The read-ahead's sizing call is slow; meanwhile the model's turn comes and the main
    thread fetches, finishes and evicts it. The read-ahead then leaves it be: no second
    download, no second lock on the repo, nothing left in the workers' folder."""
    cache = tmp_path / "cache"
    slow = hub.delay(MODELS[0], 2.0, on="api")
    env = hub.env(tmp_path / "hf") | {"PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _RACE, str(cache), MODELS[0]], env=env,
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while slow.times and time.monotonic() < deadline:  # its request reached the hub
        time.sleep(0.02)
    assert slow.times == 0, "the read-ahead never sized the model"
    _, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err
    assert len([r for r in hub.calls("GET", kind="cdn") if r.repo == MODELS[0]]) == 1
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("models--")) == []
    assert list((cache / ".esd-sweep" / "owned").iterdir()) == []

# -- the budget is a hard bound ------------------------------------------------------------


def results(events: list[tuple[float, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {e["key"].split("--")[1].rsplit("-", 1)[0]: e for _, e in events
            if e["event"] == "result"}


def cdn_repos(hub: HubServer) -> set[str | None]:
    return {r.repo for r in hub.calls("GET", kind="cdn")}


def test_a_model_beyond_the_budget_fails_before_a_byte_is_downloaded(
    hub: HubServer, llama_dir: Path, wide_llama: Path, tmp_path: Path
) -> None:
    """Budget room for the small base, not for model-0 (14 MB): model-0 fails at once,
    permanently (exit 3), its error naming its size, the budget and the flag; none of its
    weights reach the worker, read ahead or not; the base is analysed."""
    budget = fetched_bytes(llama_dir) + 1
    assert fetched_bytes(wide_llama) > budget
    events = run(hub, tmp_path / "hf", tmp_path / "out", [BASE, MODELS[0]],
                 "--cache-budget", str(budget), code=3)
    got = results(events)
    assert got["base"]["status"] == "done"
    failed = got["model-0"]
    assert (failed["status"], failed["exit_code"], failed["retryable"]) == ("failed", 3, False)
    assert "--cache-budget" in failed["error"] and "not downloaded" in failed["error"]
    assert f"{fetched_bytes(wide_llama) / 2**20:.1f} MiB" in failed["error"], failed["error"]
    assert MODELS[0] not in cdn_repos(hub)


def test_an_adapter_and_its_base_must_fit_together(
    hub: HubServer, llama_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    """Each fits the budget alone, not both, and both are on disk while the adapter is
    analysed: the adapter fails naming their bytes together; the base is not downloaded."""
    budget = fetched_bytes(llama_dir) + fetched_bytes(adapter_dir) - 1
    assert budget >= max(fetched_bytes(llama_dir), fetched_bytes(adapter_dir))
    events = run(hub, tmp_path / "hf", tmp_path / "out", [f"{ADAPTER},adapter,{BASE}"],
                 "--cache-budget", str(budget), code=3)
    failed = results(events)["base-lora"]
    assert (failed["status"], failed["exit_code"]) == ("failed", 3)
    assert "with its adapter" in failed["error"] and "--cache-budget" in failed["error"]
    assert BASE not in cdn_repos(hub)


def test_the_read_ahead_waits_for_the_current_adapters_base(
    hub: HubServer, llama_dir: Path, wide_llama: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    """An adapter listed without its base (its adapter_config.json names it), after model-1:
    room for model-1 and the adapter (fetched ahead), not for the base as well. Once the
    adapter is the model in progress, model-0 would fit beside it, but not beside it and its
    base: it is not fetched ahead while the base is not known (that would push what is held
    past the budget once the base comes), so its download starts after the adapter's
    result. Read from the worker's log: the line that starts model-0's download comes
    after the line that ends the adapter's log (the prefetcher is told a model finished
    after it)."""
    budget = fetched_bytes(adapter_dir) + fetched_bytes(wide_llama) + 1
    assert budget < sum(map(fetched_bytes, (adapter_dir, wide_llama, llama_dir)))
    log: list[str] = []
    events = run(hub, tmp_path / "hf", tmp_path / "out", [MODELS[1], ADAPTER, MODELS[0]],
                 "--cache-budget", str(budget), stderr=log)
    assert [e["status"] for e in results(events).values()] == ["done"] * 3
    adapter_key = results(events)["base-lora"]["key"]
    beats = [e["bytes"] for _, e in events if e["event"] == "progress" and e["key"] == adapter_key]
    assert max(beats) == fetched_bytes(adapter_dir) + fetched_bytes(llama_dir)  # on disk together
    adapter_end = next(i for i, line in enumerate(log)
                       if line.startswith(MODEL_END) and adapter_key in line)
    downloaded = next(i for i, line in enumerate(log)
                      if f"model={MODELS[0]} revision=" in line and "downloading" in line)
    assert downloaded > adapter_end, "\n".join(log)


def test_in_a_shard_the_error_names_the_class(hub: HubServer, tmp_path: Path) -> None:
    """A shard folder's last part is its resource class: the class whose disk budget the
    model does not fit (the controller's sizing put it there). The shard is complete (a
    permanent failure is an outcome): exit 0."""
    folder = tmp_path / "_shards" / "run-k" / "gpu-small"
    folder.mkdir(parents=True)
    (folder / "0.csv").write_text(f"model_id\n{MODELS[0]}\n")
    env = hub.env(tmp_path / "hf") | {"PYTHONPATH": str(REPO_ROOT)}
    run_ = subprocess.run([*worker_command(), "--shards", str(folder), "--shard-index", "0",
                           "--output", str(tmp_path / "out"), "--run-id", "run-k",
                           "--cache-budget", "1000"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert run_.returncode == 0, run_.stderr
    result = [json.loads(line) for line in run_.stdout.splitlines()][-1]
    assert result["status"] == "failed", result
    assert "resource class gpu-small" in result["error"] and "--cache-budget" in result["error"]
    assert MODELS[0] not in cdn_repos(hub)
