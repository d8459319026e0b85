"""Model references: HF ids resolved through huggingface_hub from a local cache with
HF_HUB_OFFLINE=1 (no network), local paths, and hub errors mapped to exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from esd_worker.errors import PermanentModelError, TransientError
from esd_worker.naming import model_key
from esd_worker.resolve import classify_hub_error, parse_model_ref, resolve_model
from tests.builders import fake_commit, make_hf_cache, make_llama, make_lora_adapter

REPO = "esd-test/tiny-llama"
ADAPTER_REPO = "esd-test/tiny-llama-lora"
_HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT",
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")


@dataclass(frozen=True)
class Run:
    code: int
    stderr: str
    output: Path

    def marker(self, key: str) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.output / key / "result.json").read_text())
        return data


@dataclass(frozen=True)
class HubRuns:
    commit: str
    adapter_commit: str
    runs: Mapping[str, Run]


@pytest.fixture(scope="module")
def hub(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> HubRuns:
    """An HF cache (HF_HOME/hub) holding a model and a LoRA adapter whose adapter_config
    names the model by hub id; four worker runs against it, offline, side by side."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hf" / "hub"
    commit = make_hf_cache(cache, REPO, llama_dir)
    adapter = make_lora_adapter(
        llama_dir, root / "adapter", target_modules=("q_proj",), base_model_name_or_path=REPO
    )
    adapter_commit = make_hf_cache(cache, ADAPTER_REPO, adapter, commit=fake_commit("lora"))
    env = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    env |= {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    refs = {
        "id": REPO,
        "id@sha": f"{REPO}@{commit}",
        "missing": "esd-test/not-in-cache",
        "adapter": ADAPTER_REPO,
    }
    procs = {}
    for name, ref in refs.items():
        out = root / f"out-{name}"
        procs[name] = (out, subprocess.Popen(
            [sys.executable, "-m", "esd_worker.cli", "--model", ref, "--output", str(out),
             "--device", "cpu"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    runs = {}
    for name, (out, proc) in procs.items():
        _, err = proc.communicate(timeout=300)
        runs[name] = Run(proc.returncode, err, out)
    return HubRuns(commit, adapter_commit, runs)


def test_hub_id_from_offline_cache(hub: HubRuns) -> None:
    """`--model org/name`: refs/main gives the commit, recorded as resolved_revision."""
    run = hub.runs["id"]
    assert run.code == 0, run.stderr
    marker = run.marker(model_key(REPO))
    assert marker["source"] == "hub"
    assert (marker["model_id"], marker["revision"]) == (REPO, None)
    assert marker["resolved_revision"] == hub.commit
    assert marker["layer_count"] == 15
    rows = (run.output / model_key(REPO) / "layers.csv").read_text().splitlines()
    assert all(line.split(",")[1] == hub.commit for line in rows[1:])  # revision column


def test_hub_id_at_commit(hub: HubRuns) -> None:
    """`--model org/name@<sha>`: the snapshot of that commit; the key includes the revision."""
    run = hub.runs["id@sha"]
    assert run.code == 0, run.stderr
    marker = run.marker(model_key(REPO, hub.commit))
    assert (marker["model_id"], marker["revision"]) == (REPO, hub.commit)
    assert marker["resolved_revision"] == hub.commit
    assert str(marker["model_key"]).startswith(f"esd-test--tiny-llama--{hub.commit[:12]}-")


def test_missing_id_offline(hub: HubRuns) -> None:
    run = hub.runs["missing"]
    assert run.code == 3
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("esd-worker: error: esd-test/not-in-cache is not in the HF cache")
    assert "HF_HUB_OFFLINE=1" in last
    assert not run.output.exists() or not any(run.output.rglob("result.json"))


def test_adapter_base_by_hub_id(hub: HubRuns) -> None:
    """An adapter from the cache whose adapter_config names its base by hub id: the base is
    resolved the same way and recorded with its commit."""
    run = hub.runs["adapter"]
    assert run.code == 0, run.stderr
    marker = run.marker(model_key(ADAPTER_REPO))
    assert marker["resolved_revision"] == hub.adapter_commit
    assert marker["base_model"] == {
        "model": REPO, "resolved_revision": hub.commit, "source": "hub"
    }


# --- references that never reach the hub ---------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    ["/no/such/dir", "./no-such-dir", "../no/such", "~/no-such-esd-dir", "a/b/c",
     "weights.safetensors", "C:\\models\\x"],
)
def test_paths_that_do_not_exist(ref: str) -> None:
    """Anything that can only be a path fails as not found, without asking the hub."""
    with pytest.raises(PermanentModelError, match="model not found"):
        resolve_model(ref)


@pytest.mark.parametrize("ref", ["org/na me", "-org/name", "org/name/"])
def test_malformed_ids(ref: str) -> None:
    with pytest.raises(PermanentModelError, match="model not found"):
        resolve_model(ref)


def test_local_directory(llama_dir: Path, tmp_path: Path) -> None:
    """A directory is its own id, even with an '@' in its name, and has no revision."""
    at = tmp_path / "model@v2"
    at.symlink_to(llama_dir, target_is_directory=True)
    resolved = resolve_model(str(at))
    assert (resolved.model_id, resolved.revision, resolved.resolved_revision) == (
        str(at), None, None
    )
    assert resolved.source == "local" and not resolved.is_adapter
    assert parse_model_ref(str(at)) == (str(at), None)
    assert parse_model_ref("org/name@abc") == ("org/name", "abc")


def _http_error(cls: type[Exception], status: int) -> Exception:
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("GET", "https://hub.invalid/x"))
    return cls(f"HTTP {status}", response=response)  # type: ignore[call-arg]


def _hub_error(name: str) -> Exception:
    from huggingface_hub import errors

    table: dict[str, Exception] = {
        "gated": _http_error(errors.GatedRepoError, 403),
        "repo": _http_error(errors.RepositoryNotFoundError, 404),
        "revision": _http_error(errors.RevisionNotFoundError, 404),
        "401": _http_error(errors.HfHubHTTPError, 401),
        "500": _http_error(errors.HfHubHTTPError, 500),
        "local-entry": errors.LocalEntryNotFoundError("no\ncache"),
        "connection": ConnectionError("reset by peer"),
        "timeout": TimeoutError("timed out"),
        "validation": errors.HFValidationError("Repo id must be in the form 'name'"),
    }
    return table[name]


@pytest.mark.parametrize(
    ("name", "kind", "fragment"),
    [
        ("gated", PermanentModelError, "is gated"),
        ("repo", PermanentModelError, "model not found"),
        ("revision", PermanentModelError, "revision not found"),
        ("401", PermanentModelError, "set HF_TOKEN"),
        ("500", TransientError, "retry later"),
        ("local-entry", TransientError, "not (fully) cached"),
        ("connection", TransientError, "network error"),
        ("timeout", TransientError, "network error"),
        ("validation", PermanentModelError, "invalid model id"),
    ],
)
def test_hub_errors_map_to_exit_codes(name: str, kind: type[Exception], fragment: str) -> None:
    """Never retry 401/403/404 (permanent, exit 3); network trouble and 5xx are transient."""
    error = classify_hub_error(_hub_error(name), "org/name", None)
    assert type(error) is kind
    assert fragment in str(error)
    assert "\n" not in str(error)
