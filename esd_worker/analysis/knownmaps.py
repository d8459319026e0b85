"""Layer maps of well-known architectures from config.json and the checkpoint's names alone: no
transformers import, no meta model. A cold worker's first Llama-family model otherwise waits
~15 s (measured on an H100 host for a 7B model: the import and the meta model) before its
layer map is known.

Owns the table of known architectures (the module paths of one block, in the model's module
order) and the check that a checkpoint is exactly what the table says: every matrix it holds
(any tensor of two or more dimensions, whatever its name) is one the map names. Anything else
(another architecture, a quantized checkpoint, a prefix, an extra or a missing matrix, a tied
head that the checkpoint also stores, a config.json whose block count is not the stored one)
gives None, and discovery builds the model as for every other architecture
(esd_worker.analysis.layers), which accounts for each stored matrix or fails the model.
Where the table answers, its map is the one transformers' meta model gives, layer for layer
(tests/esd_worker/test_knownmaps.py builds both for every entry).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esd_worker.analysis.accounting import classify
from esd_worker.analysis.layers import EMBEDDING, LINEAR, LayerMap, LayerSpec
from esd_worker.analysis.weights import Tensors

log = logging.getLogger(__name__)

_DECODER_BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Known:
    """One architecture: the Linear modules of block i (model.layers.i.<path>) in module
    order, and the config's tie_word_embeddings when config.json does not say."""

    block: tuple[str, ...]
    tie_default: bool


# transformers' LlamaForCausalLM and the classes that copy its layout (named_modules order:
# model.embed_tokens, each block's attention then MLP projections, model.norm, lm_head).
KNOWN: dict[str, Known] = {
    "LlamaForCausalLM": Known(_DECODER_BLOCK, tie_default=False),
    "MistralForCausalLM": Known(_DECODER_BLOCK, tie_default=False),
    "Qwen2ForCausalLM": Known(_DECODER_BLOCK, tie_default=False),
}

EMBED, HEAD = "model.embed_tokens", "lm_head"


def known_layer_map(directory: Path, checkpoint: Tensors, *, include_embeddings: bool
                    ) -> LayerMap | None:
    """The layer map of a known architecture whose checkpoint holds exactly its matrices
    under their own names, or None (discovery builds the model)."""
    config = _config(directory)
    arch = _architecture(config)
    if config is None or arch is None:
        return None
    known = KNOWN[arch]
    blocks = config.get("num_hidden_layers")
    if not isinstance(blocks, int) or blocks < 0:
        return None
    tie = config.get("tie_word_embeddings", known.tie_default)
    names = [f"model.layers.{i}.{path}" for i in range(blocks) for path in known.block]
    want = {f"{name}.weight" for name in names} | {f"{EMBED}.weight"}
    # Every matrix stored, whatever its name (not matrix_keys, which passes over names like
    # norms'): one the table does not name sends the model to discovery, which accounts
    # for it or fails the model (esd_worker.analysis.layers.map_modules).
    have = {key for key in checkpoint.keys()  # noqa: SIM118 - Checkpoint is not a Mapping
            if len(checkpoint.shape(key)) >= 2}
    head = f"{HEAD}.weight"
    # Tied, the head is the embedding's, as transformers loads it: a stored copy would be a
    # weight the map leaves out, which the model path reports (so it decides then).
    if tie is True and head not in have:
        head_key = f"{EMBED}.weight"
    elif tie is False and head in have:
        head_key, want = head, want | {head}
    else:
        return None
    if have != want or any(len(checkpoint.shape(key)) != 2 for key in have):
        return None
    layers = [LayerSpec(EMBED, f"{EMBED}.weight", EMBEDDING, checkpoint.shape(f"{EMBED}.weight"))
              ] if include_embeddings else []
    layers += [LayerSpec(name, f"{name}.weight", LINEAR, checkpoint.shape(f"{name}.weight"))
               for name in names]
    layers.append(LayerSpec(HEAD, head_key, LINEAR, checkpoint.shape(head_key)))
    log.info("layer map of %s from config.json and the checkpoint's names (no model built)",
             arch)
    used = {spec.key for spec in layers}
    rules = {key: classify(checkpoint, key, name=key, include_embeddings=include_embeddings,
                           stack=False).rule
             for key in checkpoint.keys() if key not in used}  # noqa: SIM118
    return LayerMap(layers, "architecture", arch,
                    skipped={key: rule for key, rule in rules.items() if rule is not None})


def _config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _architecture(config: dict[str, Any] | None) -> str | None:
    """The one known architecture config.json names, with nothing that changes its
    tensors (quantization, remote code)."""
    if config is None or "quantization_config" in config or "auto_map" in config:
        return None
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in KNOWN:
        return None
    return str(archs[0])
