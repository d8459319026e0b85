"""esd_worker.core.models.weightfiles: which files are a model's weights, and that its three
users agree on it for the same directory: the controller's size (controller.weights.sizing),
the worker's download (esd_worker.fetch.resolve.model_files) and the worker's reader
(esd_worker.analysis.weights.find_weight_files). They once each had their own copy of the
rule, and the sizes counted *.pt / *.pth files that were never downloaded.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from controller.weights.sizing import Sizer
from esd_worker.analysis.weights import find_weight_files
from esd_worker.core.errors import PermanentModelError
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.weightfiles import (
    PATTERNS,
    WeightFiles,
    is_adapter,
    weight_files,
)
from esd_worker.fetch.resolve import model_files

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BIN_SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]

# names -> the weights among them (None: no weights). Each case is one directory's files.
CASES: dict[str, tuple[list[str], list[str] | None]] = {
    "sharded-safetensors-not-consolidated": (
        ["config.json", "model.safetensors.index.json", *SHARDS, "consolidated.safetensors"],
        SHARDS),
    "single-safetensors-over-bin": (["config.json", "model.safetensors", "pytorch_model.bin"],
                                    ["model.safetensors"]),
    "single-safetensors-over-its-variants": (["model.safetensors", "model.fp16.safetensors"],
                                             ["model.safetensors"]),
    "other-safetensors": (["a.safetensors", "b.safetensors", "pytorch_model.bin"],
                          ["a.safetensors", "b.safetensors"]),
    "sharded-bin": (["pytorch_model.bin.index.json", *BIN_SHARDS, "training_args.bin"],
                    BIN_SHARDS),
    "single-bin": (["config.json", "pytorch_model.bin", "training_args.bin"],
                   ["pytorch_model.bin"]),
    # the download once refused these (only pytorch_model.bin or an index would do); the
    # reader and the sizes took them
    "bin-shards-without-an-index": (["config.json", *BIN_SHARDS], BIN_SHARDS),
    # the sizes once counted *.pt, *.pth and any *.bin: nothing here downloads or reads them
    "pt-pth-and-other-bins-are-not-weights": (
        ["config.json", "weights.bin", "model.pt", "model.pth", "optimizer.pt",
         "rng_state.pth", "training_args.bin", "scheduler.pt"], None),
    "training-state-safetensors": (["optimizer.safetensors", "model-a.safetensors"],
                                   ["model-a.safetensors"]),
    "subfolders-ignored": (["model.safetensors", "onnx/model.safetensors",
                            "original/consolidated.pth"], ["model.safetensors"]),
    # an adapter is what adapter_config.json says (the worker's test): its own files only;
    # the download once took model.safetensors here, which the adapter reader then lacked
    "adapter-over-model-files": (["adapter_config.json", "adapter_model.safetensors",
                                  "model.safetensors"], ["adapter_model.safetensors"]),
    "adapter-bin": (["adapter_config.json", "adapter_model.bin"], ["adapter_model.bin"]),
    "adapter-without-adapter-files": (["adapter_config.json", "model.safetensors"], None),
    # without adapter_config.json no adapter is read: its factors are no model's weights
    "adapter-files-without-config": (["adapter_model.safetensors", "other.safetensors"],
                                     ["other.safetensors"]),
    "no-weights": (["config.json", "model.gguf"], None),
}


def make_dir(directory: Path, names: list[str], weights: list[str] | None) -> dict[str, int]:
    """`names` as files of distinct sizes (powers of two: a sum of sizes names its files),
    an index holding a weight_map of the expected shards; returns name -> size."""
    sizes: dict[str, int] = {}
    for i, name in enumerate(names):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".index.json"):
            path.write_text(json.dumps({"weight_map": {f"t{j}": w
                                                       for j, w in enumerate(weights or [])}}))
        elif name.endswith(".json"):
            path.write_text("{}")
        else:
            path.write_bytes(b"\0" * 2**i)
        sizes[name] = path.stat().st_size
    return sizes


@pytest.mark.parametrize(("names", "expected"), CASES.values(), ids=CASES.keys())
def test_the_rule(names: list[str], expected: list[str] | None) -> None:
    """Safetensors before .bin, one format only; an index, when there is one, is downloaded
    with its shards; every chosen name matches the offline patterns."""
    chosen = weight_files(names)
    assert (list(chosen.names) if chosen else None) == expected
    if chosen is not None:
        index = [n for n in names if n.endswith(".index.json") and n.startswith(
            "model" if chosen.format == "safetensors" else "pytorch_model")]
        assert chosen.files == sorted(chosen.names + tuple(index))
        assert all(any(fnmatchcase(n, p) for p in PATTERNS) for n in chosen.files)


@pytest.mark.parametrize(("names", "expected"), CASES.values(), ids=CASES.keys())
def test_size_download_and_reader_agree(tmp_path: Path, names: list[str],
                                        expected: list[str] | None) -> None:
    """For one directory: the controller sizes exactly the weights the worker downloads
    (model_files: the configs and index besides) and then reads (find_weight_files, told
    whether it reads an adapter as the worker is: adapter_config.json)."""
    directory = tmp_path / "model"
    sizes = make_dir(directory, names, expected)
    weights = expected or []
    sizer = Sizer(offline=True, default_bytes=1)
    assert sizer.size(ModelRow(str(directory), None, "", None)) == sum(sizes[n] for n in weights)
    adapter = is_adapter(names)
    if expected is None:
        with pytest.raises(PermanentModelError, match="unsupported format"):
            model_files(str(directory))
        with pytest.raises(PermanentModelError, match=r"no (adapter )?weights"):
            find_weight_files(directory, adapter=adapter)
        return
    downloaded = model_files(str(directory)).names
    assert [n for n in downloaded if n.endswith((".safetensors", ".bin"))] == weights
    assert [p.name for p in find_weight_files(directory, adapter=adapter)[1]] == weights


def test_an_index_without_its_shards_is_still_the_choice() -> None:
    """The index decides the format even when no file looks like its shards: the reader then
    says which shards are missing, rather than reading something else."""
    assert weight_files(["model.safetensors.index.json", "pytorch_model.bin"]) == WeightFiles(
        "safetensors", (), "model.safetensors.index.json")


@pytest.mark.parametrize(("names", "adapter", "expected"), [
    (["adapter_model.safetensors", "model.safetensors"], True, ["adapter_model.safetensors"]),
    (["adapter_config.json", "adapter_model.safetensors", "model.safetensors"], False,
     ["model.safetensors"]),
], ids=["told-an-adapter", "told-a-model"])
def test_the_reader_may_say_which(names: list[str], adapter: bool,
                                  expected: list[str]) -> None:
    """The worker's reader says whether it reads an adapter (the LoRA side) or a model (an
    adapter's base): that wins over adapter_config.json."""
    chosen = weight_files(names, adapter=adapter)
    assert chosen is not None and list(chosen.names) == expected
