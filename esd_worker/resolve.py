"""Turn a model reference (local dir, or HF `org/name@rev`) into a local directory of its files."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from esd_worker.errors import PermanentModelError, TransientError, WorkerError
from esd_worker.naming import split_model_ref

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
# What the analysis needs from a repo: configs, weights, indices. Never tokenizers,
# images, GGUF, ONNX or other variants.
_CONFIG_FILES = ["config.json", "adapter_config.json"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model's files on local disk and where they came from.

    ref: as given; model_id / revision: parsed from it (revision None when not given);
    resolved_revision: the commit the files are from (None for local directories).
    """

    ref: str
    model_id: str
    revision: str | None
    resolved_revision: str | None
    directory: Path
    source: str  # "local" or "hub"

    @property
    def is_adapter(self) -> bool:
        return (self.directory / "adapter_config.json").is_file()


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """The model id and revision `resolve_model` will record for `ref` (no download).

    An existing directory is its own id (with no revision, even if its name has an '@').
    """
    if Path(ref).expanduser().is_dir():
        return ref, None
    return split_model_ref(ref)


def resolve_model(ref: str) -> ResolvedModel:
    """A local directory as is; anything else through the HF hub (cache first when offline)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return ResolvedModel(ref, ref, None, None, path.resolve(), "local")
    model_id, revision = split_model_ref(ref)
    looks_local = (
        ref.startswith(("/", "./", "../", "~", "."))
        or "\\" in ref
        or model_id.count("/") > 1
        or path.suffix in (".safetensors", ".bin", ".json")
    )
    if looks_local:
        raise PermanentModelError(f"model not found: no directory {ref}")
    if not _REPO_ID.match(model_id):
        raise PermanentModelError(
            f"model not found: {ref} is neither a directory nor a hub id (org/name[@revision])"
        )
    directory, sha = _download(model_id, revision)
    return ResolvedModel(ref, model_id, revision, sha, directory, "hub")


def _choose_files(filenames: list[str]) -> list[str]:
    names = set(filenames)
    root = {n for n in names if "/" not in n}
    patterns = [n for n in _CONFIG_FILES if n in root]
    if "model.safetensors.index.json" in root:
        patterns += ["model.safetensors.index.json", "model*.safetensors"]
    elif "model.safetensors" in root:
        patterns.append("model.safetensors")
    elif "adapter_model.safetensors" in root:
        patterns.append("adapter_model.safetensors")
    elif any(n.endswith(".safetensors") for n in root):
        patterns += sorted(n for n in root if n.endswith(".safetensors"))
    elif "pytorch_model.bin.index.json" in root:
        patterns += ["pytorch_model.bin.index.json", "pytorch_model*.bin"]
    elif "pytorch_model.bin" in root:
        patterns.append("pytorch_model.bin")
    elif "adapter_model.bin" in root:
        patterns.append("adapter_model.bin")
    else:
        raise PermanentModelError(
            "unsupported format: the repo has no safetensors or pytorch_model.bin weights "
            f"(files: {', '.join(sorted(root)[:8])})"
        )
    return patterns


def _download(model_id: str, revision: str | None) -> tuple[Path, str | None]:
    from huggingface_hub import HfApi, constants, snapshot_download

    try:
        if constants.HF_HUB_OFFLINE:
            patterns = [
                *_CONFIG_FILES,
                "*.safetensors",
                "model.safetensors.index.json",
                "pytorch_model*.bin",
                "pytorch_model.bin.index.json",
                "adapter_model.bin",
            ]
            folder = Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))
            return folder, folder.name
        info = HfApi().model_info(model_id, revision=revision)
        patterns = _choose_files([s.rfilename for s in info.siblings or []])
        log.info("model=%s revision=%s downloading %s", model_id, info.sha, ", ".join(patterns))
        folder = Path(snapshot_download(model_id, revision=info.sha, allow_patterns=patterns))
        return folder, info.sha
    except WorkerError:
        raise
    except Exception as e:
        raise classify_hub_error(e, model_id, revision) from e


def classify_hub_error(
    e: Exception, model_id: str, revision: str | None, *, offline: bool | None = None
) -> WorkerError:
    """Map huggingface_hub / network errors to permanent or transient, with what to do next.

    offline: whether HF_HUB_OFFLINE is in force (default: huggingface_hub's reading of it).
    """
    from huggingface_hub import constants, errors

    if offline is None:
        offline = bool(constants.HF_HUB_OFFLINE)
    what = model_id if revision is None else f"{model_id}@{revision}"
    if isinstance(e, errors.GatedRepoError):
        return PermanentModelError(
            f"{what} is gated: accept its licence on the hub and set HF_TOKEN to a token "
            "that has access"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return PermanentModelError(f"revision not found: {what}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return PermanentModelError(
            f"model not found: {what} (private repos need HF_TOKEN)"
        )
    if offline and isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return PermanentModelError(
            f"{what} is not in the HF cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 is "
            "set: download it first, or unset HF_HUB_OFFLINE"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        # Not offline by choice: the hub could not be reached and the cache lacks the files.
        return TransientError(f"hub unreachable and {what} not (fully) cached: {_one_line(e)}")
    if isinstance(e, errors.EntryNotFoundError):
        return PermanentModelError(f"{what}: file not found on the hub: {_one_line(e)}")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return PermanentModelError(f"{what} is not in the HF cache and HF_HUB_OFFLINE=1 is set")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return PermanentModelError(f"{what}: access denied ({status}); set HF_TOKEN")
        if status == 404:
            return PermanentModelError(f"model not found: {what}")
        return TransientError(f"hub error for {what} (HTTP {status}): retry later")
    if isinstance(e, (ConnectionError, TimeoutError, OSError)) or type(e).__module__.startswith(
        ("httpx", "httpcore", "requests", "urllib3")
    ):
        return TransientError(f"network error fetching {what}: {type(e).__name__}: {_one_line(e)}")
    if isinstance(e, ValueError):  # e.g. HFValidationError for a malformed id
        return PermanentModelError(f"invalid model id {what}: {_one_line(e)}")
    return TransientError(f"unexpected error fetching {what}: {type(e).__name__}: {_one_line(e)}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
