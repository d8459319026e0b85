"""Model references: HF ids resolved through huggingface_hub from a local cache with
HF_HUB_OFFLINE=1 (no network), local paths, and hub errors mapped to exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.errors import PermanentModelError, TransientError
from esd_worker.core.models.naming import model_key, ref_key
from esd_worker.fetch.hub import classify_hub_error
from esd_worker.fetch.resolve import resolve_model
from tests.support.builders import BackgroundRun, CliResult
from tests.support.hub import HUB_ADAPTER_REPO, HUB_MISSING_REPO, HUB_REPO, HubCache


def marker(run: CliResult, key: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run.output / key / "result.json").read_text())
    return data


@pytest.fixture(scope="module")
def hub(hub_cache: HubCache, worker_runs: dict[str, BackgroundRun]) -> HubCache:
    """conftest.hub_cache: an HF cache (HF_HOME/hub) holding HUB_REPO and HUB_ADAPTER_REPO.

    The worker ran against it offline (HF_HUB_OFFLINE=1) in four subprocesses, started
    with the session's other runs (conftest.worker_runs): `--model HUB_REPO`,
    `HUB_REPO@<commit>`, HUB_MISSING_REPO and HUB_ADAPTER_REPO. huggingface_hub's offline
    snapshot_download needs only refs/<revision> (the commit, no newline) and
    snapshots/<commit>/ with the files (tests.support.builders.make_hf_cache).
    """
    return hub_cache


def test_hub_id_from_offline_cache(hub: HubCache, worker_runs: dict[str, BackgroundRun]) -> None:
    """`--model org/name`: refs/main gives the commit, recorded as resolved_revision."""
    run = worker_runs["hub-id"].result()
    assert run.code == 0, run.stderr
    result = marker(run, model_key(HUB_REPO))
    assert result["source"] == "hub"
    assert (result["model_id"], result["revision"]) == (HUB_REPO, None)
    assert result["resolved_revision"] == hub.commit
    assert result["layer_count"] == 15
    rows = (run.output / model_key(HUB_REPO) / "layers.csv").read_text().splitlines()
    assert all(line.split(",")[1] == hub.commit for line in rows[1:])  # revision column


def test_hub_id_at_commit(hub: HubCache, worker_runs: dict[str, BackgroundRun]) -> None:
    """`--model org/name@<sha>`: the snapshot of that commit; the key includes the revision."""
    run = worker_runs["hub-id@sha"].result()
    assert run.code == 0, run.stderr
    result = marker(run, model_key(HUB_REPO, hub.commit))
    assert (result["model_id"], result["revision"]) == (HUB_REPO, hub.commit)
    assert result["resolved_revision"] == hub.commit
    assert str(result["model_key"]).startswith(f"esd-test--tiny-llama--{hub.commit[:12]}-")


def test_missing_id_offline(hub: HubCache, worker_runs: dict[str, BackgroundRun]) -> None:
    run = worker_runs["hub-missing"].result()
    assert run.code == 3
    assert "Traceback" not in run.stderr
    assert run.errors == [run.lines[-1]]
    assert run.errors[0].startswith(
        f"esd-worker: error: {HUB_MISSING_REPO} is not in the HF cache ({hub.home / 'hub'})"
    )
    assert "HF_HUB_OFFLINE=1" in run.errors[0]
    assert not run.output.exists() or not any(run.output.rglob("result.json"))


def test_adapter_base_by_hub_id(hub: HubCache, worker_runs: dict[str, BackgroundRun]) -> None:
    """An adapter from the cache whose adapter_config names its base by hub id: the base is
    resolved the same way and recorded with its commit."""
    run = worker_runs["hub-adapter"].result()
    assert run.code == 0, run.stderr
    result = marker(run, model_key(HUB_ADAPTER_REPO))
    assert result["resolved_revision"] == hub.adapter_commit
    assert result["base_model"] == {
        "model": HUB_REPO, "resolved_revision": hub.commit, "source": "hub"
    }
    assert result["adapter"]["merged_modules"] == 2


# --- references that never reach the hub ---------------------------------------------------


@pytest.mark.parametrize("ref", ["/no/such/dir", "./no-such-dir", "../no/such",
                                 "~/no-such-esd-dir"])
def test_paths_that_do_not_exist(ref: str) -> None:
    """A path (/, ./, ../, ~) that names no directory fails as not found, without asking the
    hub."""
    with pytest.raises(PermanentModelError, match="model not found: no directory"):
        resolve_model(ref)


@pytest.mark.parametrize("ref", ["org/na me", "-org/name", "org/name/", "a/b/c",
                                 "C:\\models\\x", "org/name@bad..rev"])
def test_malformed_ids(ref: str) -> None:
    """Anything else is a hub id, refused by the list's own syntax check, without asking the
    hub (`a/b/c` is no path: a path starts with /, ./, ../ or ~)."""
    refused = r"model not found: (malformed model id|bad revision|.* is not a model id)"
    with pytest.raises(PermanentModelError, match=refused):
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
    assert model_key(resolved.model_id, resolved.revision) == ref_key(str(at))


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
    error = classify_hub_error(_hub_error(name), "org/name", None, offline=False)
    assert type(error) is kind
    assert fragment in str(error)
    assert "\n" not in str(error)


def test_missing_from_cache_while_offline_is_permanent() -> None:
    """With HF_HUB_OFFLINE=1 a cache miss cannot heal by retrying: exit 3, saying so."""
    error = classify_hub_error(_hub_error("local-entry"), "org/name", None, offline=True)
    assert type(error) is PermanentModelError
    assert "HF_HUB_OFFLINE=1" in str(error)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
                      "onnx/model.onnx"], ["config.json", "model.safetensors"],
                     id="single-safetensors-only"),
        pytest.param(["config.json", "model.safetensors.index.json",
                      "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                      "pytorch_model.bin.index.json"],
                     ["config.json", "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors", "model.safetensors.index.json"],
                     id="sharded"),
        pytest.param(["adapter_config.json", "adapter_model.safetensors", "README.md"],
                     ["adapter_config.json", "adapter_model.safetensors"], id="adapter"),
        pytest.param(["config.json", "pytorch_model.bin"], ["config.json", "pytorch_model.bin"],
                     id="bin-only"),
        pytest.param(["config.json", "pytorch_model.bin.index.json",
                      "pytorch_model-00001-of-00002.bin"],
                     ["config.json", "pytorch_model-00001-of-00002.bin",
                      "pytorch_model.bin.index.json"],
                     id="sharded-bin"),
        pytest.param(["adapter_config.json", "adapter_model.bin"],
                     ["adapter_config.json", "adapter_model.bin"], id="adapter-bin"),
    ],
)
def test_download_only_what_the_analysis_reads(files: list[str], expected: list[str]) -> None:
    """Online, the worker asks the hub for configs and one weight format only: never
    tokenizers, ONNX/GGUF variants, or .bin files next to safetensors."""
    from esd_worker.fetch.resolve import _choose_files

    assert _choose_files(files) == expected


def test_repo_without_weights_is_unsupported() -> None:
    from esd_worker.fetch.resolve import _choose_files

    with pytest.raises(PermanentModelError, match="unsupported format"):
        _choose_files(["config.json", "model.gguf", "unet/diffusion_pytorch_model.safetensors"])
