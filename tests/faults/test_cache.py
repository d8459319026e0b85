"""`esd-sweep run --cache-dir` with two CPU workers sharing the folder, over the hub double
(tests/support/hubserver.py) through the real huggingface_hub client: the user's repos in
that folder are never touched, repos shared by several models are not evicted under a worker
that still needs them, and what the workers downloaded is gone at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from esd_worker.core.models.naming import model_key
from tests.faults.conftest import esd_sweep, run_args
from tests.support.builders import make_lora_adapter
from tests.support.hubserver import HubServer

pytestmark = pytest.mark.slow

BASE = "esd-test/base"
ADAPTERS = [f"esd-test/lora-{i}" for i in range(3)]
OTHERS = [f"esd-test/model-{i}" for i in range(3)]
USERS = "esd-test/model-0"  # the user downloaded it into the folder before the sweep


@pytest.fixture
def hub(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo(BASE, llama_dir)
        server.add_repo(BASE, llama_dir, revision="v2")
        for i, repo in enumerate(ADAPTERS):
            adapter = make_lora_adapter(llama_dir, tmp_path_factory.mktemp("lora") / str(i),
                                        target_modules=("q_proj",), seed=i,
                                        base_model_name_or_path=BASE)
            server.add_repo(repo, adapter)
        for repo in OTHERS:
            server.add_repo(repo, llama_dir)
        yield server


def repo_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_two_workers_share_a_cache_dir_that_holds_the_users_repos(
    hub: HubServer, tmp_path: Path
) -> None:
    """Interleaved rows of one base (two revisions), its adapters and other models, on two
    workers that each fetch one model ahead: whatever the order they finish in, every model
    is done (none fails for want of weights another worker evicted), the user's repos are
    whole, and the folder holds nothing the workers downloaded."""
    cache = tmp_path / "cache"
    users = tmp_path / "user-home"
    first = esd_sweep(*run_args(_list(tmp_path / "first.csv", [USERS]), str(tmp_path / "r0")),
                      env=hub.env(users))
    assert first.returncode == 0, first.stderr
    (users / "hub").rename(cache)  # the user's HF cache, now given as --cache-dir
    theirs = cache / "models--someone--else" / "file.txt"
    theirs.parent.mkdir()
    theirs.write_text("theirs")
    before = repo_files(cache / "models--esd-test--model-0")

    rows = [BASE, ADAPTERS[0], OTHERS[0], f"{BASE}@v2", ADAPTERS[1], OTHERS[1], ADAPTERS[2],
            OTHERS[2]]
    models = _list(tmp_path / "models.csv", rows)
    out = tmp_path / "results"
    done = esd_sweep(*run_args(models, str(out), "--cpu-workers", "2", "--cache-dir",
                               str(cache), "--prefetch", "1"), env=hub.env(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    for ref in rows:
        marker = out / model_key(*ref.split("@")) / "result.json"
        assert json.loads(marker.read_text())["model"] == ref
    assert repo_files(cache / "models--esd-test--model-0") == before
    assert theirs.read_text() == "theirs"
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("models--")) == [
        "models--esd-test--model-0", "models--someone--else"]
    assert not list((tmp_path / "hf").rglob("*.safetensors"))  # nothing in the HF cache


def _list(path: Path, refs: list[str]) -> Path:
    rows = [f"{ref},lora,{BASE}" if ref in ADAPTERS else f"{ref},," for ref in refs]
    path.write_text("model_id,base_model_relation,source_model\n" + "\n".join(rows) + "\n")
    return path
