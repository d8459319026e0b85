"""Which of a model's files are its weights: the one rule that the worker's download
(esd_worker.fetch.resolve), its reader (esd_worker.analysis.weights, .checkpoints) and the
controller's sizes and shapes (controller.weights) all follow, so that what is sized is what is
downloaded, and what is downloaded is what is read.

Owns, from a list of file names (a repo's or a directory's, relative paths with "/"): whether
they are an adapter's (adapter_config.json among them, as the worker decides after the
download); how a model is laid out (`model_weights`: one checkpoint at the top, a diffusers
pipeline's component folders, a sentence-transformers model's module folders, or one GGUF file
set); per folder, which names are the weights (`weight_files`), in which format, the index that
names the shards; which GGUF file set stands for a GGUF-only repo (`gguf_files`, by its
quantization tag: `gguf_quant`); and what is never weights (training state; an adapter's files
in a model). Does not read any file (esd_worker.analysis.weights reads an index's weight_map),
list a directory, or word the error for a model without weights (each caller says what it
looked at).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
DIFFUSERS_SAFETENSORS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_BIN_INDEX = "diffusion_pytorch_model.bin.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
MODEL_INDEX = "model_index.json"  # a diffusers pipeline: its components in folders
MODULES = "modules.json"  # a sentence-transformers model: its modules, some in folders
# Training state that repos sometimes keep beside the weights: never what the worker reads.
# adapter_model: an adapter's low-rank factors are no model's matrices (a model's weights
# never include them; an adapter's are nothing else).
_NEVER_MODEL_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "adapter_model")
# Globs that every name model_weights may choose (weights, indices, the layout's file) matches,
# "*" matching "/" too (fnmatch, as huggingface_hub's allow_patterns): offline, the cached
# snapshot is asked for these, without the hub's file list to choose from.
PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*pytorch_model*.bin",
            "*.bin.index.json", ADAPTER_BIN, "*.gguf", MODEL_INDEX, MODULES)

Format = Literal["safetensors", "bin", "gguf"]
Kind = Literal["model", "adapter", "diffusers", "sentence-transformers", "gguf"]

# A folder's weights, in the order of preference (what save_pretrained writes, transformers'
# names and diffusers'): safetensors before .bin, whatever else is there, so that a repo with
# both formats costs one. Per format: the (index, the shards it names, the single file) of
# each naming, then any file of the format. An index wins, then the single file: variants
# beside it (model.fp16.safetensors, diffusion_pytorch_model.non_ema.bin, an index's
# ...-00001-of-00002.fp16.safetensors) are the same tensors, which would be downloaded and
# read twice.
_MODEL_RULES: tuple[tuple[Format, tuple[tuple[str, str, str], ...], tuple[str, ...]], ...] = (
    ("safetensors",
     ((SAFETENSORS_INDEX, "model*.safetensors", "model.safetensors"),
      (DIFFUSERS_SAFETENSORS_INDEX, "diffusion_pytorch_model*.safetensors",
       "diffusion_pytorch_model.safetensors")),
     ("*.safetensors",)),
    ("bin",
     ((BIN_INDEX, "pytorch_model*.bin", "pytorch_model.bin"),
      (DIFFUSERS_BIN_INDEX, "diffusion_pytorch_model*.bin", "diffusion_pytorch_model.bin")),
     ("pytorch_model*.bin", "diffusion_pytorch_model*.bin")),
)
_ADAPTER_RULES: tuple[tuple[Format, str], ...] = (
    ("safetensors", ADAPTER_SAFETENSORS), ("bin", ADAPTER_BIN))
# A variant's tag before the extension (model-00001-of-00002.fp16.safetensors): not a shard
# of the plain index.
_VARIANT = re.compile(r"\.[A-Za-z][\w-]*$")
# sentence-transformers names a module's folder <index>_<type> (1_Pooling, 2_Dense).
_MODULE_FOLDER = re.compile(r"^\d+_\w")


@dataclass(frozen=True)
class WeightFiles:
    """A folder's weights: their format, their names (sorted) and the index naming the shards
    (None without one). With an index, `names` are the files that look like its shards (maybe
    none: a broken upload); the reader takes the index's own list and says what is missing.
    A GGUF file set's names may lie in a folder of their own (Q4_K_M/x-00001-of-00002.gguf)."""

    format: Format
    names: tuple[str, ...]
    index: str | None = None

    @property
    def files(self) -> list[str]:
        """What to download for them: the weights and their index, sorted."""
        return sorted((*self.names, *([self.index] if self.index else [])))


