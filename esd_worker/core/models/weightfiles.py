"""Which of a model's files are its weights: the one rule that the worker's download
(esd_worker.fetch.resolve), its reader (esd_worker.analysis.weights) and the controller's sizes
and shapes (controller.weights) all follow, so that what is sized is what is downloaded, and what
is downloaded is what is read.

Owns, from a list of file names (a repo's or a directory's; only top-level names count):
whether they are an adapter's (adapter_config.json among them, as the worker decides after the
download), which names are the weights, in which format, the index that names the shards, and
what is never weights (training state; an adapter's files in a model). Does not read any file
(esd_worker.analysis.weights reads an index's weight_map), list a directory, or word the error
for a model without weights (each caller says what it looked at).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
# Training state that repos sometimes keep beside the weights: never what the worker reads.
# adapter_model: an adapter's low-rank factors are no model's matrices (a model's weights
# never include them; an adapter's are nothing else).
_NEVER_MODEL_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "adapter_model")
# Globs that every name weight_files may choose (weights and indices) matches: offline, the
# cached snapshot is asked for these, without the hub's file list to choose from.
PATTERNS = ("*.safetensors", SAFETENSORS_INDEX, "pytorch_model*.bin", BIN_INDEX, ADAPTER_BIN)

Format = Literal["safetensors", "bin"]

# A model's weights, in the order of preference (what save_pretrained writes): safetensors
# before .bin, whatever else is there, so that a repo with both formats costs one. Per format:
# (its index, the shards the index names, the single file, any file of the format). The single
# file wins over the others: model.fp16.safetensors or pytorch_model.fp16.bin beside it are
# variants of the same tensors, which would be downloaded and read twice.
_MODEL_RULES: tuple[tuple[Format, str, str, str, str], ...] = (
    ("safetensors", SAFETENSORS_INDEX, "model*.safetensors", "model.safetensors",
     "*.safetensors"),
    ("bin", BIN_INDEX, "pytorch_model*.bin", "pytorch_model.bin", "pytorch_model*.bin"),
)
_ADAPTER_RULES: tuple[tuple[Format, str], ...] = (
    ("safetensors", ADAPTER_SAFETENSORS), ("bin", ADAPTER_BIN))


@dataclass(frozen=True)
class WeightFiles:
    """A model's weights: their format, their names (sorted) and the index naming the shards
    (None without one). With an index, `names` are the files that look like its shards (maybe
    none: a broken upload); the reader takes the index's own list and says what is missing."""

    format: Format
    names: tuple[str, ...]
    index: str | None = None

    @property
    def files(self) -> list[str]:
        """What to download for them: the weights and their index, sorted."""
        return sorted((*self.names, *([self.index] if self.index else [])))


def is_adapter(names: Iterable[str]) -> bool:
    """Whether the files are an adapter's: the worker's test (adapter_config.json at the top)."""
    return ADAPTER_CONFIG in {n for n in names if "/" not in n}


def weight_files(names: Iterable[str], *, adapter: bool | None = None) -> WeightFiles | None:
    """The weights among `names`, or None when there are none.

    adapter (default: is_adapter(names)): only adapter_model.safetensors, else
    adapter_model.bin. A model: the index's shards (model*.safetensors), else
    model.safetensors, else every other *.safetensors; then the same for .bin (the index's
    pytorch_model*.bin, pytorch_model.bin, every pytorch_model*.bin). Never a subfolder's file,
    training state (optimizer*, scheduler*, rng_state*, training_args*) or other formats
    (*.pt, *.pth, *.gguf, a .bin not named pytorch_model*: no reader here loads them).
    """
    root = sorted({n for n in names if "/" not in n})
    present = set(root)
    if adapter is None:
        adapter = ADAPTER_CONFIG in present
    if adapter:
        for fmt, name in _ADAPTER_RULES:
            if name in present:
                return WeightFiles(fmt, (name,))
        return None
    candidates = [n for n in root if not n.startswith(_NEVER_MODEL_WEIGHTS)]

    def matching(pattern: str) -> tuple[str, ...]:
        return tuple(n for n in candidates if fnmatchcase(n, pattern))

    for fmt, index, shards, single, every in _MODEL_RULES:
        if index in present:
            return WeightFiles(fmt, matching(shards), index)
        if single in present:
            return WeightFiles(fmt, (single,))
        if found := matching(every):
            return WeightFiles(fmt, found)
    return None


def weight_names(names: Iterable[str], *, adapter: bool | None = None) -> list[str]:
    """weight_files(names).names as a list; [] when there are no weights."""
    chosen = weight_files(names, adapter=adapter)
    return list(chosen.names) if chosen is not None else []
