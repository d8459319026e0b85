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
        pytest.param(["model_index.json", "README.md", "unet/config.json",
                      "unet/diffusion_pytorch_model.safetensors",
                      "unet/diffusion_pytorch_model.fp16.safetensors",
                      "text_encoder/config.json", "text_encoder/model.safetensors",
                      "scheduler/scheduler_config.json", "tokenizer/vocab.json",
                      "v1-5-pruned.safetensors"],
                     ["model_index.json", "text_encoder/config.json",
                      "text_encoder/model.safetensors", "unet/config.json",
                      "unet/diffusion_pytorch_model.safetensors"], id="diffusers"),
        pytest.param(["modules.json", "config.json", "model.safetensors", "tokenizer.json",
                      "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors",
                      "2_Dense/pytorch_model.bin"],
                     ["2_Dense/config.json", "2_Dense/model.safetensors", "config.json",
                      "model.safetensors", "modules.json"], id="sentence-transformers-dense"),
        pytest.param(["config.json", "README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf",
                      "mmproj-f16.gguf"], ["m-Q8_0.gguf"], id="gguf-one-file-no-config"),
    ],
)
def test_download_only_what_the_analysis_reads(files: list[str], expected: list[str]) -> None:
    """Online, the worker asks the hub for configs and one weight format only: never
    tokenizers, ONNX/GGUF variants, or .bin files next to safetensors; a pipeline's and a
    sentence-transformers model's weight folders with their configs; one GGUF file."""
    from esd_worker.fetch.resolve import _choose_files

    assert _choose_files(files) == expected


def test_repo_without_weights_is_unsupported() -> None:
    from esd_worker.fetch.resolve import _choose_files

    with pytest.raises(PermanentModelError, match="unsupported format"):
        _choose_files(["config.json", "model.onnx", "unet/diffusion_pytorch_model.safetensors"])


# A repo's files (name -> bytes) for the hub double, and what the worker fetches of it.
_LAYOUT_REPOS: dict[str, tuple[dict[str, bytes], list[str]]] = {
    "esd-test/pipeline": ({
        "model_index.json": b"{}", "README.md": b"# a pipeline",
        "unet/config.json": b"{}", "unet/diffusion_pytorch_model.safetensors": b"u" * 300,
        "unet/diffusion_pytorch_model.fp16.safetensors": b"h" * 150,
        "text_encoder/config.json": b"{}", "text_encoder/model.safetensors": b"t" * 200,
        "scheduler/scheduler_config.json": b"{}", "tokenizer/vocab.json": b"{}",
        "v1-5-pruned.safetensors": b"p" * 700,
    }, ["model_index.json", "text_encoder/config.json", "text_encoder/model.safetensors",
        "unet/config.json", "unet/diffusion_pytorch_model.safetensors"]),
    "esd-test/embedder": ({
        "modules.json": b"[]", "config.json": b"{}", "model.safetensors": b"m" * 120,
        "1_Pooling/config.json": b"{}", "2_Dense/config.json": b"{}",
        "2_Dense/model.safetensors": b"d" * 40, "2_Dense/pytorch_model.bin": b"b" * 40,
    }, ["2_Dense/config.json", "2_Dense/model.safetensors", "config.json",
        "model.safetensors", "modules.json"]),
    "esd-test/quants": ({
        "README.md": b"# quants", "config.json": b"{}", "m-Q4_K_M.gguf": b"q" * 90,
        "Q8_0/m-Q8_0-00001-of-00002.gguf": b"a" * 80,
        "Q8_0/m-Q8_0-00002-of-00002.gguf": b"b" * 70, "mmproj-f16.gguf": b"v" * 60,
    }, ["Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"]),
}
_FETCH = """
import json, sys
from esd_worker.fetch.resolve import model_files, resolve_model
out = {}
for ref in sys.argv[1:]:
    files = model_files(ref)
    model = resolve_model(ref, files=files)
    held = sorted(p.relative_to(model.directory).as_posix()
                  for p in model.directory.rglob("*") if p.is_file())
    out[ref] = {"names": files.names, "held": held, "bytes": files.total_bytes}
print(json.dumps(out))
"""


def test_pipeline_embedder_and_gguf_repos_fetch_what_is_read(tmp_path: Path) -> None:
    """Through the real huggingface_hub client against the hub double: a diffusers pipeline's
    component folders, a sentence-transformers model's module folder and one GGUF file set
    (in a folder of their own) are what is downloaded, nothing else; offline afterwards, the
    cached snapshot is found and names the same files. The controller sizes the same weights
    from the hub's file list."""
    import subprocess
    import sys

    from controller.weights.sizing import Sizer
    from esd_worker.core.models.modellist import ModelRow
    from tests.support import REPO_ROOT
    from tests.support.hubserver import HubServer

    with HubServer() as server:
        for repo, (files, _) in _LAYOUT_REPOS.items():
            folder = tmp_path / "repos" / repo
            for name, body in files.items():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(body)
            server.add_repo(repo, folder)
        env = server.env(tmp_path / "hf") | {"PYTHONPATH": str(REPO_ROOT)}
        refs = list(_LAYOUT_REPOS)
        online = subprocess.run([sys.executable, "-c", _FETCH, *refs], env=env,
                                capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert online.returncode == 0, online.stderr[-2000:]
        sizer = Sizer(endpoint=server.url, offline=False, rate_per_s=100.0)
        sized = {repo: sizer.size(ModelRow(repo, None, "", None)) for repo in refs}
    offline = subprocess.run([sys.executable, "-c", _FETCH, *refs],
                             env=env | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                             timeout=120, cwd=REPO_ROOT)
    assert offline.returncode == 0, offline.stderr[-2000:]
    for got in (online, offline):
        results = json.loads(got.stdout.strip().splitlines()[-1])
        for repo, (_, expected) in _LAYOUT_REPOS.items():
            assert results[repo]["names"] == expected
            assert results[repo]["held"] == expected
    for repo, (files, expected) in _LAYOUT_REPOS.items():
        weights = [n for n in expected if n.endswith((".safetensors", ".bin", ".gguf"))]
        assert sized[repo] == sum(len(files[n]) for n in weights)