@dataclass(frozen=True)
class Part:
    """One component of a model: its folder ("" the top) and the weights in it (names
    relative to it). Its layers and keys go under `prefix` ("" at the top, else "folder/")."""

    folder: str
    weights: WeightFiles

    @property
    def prefix(self) -> str:
        return f"{self.folder}/" if self.folder else ""

    @property
    def names(self) -> list[str]:
        return [self.prefix + name for name in self.weights.names]

    @property
    def files(self) -> list[str]:
        return [self.prefix + name for name in self.weights.files]


@dataclass(frozen=True)
class ModelWeights:
    """How a model's weights are laid out: `kind`, its parts (in order: the top first, then
    folders by name) and the file that says the layout (model_index.json, modules.json;
    None: none needed)."""

    kind: Kind
    parts: tuple[Part, ...]
    marker: str | None = None

    @property
    def names(self) -> list[str]:
        """Every weight file, with its folder (what is sized), sorted."""
        return sorted(name for part in self.parts for name in part.names)

    @property
    def files(self) -> list[str]:
        """What to download for them: the weights, their indices and the layout's file."""
        files = [name for part in self.parts for name in part.files]
        return sorted([*files, *([self.marker] if self.marker else [])])


def is_adapter(names: Iterable[str]) -> bool:
    """Whether the files are an adapter's: the worker's test (adapter_config.json at the top)."""
    return ADAPTER_CONFIG in {n for n in names if "/" not in n}


