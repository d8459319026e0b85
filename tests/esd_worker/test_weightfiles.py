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
    GGUF_BITS,
    PATTERNS,
    ModelWeights,
    WeightFiles,
    gguf_quant,
    is_adapter,
    model_weights,
    weight_files,
    weight_names,
)
from esd_worker.fetch.resolve import model_files

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BIN_SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
DIFFUSERS_SHARDS = ["diffusion_pytorch_model-00001-of-00002.safetensors",
                    "diffusion_pytorch_model-00002-of-00002.safetensors"]

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
    "no-weights": (["config.json", "model.onnx", "flax_model.msgpack"], None),
    # diffusers' names, in a component folder or at the top of a one-model repo
    "diffusers-single-over-variants-and-bin": (
        ["config.json", "diffusion_pytorch_model.safetensors",
         "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.bin"],
        ["diffusion_pytorch_model.safetensors"]),
    "diffusers-bin": (["config.json", "diffusion_pytorch_model.bin",
                       "diffusion_pytorch_model.fp16.bin"], ["diffusion_pytorch_model.bin"]),
    "diffusers-sharded-not-its-fp16-shards": (
        ["diffusion_pytorch_model.safetensors.index.json", *DIFFUSERS_SHARDS,
         "diffusion_pytorch_model.safetensors.index.fp16.json",
         "diffusion_pytorch_model-00001-of-00002.fp16.safetensors"], DIFFUSERS_SHARDS),
    "index-shards-not-their-variants": (
        ["model.safetensors.index.json", *SHARDS, "model-00001-of-00002.fp16.safetensors"],
        SHARDS),
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
        index = [n for n in names if n.endswith(f".{chosen.format}.index.json")]
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


# --- how a repo is laid out: components in folders, GGUF ------------------------------------

ST_DENSE = ["2_Dense/config.json", "2_Dense/model.safetensors", "2_Dense/pytorch_model.bin"]
GGUF_SPLIT = ["Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"]

