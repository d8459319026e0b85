"""Each zoo entry's parameters as its own library holds them (tests.zoo.library's units):
read from the saved files by the library that owns the format, never by the worker's code."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from tests.zoo import catalog
from tests.zoo.catalog import Entry
from tests.zoo.library import Unit, module_units, tensor_units
from tests.zoo.quantized import dequantized


def library_units(entry: Entry, *, conv_norm: float) -> list[Unit]:
    """The entry's units (one per parameter of two or more dimensions, one per expert)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return _READERS[entry.library](entry, conv_norm)


def _transformers_model(directory: Path) -> torch.nn.Module:
    """The class config.json names (AutoModel when it names none), loaded in float64."""
    import transformers

    config = json.loads((directory / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    loader = getattr(transformers, arch, None) or transformers.AutoModel
    model: torch.nn.Module = loader.from_pretrained(str(directory), dtype=torch.float64)
    return model


def _transformers(entry: Entry, conv_norm: float) -> list[Unit]:
    return module_units(_transformers_model(entry.path), conv_norm=conv_norm)


def _peft(entry: Entry, conv_norm: float) -> list[Unit]:
    from tests.zoo.adapters import merged

    assert entry.base is not None
    return module_units(merged(entry.base, entry.path), conv_norm=conv_norm)


def _sentence(entry: Entry, conv_norm: float) -> list[Unit]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(entry.path), device="cpu").double()
    return module_units(model, conv_norm=conv_norm)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(path)))


def _diffusers(entry: Entry, conv_norm: float) -> list[Unit]:
    """text_encoder/ by transformers; unet/ and vae/ as stored (diffusers would load these
    tensors unchanged into modules of these names; it is not installed)."""
    found = module_units(_transformers_model(entry.path / "text_encoder"), conv_norm=conv_norm,
                         prefix="text_encoder/")
    for part in ("unet", "vae"):
        tensors = _stored(entry.path / part / "diffusion_pytorch_model.safetensors")
        found += tensor_units(tensors, conv_norm=conv_norm, prefix=f"{part}/")
    return found


def _gguf(entry: Entry, conv_norm: float) -> list[Unit]:
    import gguf

    tensors = {}
    for path in sorted(entry.path.glob("*.gguf")):
        for t in gguf.GGUFReader(str(path)).tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            tensors[t.name] = torch.from_numpy(values.astype("float64"))
    return tensor_units(tensors, conv_norm=conv_norm)


def _quantized(entry: Entry, conv_norm: float) -> list[Unit]:
    stored = {}
    for path in sorted(entry.path.glob("*.safetensors")):
        stored.update(_stored(path))
    return tensor_units(dequantized(stored), conv_norm=conv_norm)


_READERS = {
    catalog.TRANSFORMERS: _transformers,
    catalog.PEFT: _peft,
    catalog.SENTENCE: _sentence,
    catalog.DIFFUSERS: _diffusers,
    catalog.GGUF: _gguf,
    catalog.FORMULA: _quantized,
}