def weight_files(names: Iterable[str], *, adapter: bool | None = None) -> WeightFiles | None:
    """The weights of one folder among `names` (only its own files count: never a
    subfolder's), or None when there are none.

    adapter (default: is_adapter(names)): only adapter_model.safetensors, else
    adapter_model.bin. A model: an index's shards (model*.safetensors, or diffusers'
    diffusion_pytorch_model*.safetensors; not their variants), else model.safetensors or
    diffusion_pytorch_model.safetensors, else every other *.safetensors; then the same for
    .bin (pytorch_model*.bin, diffusion_pytorch_model*.bin). Never training state
    (optimizer*, scheduler*, rng_state*, training_args*) or other formats (*.pt, *.pth, a .bin
    not named so; GGUF is `gguf_files`' and `model_weights`').
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

    def matching(*patterns: str) -> tuple[str, ...]:
        return tuple(n for n in candidates if any(fnmatchcase(n, p) for p in patterns))

    for fmt, namings, every in _MODEL_RULES:
        for index, shards, _ in namings:
            if index in present:
                return WeightFiles(fmt, tuple(n for n in matching(shards) if not _variant(n)),
                                   index)
        for _, _, single in namings:
            if single in present:
                return WeightFiles(fmt, (single,))
        if found := matching(*every):
            return WeightFiles(fmt, _one_variant(found))
    return None


# Variants of one file, the first preferred: the plain one, then full precision, then half;
# an EMA or non-EMA copy only when there is nothing else (diffusers' plain file is the EMA
# weights, its `.non_ema` the training copy).
_VARIANT_ORDER = ("", "fp32", "fp16", "bf16")
_SECOND_COPIES = ("ema", "non_ema", "non-ema")


def _one_variant(found: tuple[str, ...]) -> tuple[str, ...]:
    """One file of each set of variants of one name (model.fp16.safetensors and
    model.ema.safetensors are two copies of the same tensors: reading both would be two
    models in one), every file of other names."""
    by_stem: dict[str, list[tuple[str, str]]] = {}
    for name in found:
        base, variant = _split_variant(name)
        by_stem.setdefault(base, []).append((variant, name))

    def rank(item: tuple[str, str]) -> tuple[bool, int, str]:
        variant = item[0]
        order = (_VARIANT_ORDER.index(variant) if variant in _VARIANT_ORDER
                 else len(_VARIANT_ORDER))
        return (variant in _SECOND_COPIES, order, item[1])

    return tuple(sorted(min(options, key=rank)[1] for options in by_stem.values()))


def model_weights(names: Iterable[str], *, adapter: bool | None = None) -> ModelWeights | None:
    """How the weights among `names` (a repo's or a folder's files, with their folders) are
    laid out, or None when there are none. The first that applies:

    - an adapter (adapter, default is_adapter(names)): its own files at the top;
    - a diffusers pipeline (model_index.json at the top): each folder holding weights
      (weight_files of its files: unet/, text_encoder/, vae/, ...) is a part of its own;
      folders without (scheduler/, tokenizer/) and the top's files are not read;
    - a sentence-transformers model (modules.json at the top) with module folders holding
      weights (<index>_<type>/, e.g. 2_Dense/model.safetensors): the top's weights, then each
      such folder (one with none, 1_Pooling/, is a config only);
    - a model: weight_files of the top;
    - GGUF: one file set (gguf_files), when nothing else holds weights.
    Deeper folders and hidden ones (.cache/) never count.
    """
    listing = sorted({n for n in names if n.count("/") <= 1
                      and not any(p.startswith(".") for p in n.split("/"))})
    root = [n for n in listing if "/" not in n]
    if adapter is None:
        adapter = ADAPTER_CONFIG in root
    if adapter:
        chosen = weight_files(root, adapter=True)
        return None if chosen is None else ModelWeights("adapter", (Part("", chosen),))
    folders: dict[str, list[str]] = {}
    for name in listing:
        if "/" in name:
            folder, file = name.split("/")
            folders.setdefault(folder, []).append(file)
    parts = {folder: chosen for folder, files in folders.items()
             if (chosen := weight_files(files, adapter=False)) is not None}
    top = weight_files(root, adapter=False)
    if MODEL_INDEX in root and parts:
        return ModelWeights("diffusers", tuple(Part(f, w) for f, w in parts.items()),
                            MODEL_INDEX)
    modules = [Part(f, w) for f, w in parts.items() if _MODULE_FOLDER.match(f)]
    if MODULES in root and modules:
        return ModelWeights("sentence-transformers",
                            (*([Part("", top)] if top else []), *modules), MODULES)
    if top is not None:
        return ModelWeights("model", (Part("", top),))
    gguf = gguf_files(listing)
    return None if gguf is None else ModelWeights("gguf", (Part("", gguf),))


def weight_names(names: Iterable[str], *, adapter: bool | None = None) -> list[str]:
    """model_weights(names).names: every weight file, with its folder; [] when none."""
    chosen = model_weights(names, adapter=adapter)
    return chosen.names if chosen is not None else []


def _split_variant(name: str) -> tuple[str, str]:
    """A weight file's name without its extension, split into the plain name and its variant
    tag ("" for none): ("model", "fp16") of model.fp16.safetensors."""
    stem = name.rsplit(".", 1)[0]
    tag = _VARIANT.search(stem)
    return (stem[: tag.start()], tag.group(0)[1:].lower()) if tag else (stem, "")


def _variant(name: str) -> bool:
    return bool(_split_variant(name)[1])


# --- GGUF ---------------------------------------------------------------------------------

# Quantization tags of GGUF file names, by bits per weight: llama.cpp's quantize table (the
# file's size per weight for Llama-3-8B; the nominal bits of its block type where the table
# gives them). Only their order matters to the choice; K-quant aliases are their _M mix.
GGUF_BITS: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 7.96, "Q6_K": 6.14, "Q5_1": 5.65,
    "Q5_K_M": 5.33, "Q5_K": 5.33, "Q5_K_S": 5.21, "Q5_0": 5.21, "Q4_1": 4.78,
    "Q4_K_M": 4.58, "Q4_K": 4.58, "IQ4_NL": 4.5, "Q4_K_S": 4.37, "Q4_0": 4.34,
    "IQ4_XS": 4.25, "MXFP4": 4.25, "Q3_K_L": 4.03, "Q3_K_M": 3.74, "Q3_K": 3.74,
    "IQ3_M": 3.66, "IQ3_S": 3.44, "Q3_K_S": 3.41, "IQ3_XS": 3.3, "IQ3_XXS": 3.06,
    "Q2_K": 2.96, "Q2_K_S": 2.9, "IQ2_M": 2.7, "IQ2_S": 2.5, "IQ2_XS": 2.31, "IQ2_XXS": 2.06,
    "TQ2_0": 2.06, "IQ1_M": 1.75, "TQ1_0": 1.69, "IQ1_S": 1.56,
}
_SPELLINGS = {"FP32": "F32", "FP16": "F16"}
_TAG = re.compile(r"(?<![A-Z0-9])(I?Q\d_[A-Z0-9]+(?:_[A-Z]+)?|TQ\d_0|MXFP4|BF16|FP?16|FP?32)"
                  r"(?![A-Z0-9])")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
# GGUF files that are not the model's weights: a vision projector, an importance matrix.
_NOT_THE_MODEL = ("mmproj", "imatrix")


def gguf_quant(name: str) -> str | None:
    """The quantization tag a GGUF file's name carries (the last one: model-Q4_K_M.gguf ->
    Q4_K_M; f16 -> F16), or None when it carries none known. A tag with a suffix of its own
    (Q4_K_L: a mix of its maker's) counts as the tag without it."""
    for found in reversed(_TAG.findall(name.rsplit("/", 1)[-1].upper())):
        tag = _SPELLINGS.get(found, found)
        while tag not in GGUF_BITS and tag.count("_") > 1:
            tag = tag.rsplit("_", 1)[0]
        if tag in GGUF_BITS:
            return tag
    return None


def gguf_files(names: Iterable[str]) -> WeightFiles | None:
    """The one GGUF file set among `names` (at the top or in a folder of the top: big models
    keep each quantization's parts in a folder), or None when there is none.

    A set is one file, or the parts of a split (x-00001-of-00003.gguf ... -00003-of-00003).
    The chosen set: a complete one before a split missing parts; then the highest precision
    by its name's quantization tag (gguf_quant, GGUF_BITS: F32 > F16 = BF16 > Q8_0 > Q6_K >
    Q5_K_M > ... > IQ1_S; a name without a known tag last); then the first by name.
    Vision projectors (mmproj*) and importance matrices (imatrix*) are never chosen."""
    sets: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for name in sorted(set(names)):
        base = name.rsplit("/", 1)[-1].lower()
        if name.count("/") > 1 or not base.endswith(".gguf") or base.startswith(".") or any(
                word in base for word in _NOT_THE_MODEL):
            continue
        split = _SPLIT.match(name)
        if split is None:
            sets[(name, 1)] = [(1, name)]
        else:
            sets.setdefault((split["stem"], int(split["total"])), []).append(
                (int(split["part"]), name))
    if not sets:
        return None

    def rank(item: tuple[tuple[str, int], list[tuple[int, str]]]) -> tuple[bool, float, str]:
        (_, total), parts = item
        complete = sorted(p for p, _ in parts) == list(range(1, total + 1))
        tag = gguf_quant(parts[0][1])
        return (not complete, -(GGUF_BITS[tag] if tag else 0.0), parts[0][1])

    _, parts = min(sets.items(), key=rank)
    return WeightFiles("gguf", tuple(name for _, name in sorted(parts)))