# names -> (kind, [(folder, the weights in it)]) or None. Each case is one repo's files.
LAYOUTS: dict[str, tuple[list[str], tuple[str, list[tuple[str, list[str]]]] | None]] = {
    "diffusers-pipeline": (
        ["model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
         "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_pytorch_model.bin",
         "text_encoder/config.json", "text_encoder/model.safetensors",
         "text_encoder/pytorch_model.bin", "vae/config.json", "vae/diffusion_pytorch_model.bin",
         "scheduler/scheduler_config.json", "tokenizer/vocab.json",
         "safety_checker/config.json", "safety_checker/pytorch_model.bin",
         "v1-5-pruned-emaonly.safetensors", "v1-5-pruned.ckpt"],
        ("diffusers", [("safety_checker", ["pytorch_model.bin"]),
                       ("text_encoder", ["model.safetensors"]),
                       ("unet", ["diffusion_pytorch_model.safetensors"]),
                       ("vae", ["diffusion_pytorch_model.bin"])])),
    "diffusers-sharded-component": (
        ["model_index.json", "transformer/config.json",
         "transformer/diffusion_pytorch_model.safetensors.index.json",
         *[f"transformer/{n}" for n in DIFFUSERS_SHARDS],
         "transformer/diffusion_pytorch_model-00001-of-00002.fp16.safetensors",
         "text_encoder_2/model.safetensors.index.json",
         *[f"text_encoder_2/{n}" for n in SHARDS], "vae/diffusion_pytorch_model.safetensors"],
        ("diffusers", [("text_encoder_2", SHARDS), ("transformer", DIFFUSERS_SHARDS),
                       ("vae", ["diffusion_pytorch_model.safetensors"])])),
    "model-index-without-component-weights": (
        ["model_index.json", "sd_xl_base.safetensors", "scheduler/scheduler_config.json"],
        ("model", [("", ["sd_xl_base.safetensors"])])),
    "sentence-transformers-dense": (
        ["modules.json", "config.json", "model.safetensors", "pytorch_model.bin",
         "1_Pooling/config.json", *ST_DENSE, "onnx/model.onnx", "onnx/model.safetensors",
         "openvino/openvino_model.bin"],
        ("sentence-transformers", [("", ["model.safetensors"]),
                                   ("2_Dense", ["model.safetensors"])])),
    # most sentence-transformers repos: no module holds weights, the plain model as before
    "sentence-transformers-plain": (
        ["modules.json", "config.json", "model.safetensors", "1_Pooling/config.json",
         "2_Normalize/.keep"], ("model", [("", ["model.safetensors"])])),
    "sentence-transformers-old-layout": (
        ["modules.json", "0_Transformer/config.json", "0_Transformer/pytorch_model.bin",
         "1_Pooling/config.json"],
        ("sentence-transformers", [("0_Transformer", ["pytorch_model.bin"])])),
    "gguf-highest-precision": (
        ["README.md", "m-Q4_K_M.gguf", "m-Q6_K.gguf", "m-Q8_0.gguf", "m-IQ4_XS.gguf",
         "mmproj-m-f32.gguf"], ("gguf", [("", ["m-Q8_0.gguf"])])),
    "gguf-f32-over-f16": (["m-BF16.gguf", "m-f32.gguf", "m-F16.gguf"],
                          ("gguf", [("", ["m-f32.gguf"])])),
    "gguf-f16-bf16-tie-by-name": (["m-F16.gguf", "m-BF16.gguf"],
                                  ("gguf", [("", ["m-BF16.gguf"])])),
    "gguf-split-is-one-set": (
        [*GGUF_SPLIT, "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
         "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", "m-Q6_K.gguf"], ("gguf", [("", GGUF_SPLIT)])),
    "gguf-incomplete-split-last": (["m-F16-00001-of-00002.gguf", "m-Q4_0.gguf"],
                                   ("gguf", [("", ["m-Q4_0.gguf"])])),
    "gguf-without-a-tag-last": (["model.gguf", "model-IQ2_XXS.gguf"],
                                ("gguf", [("", ["model-IQ2_XXS.gguf"])])),
    "gguf-beside-safetensors-not-read": (["config.json", "model.safetensors", "m-F32.gguf"],
                                         ("model", [("", ["model.safetensors"])])),
    "adapter-whatever-else": (
        ["adapter_config.json", "adapter_model.safetensors", "model_index.json",
         "unet/diffusion_pytorch_model.safetensors", "m-F16.gguf"],
        ("adapter", [("", ["adapter_model.safetensors"])])),
    "deeper-and-hidden-folders-never": (
        ["model_index.json", "unet/sub/diffusion_pytorch_model.safetensors",
         ".cache/m-F16.gguf", "a/b/m-F16.gguf"], None),
}


def make_layout(directory: Path, names: list[str]) -> dict[str, int]:
    """`names` as files of distinct sizes; an index's weight_map names the shards beside it
    that are not variants (as save_pretrained writes it). Returns name -> size."""
    sizes: dict[str, int] = {}
    for i, name in enumerate(names):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".index.json"):
            fmt = name.removesuffix(".index.json").rsplit(".", 1)[-1]
            shards = [n.rsplit("/", 1)[-1] for n in names if n.endswith(f"-of-00002.{fmt}")
                      and n.rsplit("/", 1)[0] == name.rsplit("/", 1)[0]]
            path.write_text(json.dumps({"weight_map": {f"t{j}": s
                                                       for j, s in enumerate(shards)}}))
        elif name.endswith(".json"):
            path.write_text("{}")
        else:
            path.write_bytes(b"\0" * 2**i)
        sizes[name] = path.stat().st_size
    return sizes


def _shape(chosen: ModelWeights | None) -> tuple[str, list[tuple[str, list[str]]]] | None:
    if chosen is None:
        return None
    return chosen.kind, [(p.folder, list(p.weights.names)) for p in chosen.parts]


