"""The zoo: every entry, how it is built and how its library reads it; `build_zoo(root)`
builds them all (seconds each) and writes the worker's model list.

An entry that fails to build is kept with `not_built` saying why: the table shows it, and
the acceptance test fails on it unless the entry is `optional` (a package that may not
install on every machine, such as bitsandbytes).
"""

from __future__ import annotations

import csv
import logging
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tests.zoo import adapters, formats, quantized
from tests.zoo.hf import SPECS, Spec, build_hf

FORMAT = "format"
COMPONENTS = "components"
QUANTIZED = "quantized"
ADAPTER = "adapter"

# How the checker reads an entry's reference (tests.zoo.references).
TRANSFORMERS = "transformers"
PEFT = "peft"
SENTENCE = "sentence-transformers"
DIFFUSERS = "diffusers-folder"
GGUF = "gguf"
FORMULA = "dequantized by the scheme's formula"


@dataclass(frozen=True)
class Entry:
    """One model of the zoo. `library`: how its reference is read; `base`: an adapter's base
    (listed as source_model with relation `adapter`); `refusal`: why the worker is expected
    to refuse it (None: expected analysed); `not_built`: why the build failed."""

    name: str
    family: str
    path: Path
    library: str
    base: Path | None = None
    refusal: str | None = None
    optional: bool = False
    not_built: str | None = None


Builder = Callable[[Path, Path], Path]  # (directory, scratch) -> directory


def _plan(root: Path) -> list[tuple[Entry, Builder]]:
    plan: list[tuple[Entry, Builder]] = []
    for s in SPECS:
        plan.append((Entry(s.name, s.family, root / s.name, TRANSFORMERS), _hf_builder(s)))
    llama = root / "llama"
    plan += [
        (Entry("llama-bin", FORMAT, root / "llama-bin", TRANSFORMERS),
         lambda d, _s: formats.build_bin(d)),
        (Entry("qwen2-sharded", FORMAT, root / "qwen2-sharded", TRANSFORMERS),
         lambda d, _s: formats.build_sharded(d)),
        (Entry("llama-tied", FORMAT, root / "llama-tied", TRANSFORMERS),
         lambda d, _s: formats.build_tied(d)),
        (Entry("mistral-bf16", FORMAT, root / "mistral-bf16", TRANSFORMERS),
         lambda d, _s: formats.build_bf16(d)),
        (Entry("bert-no-architectures", FORMAT, root / "bert-no-architectures", TRANSFORMERS),
         lambda d, _s: formats.build_bert_no_architectures(d)),
        (Entry("gguf-f32-f16", FORMAT, root / "gguf-f32-f16", GGUF),
         lambda d, _s: formats.build_gguf(d, quantized=False)),
        (Entry("gguf-q8_0-q4_0", FORMAT, root / "gguf-q8_0-q4_0", GGUF),
         lambda d, _s: formats.build_gguf(d, quantized=True)),
        (Entry("gguf-moe", FORMAT, root / "gguf-moe", GGUF),
         lambda d, _s: formats.build_gguf(d, quantized=False, experts=4)),
        (Entry("sentence-transformers", COMPONENTS, root / "sentence-transformers", SENTENCE),
         lambda d, s: formats.build_sentence_transformer(d, scratch=s)),
        (Entry("diffusers-pipeline", COMPONENTS, root / "diffusers-pipeline", DIFFUSERS),
         lambda d, _s: formats.build_diffusers(d)),
        (Entry("fp8-block", QUANTIZED, root / "fp8-block", FORMULA),
         lambda d, s: quantized.build_fp8_block(d, scratch=s)),
        (Entry("fp8-block-deepseek_v3", QUANTIZED, root / "fp8-block-deepseek_v3", FORMULA),
         lambda d, s: quantized.build_fp8_block(d, scratch=s, moe=True)),
        (Entry("mxfp4-gpt_oss", QUANTIZED, root / "mxfp4-gpt_oss", FORMULA),
         lambda d, _s: quantized.build_mxfp4(d)),
        (Entry("fp8-tensor", QUANTIZED, root / "fp8-tensor", FORMULA),
         lambda d, _s: quantized.build_fp8_tensor(d)),
        (Entry("compressed-tensors-fp8", QUANTIZED, root / "compressed-tensors-fp8", FORMULA),
         lambda d, _s: quantized.build_compressed_fp8(d)),
        (Entry("compressed-tensors-int4", QUANTIZED, root / "compressed-tensors-int4", FORMULA),
         lambda d, _s: quantized.build_compressed_int4(d)),
        (Entry("gptq-int4", QUANTIZED, root / "gptq-int4", FORMULA),
         lambda d, _s: quantized.build_gptq(d)),
        (Entry("bnb-nf4", QUANTIZED, root / "bnb-nf4", FORMULA, optional=True),
         lambda d, s: quantized.build_bnb_nf4(d, scratch=s)),
    ]
    for method in adapters.METHODS:
        entry = Entry(f"peft-{method}", ADAPTER, root / f"peft-{method}", PEFT, base=llama,
                      refusal=adapters.REFUSED.get(method))
        plan.append((entry, _adapter_builder(method, llama)))
    return plan


def _hf_builder(s: Spec) -> Builder:
    return lambda directory, _scratch: build_hf(s, directory)


def _adapter_builder(method: str, base: Path) -> Builder:
    return lambda directory, _scratch: adapters.build_adapter(method, base, directory)


def build_zoo(root: Path) -> list[Entry]:
    """Every entry built under `root` (models in root/<name>, builders' scratch in
    root/_scratch), in plan order; a failed build is an entry with `not_built`."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    scratch = root / "_scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    entries = []
    for entry, build in _plan(root):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build(entry.path, scratch)
        except Exception as e:  # kept, shown: the test fails on it unless optional
            last = traceback.extract_tb(e.__traceback__)[-1]
            why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            entries.append(replace(entry, not_built=f"{why} ({last.filename}:{last.lineno})"))
            continue
        entries.append(entry)
    return entries


def write_model_list(entries: list[Entry], path: Path) -> Path:
    """The worker's --models CSV: every built entry; an adapter names its base."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", "base_model_relation", "source_model"])
        for e in entries:
            if e.not_built is None:
                writer.writerow([str(e.path), "adapter" if e.base else "",
                                 str(e.base) if e.base else ""])
    return path
