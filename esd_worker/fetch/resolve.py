"""Turn a model reference (local dir, or HF `org/name@rev`) into a local directory of its files,
and say beforehand which files that takes and how many bytes they are.

Owns: which files of a repo the analysis needs
(`_choose_files`: the weights that esd_worker.core.models.weightfiles' model_weights picks, the
rule the controller's sizes and the reader follow too, with their folders for a diffusers
pipeline's components or a sentence-transformers model's modules, or the one GGUF file set;
and each weight folder's configs), and offline mode (HF_HUB_OFFLINE=1: the HF cache
only). The hub's HTTP side (model info, downloads, retries, error mapping) is
esd_worker.fetch.hub's.

What a reference means (a local path or a hub id, its id and revision) is
esd_worker.core.models.naming's rule, the list reader's: a hub-id-shaped name goes to the hub
even where a folder of that name exists here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from esd_worker.core.errors import PermanentModelError, WorkerError
from esd_worker.core.hubretry import RetryPolicy
from esd_worker.core.models.naming import is_local_path, normalize_model_ref, parse_ref
from esd_worker.core.models.weightfiles import PATTERNS, is_adapter, model_weights
from esd_worker.fetch.hub import classify_hub_error, download_files, model_info

log = logging.getLogger(__name__)

# What the analysis needs from a repo: configs, weights, indices (and the file that says a
# pipeline's or a sentence-transformers model's layout). Never tokenizers, images, ONNX or
# other variants, nor GGUF beside other weights.
_CONFIG_FILES = ["config.json", "adapter_config.json"]
# Offline, without the hub's file list: whatever of these the cached snapshot holds (a
# component folder's config too: "*" matches "/" in these globs).
_OFFLINE_PATTERNS = [*_CONFIG_FILES, "*/config.json", *PATTERNS]


@dataclass(frozen=True)
class ResolvedModel:
    """A model's files on local disk and where they came from.

    ref: as given; model_id / revision: parsed from it (revision None when not given);
    resolved_revision: the commit the files are from (None for local directories);
    size_bytes: the bytes of the files fetched (None when nothing was sized: a local
    directory, the offline cache).
    """

    ref: str
    model_id: str
    revision: str | None
    resolved_revision: str | None
    directory: Path
    source: str  # "local" or "hub"
    size_bytes: int | None = None

    @property
    def is_adapter(self) -> bool:
        return (self.directory / "adapter_config.json").is_file()


@dataclass(frozen=True)
class ModelFiles:
    """The files `resolve_model` would fetch for a reference, sized before any download.

    model_id / revision: parsed from the reference (revision as given, None when not);
    sha: the commit they are from (None for a local directory); files: (name, bytes) pairs,
    sorted by name.
    """

    model_id: str
    revision: str | None
    sha: str | None
    files: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.files]


def resolve_model(
    ref: str, *, cache_dir: Path | None = None, files: ModelFiles | None = None,
    retry: RetryPolicy | None = None,
) -> ResolvedModel:
    """A local path (naming's rule: /, ./, ../, ~) as is; a hub id through the HF hub (the
    cache only when offline). model_id and revision are parse_ref's, the list's.

    cache_dir: the HF cache to download into (default: the user's, HF_HUB_CACHE).
    files: what `model_files(ref)` returned earlier: the download then needs no second
    model-info call. retry: how hub failures are retried (default: RetryPolicy.from_env()).
    """
    if is_local_path(ref.strip()):
        path, directory = _local_dir(ref)
        return ResolvedModel(ref, path, None, None, directory.resolve(), "local")
    model_id, revision = _hub_id(ref)
    if _offline():
        directory = _offline_snapshot(model_id, revision, cache_dir)
        return ResolvedModel(ref, model_id, revision, directory.name, directory, "hub")
    if files is not None and (files.model_id, files.revision) != (model_id, revision):
        raise ValueError(f"files are for {files.model_id}@{files.revision}, not {ref}")
    policy = retry or RetryPolicy.from_env()
    if files is None or files.sha is None:
        files = _hub_files(model_id, revision, policy)
    assert files.sha is not None
    log.info("model=%s revision=%s downloading %s (%d bytes)", model_id, files.sha,
             ", ".join(files.names), files.total_bytes)
    directory = download_files(model_id, files.sha, files.names, ref=revision,
                               cache_dir=cache_dir, policy=policy)
    return ResolvedModel(ref, model_id, revision, files.sha, directory, "hub",
                         files.total_bytes)


def model_files(
    ref: str, *, cache_dir: Path | None = None, retry: RetryPolicy | None = None
) -> ModelFiles:
    """Which files `resolve_model(ref)` fetches and their sizes, without downloading them.

    Hub: one model-info call with file metadata (pass the result to resolve_model to reuse
    it); a local directory: sizes on disk; offline: the cached snapshot's files.
    """
    if is_local_path(ref.strip()):
        path, directory = _local_dir(ref)
        return _sized(path, None, None, directory)
    model_id, revision = _hub_id(ref)
    if _offline():
        directory = _offline_snapshot(model_id, revision, cache_dir)
        return _sized(model_id, revision, directory.name, directory)
    return _hub_files(model_id, revision, retry or RetryPolicy.from_env())


def _local_dir(ref: str) -> tuple[str, Path]:
    """(id, directory) of a local reference: its one spelling, and that directory, or
    PermanentModelError when there is none."""
    path = normalize_model_ref(ref)
    directory = Path(path)
    if not directory.is_dir():
        raise PermanentModelError(f"model not found: no directory {ref.strip()}")
    return path, directory


def _hub_id(ref: str) -> tuple[str, str | None]:
    """(model id, revision) of a hub reference, or PermanentModelError for one whose syntax
    no hub id has (parse_ref's problem with it, the line a bad list row gets)."""
    model_id, revision, problem = parse_ref(ref)
    if problem is not None:
        raise PermanentModelError(f"model not found: {problem}")
    return model_id, revision


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_files(model_id: str, revision: str | None, policy: RetryPolicy) -> ModelFiles:
    info = model_info(model_id, revision, policy)
    if not info.sha:
        raise PermanentModelError(f"the hub sent no commit for {model_id}@{revision}")
    sizes = {}
    for s in info.siblings or []:
        size = s.size if s.size is not None else (s.lfs.size if s.lfs is not None else 0)
        sizes[s.rfilename] = int(size)
    chosen = _choose_files(sizes)
    return ModelFiles(model_id, revision, info.sha, tuple((n, sizes[n]) for n in chosen))


def _sized(model_id: str, revision: str | None, sha: str | None, directory: Path) -> ModelFiles:
    on_disk = {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}
    chosen = _choose_files(on_disk)
    return ModelFiles(model_id, revision, sha,
                      tuple((n, on_disk[n].stat().st_size) for n in chosen))


def _choose_files(filenames: Iterable[str]) -> list[str]:
    """The files of a repo (or directory) the analysis needs, sorted: its weights with their
    indices and layout file (esd_worker.core.models.weightfiles.model_weights: an adapter's
    own files when adapter_config.json is there; a pipeline's or a sentence-transformers
    model's weight folders; one GGUF file set), and the configs of each folder that holds
    weights (none for GGUF: the file is its own config). PermanentModelError when it has no
    weights."""
    listing = sorted(set(filenames))
    chosen = model_weights(listing)
    if chosen is None:
        root = [n for n in listing if "/" not in n]
        wanted = ("adapter_model.safetensors or adapter_model.bin" if is_adapter(root)
                  else "safetensors, pytorch_model.bin or GGUF")
        raise PermanentModelError(
            f"unsupported format: the repo has no {wanted} weights "
            f"(files: {', '.join(root[:8])})"
        )
    present = set(listing)
    configs = [] if chosen.kind == "gguf" else [
        part.prefix + name for part in chosen.parts for name in _CONFIG_FILES
        if part.prefix + name in present]
    return sorted({*configs, *chosen.files})


def _offline_snapshot(model_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    """The cached snapshot of model_id@revision (HF_HUB_OFFLINE=1: no request is made)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=_OFFLINE_PATTERNS))
    except WorkerError:
        raise
    except Exception as e:
        raise classify_hub_error(e, model_id, revision) from e