@pytest.mark.parametrize(("names", "expected"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_layout_rule(names: list[str], expected: tuple[str, list[tuple[str, list[str]]]]
                         | None) -> None:
    """Which parts a repo's weights are, and the files that are downloaded for them: every
    one matches the offline patterns (a cached snapshot is asked for these)."""
    chosen = model_weights(names)
    assert _shape(chosen) == expected
    if chosen is not None:
        assert all(any(fnmatchcase(n, p) for p in PATTERNS) for n in chosen.files)
        assert chosen.names == sorted(f"{folder}/{n}" if folder else n
                                      for folder, found in expected[1] for n in found)
        assert weight_names(names) == chosen.names


@pytest.mark.parametrize(("names", "expected"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts_size_download_and_read_alike(
        tmp_path: Path, names: list[str],
        expected: tuple[str, list[tuple[str, list[str]]]] | None) -> None:
    """For one directory: the controller sizes the weights of every part (its folders too),
    the worker downloads exactly them (with each part's config and the layout's file), and
    each part's reader (a Checkpoint of the part's folder, as open_components opens it) reads
    the same files."""
    directory = tmp_path / "model"
    sizes = make_layout(directory, names)
    chosen = model_weights(names)
    weights = chosen.names if chosen is not None else []
    sizer = Sizer(offline=True, default_bytes=1)
    assert sizer.size(ModelRow(str(directory), None, "", None)) == sum(sizes[n] for n in weights)
    if chosen is None:
        with pytest.raises(PermanentModelError, match="unsupported format"):
            model_files(str(directory))
        return
    downloaded = model_files(str(directory)).names
    assert [n for n in downloaded if n.endswith((".safetensors", ".bin", ".gguf"))] == weights
    if chosen.marker is not None:
        assert chosen.marker in downloaded
    for part in chosen.parts:
        config = part.prefix + "config.json"
        assert (config in downloaded) == (config in names and chosen.kind != "gguf")
        if part.weights.format != "gguf":
            folder = directory / part.folder
            found = find_weight_files(folder, adapter=chosen.kind == "adapter")[1]
            assert [p.name for p in found] == list(part.weights.names)


def test_gguf_is_no_folder_checkpoint() -> None:
    """weight_files (a folder's checkpoint, what Checkpoint reads) never takes GGUF; the
    model's layout does, when nothing else holds weights."""
    assert weight_files(["config.json", "model.gguf"]) is None
    assert _shape(model_weights(["config.json", "model.gguf"])) == (
        "gguf", [("", ["model.gguf"])])


@pytest.mark.parametrize(("name", "tag"), [
    ("Meta-Llama-3-8B-Instruct.Q4_K_M.gguf", "Q4_K_M"), ("llama-2-7b.Q4_0.gguf", "Q4_0"),
    ("phi-3-f16.gguf", "F16"), ("x.fp32.gguf", "F32"), ("gemma-2-BF16.gguf", "BF16"),
    ("Qwen2.5-7B-Instruct-Q4_K_L.gguf", "Q4_K"), ("m-IQ4_XS.gguf", "IQ4_XS"),
    ("m-q3_k_s.gguf", "Q3_K_S"), ("m-Q4_0_4_4.gguf", "Q4_0"),
    ("Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00009.gguf", "Q4_K_M"), ("phi-q4.gguf", None),
    ("model.gguf", None),
])
def test_gguf_quant_tags(name: str, tag: str | None) -> None:
    assert gguf_quant(name) == tag


def test_gguf_precision_order() -> None:
    """The documented order: F32 > F16 = BF16 > Q8_0 > Q6_K > Q5_K > Q4_K > Q3_K > Q2_K."""
    order = ["F32", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L",
             "Q3_K_M", "Q3_K_S", "Q2_K", "IQ1_S"]
    bits = [GGUF_BITS[t] for t in order]
    assert bits == sorted(bits, reverse=True) and len(set(bits)) == len(bits)
    assert GGUF_BITS["BF16"] == GGUF_BITS["F16"]


@pytest.mark.parametrize(("names", "chosen"), [
    (["model.fp16.safetensors", "model.ema.safetensors"], ["model.fp16.safetensors"]),
    (["model.ema.safetensors"], ["model.ema.safetensors"]),
    (["diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.non_ema.safetensors"],
     ["diffusion_pytorch_model.fp16.safetensors"]),
    (["weights.bf16.safetensors", "weights.fp32.safetensors"], ["weights.fp32.safetensors"]),
    (["a.safetensors", "b.safetensors"], ["a.safetensors", "b.safetensors"]),  # not variants
])
def test_variants_of_one_file_give_one(names: list[str], chosen: list[str]) -> None:
    """Variants of one name are copies of the same tensors: one is read (plain, then full,
    then half precision; an EMA copy only alone), never two."""
    found = weight_files(names)
    assert found is not None and list(found.names) == chosen
