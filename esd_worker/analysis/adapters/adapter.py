"""A peft adapter loaded for the streamed merge: its config, one update per module, the
full weights it saves (modules_to_save), and where each update goes in the base model."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

from esd_worker.analysis.adapters.builders import ALL_PARTS, BUILDERS, PARTS, Parts
from esd_worker.analysis.adapters.common import (
    ADAPTER_CONFIG,
    AdapterInfo,
    AdapterMatch,
    WeightUpdate,
    read_adapter_config,
)
from esd_worker.analysis.adapters.refusals import MERGED, check_supported
from esd_worker.analysis.layers import (
    EMBEDDING,
    EXPERT,
    LINEAR,
    LayerSpec,
    match_by_suffix,
    suffix_index,
)
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.errors import PermanentModelError

_PART_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    rf"(?P<part>{'|'.join(ALL_PARTS)})"
    r"(?:\.(?P<adapter>[^.]+?))??(?:\.weight)?$"
)
_SHARED_KEY = re.compile(r"^base_model\.(?P<part>vera_A|vera_B)(?:\.[^.]+)?$")
_SAVED_MODULE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)(?:\.modules_to_save\.[^.]+)?\.weight$"
)


class PeftAdapter:
    """A loaded peft adapter (LoRA, DoRA, AdaLoRA, IA3, LoHa, LoKr, VeRA, OFT, BOFT), small
    enough to hold in memory: only the adapter's own tensors, never a merged weight."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config = read_adapter_config(directory)
        check_supported(self.config)
        self.peft_type = str(self.config["peft_type"]).upper()
        self.fan_in_fan_out = bool(self.config.get("fan_in_fan_out", False))
        self.use_rslora = bool(self.config.get("use_rslora", False))
        self.replaced: dict[str, torch.Tensor] = {}  # modules_to_save: full weights
        with Checkpoint(directory, adapter=True) as ckpt:
            keys = ckpt.keys()
            tensors = {k: ckpt.read(k) for k in keys}
        parts, shared = self._split(tensors)
        self.modules: dict[str, WeightUpdate] = BUILDERS[self.peft_type](
            self.config, parts, shared
        )
        if not self.modules and not self.replaced:
            raise PermanentModelError(
                f"adapter in {directory} holds no {MERGED[self.peft_type]} weights"
            )

    def _split(self, tensors: dict[str, torch.Tensor]
               ) -> tuple[Parts, dict[str, torch.Tensor]]:
        """Group the method's tensors by module; keep saved full weights; refuse tensors of
        another method (an adapter_config.json that does not describe these weights)."""
        parts: Parts = {}
        shared: dict[str, torch.Tensor] = {}
        own = PARTS[self.peft_type]
        for key, tensor in tensors.items():
            if key.endswith(".bias"):
                # lora_bias (and saved biases) change a layer's bias, not its weight matrix:
                # nothing to merge into the spectrum.
                continue
            m = _PART_KEY.match(key)
            if m:
                if m["part"] not in own and m["part"] != "lora_magnitude_vector":
                    raise PermanentModelError(
                        f"bad adapter: {ADAPTER_CONFIG} says {self.peft_type}, but its weights "
                        f"hold {key}, a part of another method"
                    )
                parts.setdefault(m["module"], {})[m["part"]] = tensor
                continue
            s = _SHARED_KEY.match(key)
            if s:
                shared[s["part"]] = tensor
                continue
            saved = _SAVED_MODULE.match(key)
            if saved:
                self.replaced[saved["module"]] = tensor
        if self.peft_type != "LORA":
            for name, p in parts.items():
                if "lora_magnitude_vector" in p:
                    raise PermanentModelError(
                        f"bad adapter: {self.peft_type} module {name} holds DoRA magnitudes"
                    )
        return parts, shared

    @property
    def use_dora(self) -> bool:
        return self.peft_type == "LORA" and bool(self.config.get("use_dora", False))

    @property
    def info(self) -> AdapterInfo:
        c = self.config
        r = c.get("init_r") if self.peft_type == "ADALORA" else c.get("r")
        alpha = c.get("alpha") if self.peft_type in ("LOHA", "LOKR") else c.get("lora_alpha")
        if self.peft_type in ("IA3", "BOFT", "VERA", "OFT"):
            alpha = None
        if self.peft_type in ("IA3", "BOFT") or not r:
            r = None
        return AdapterInfo(
            peft_type="DORA" if self.use_dora else self.peft_type,
            base_model=c.get("base_model_name_or_path"),
            r=int(r) if r is not None else None,
            lora_alpha=float(alpha) if alpha is not None else None,
            use_rslora=self.use_rslora,
            fan_in_fan_out=self.fan_in_fan_out,
        )

    def match(self, layers: list[LayerSpec], checkpoint_keys: Iterable[str]) -> AdapterMatch:
        """Pair adapter modules with the base's tensors, by module path suffix.

        A module that is an analysed layer updates that layer's checkpoint tensor (for a
        tied lm_head: the embedding's). A module that is only a checkpoint tensor (not an
        analysed layer) still updates the layers that read the same tensor. A module that
        is neither means a wrong base model: an error. So does a method peft never applies
        to the layer's type (e.g. LoHa on GPT-2's Conv1D).
        """
        by_name = {spec.name: spec for spec in layers}
        name_index = suffix_index(by_name)
        key_index = suffix_index(checkpoint_keys)
        keys_read = {spec.key for spec in layers}
        order = {spec.name: i for i, spec in enumerate(layers)}
        merges: dict[str, list[tuple[int, WeightUpdate]]] = {}
        unanalysed: list[str] = []
        for name, module in self.modules.items():
            layer = match_by_suffix(name, name_index, min_parts=1)
            target_type: str | None
            position = -1  # no layer: a checkpoint tensor (an embedding) comes first
            if layer is not None:
                spec = by_name[layer]
                key, target_type, position = spec.key, spec.layer_type, order[layer]
                if target_type == EXPERT and "[" not in key:
                    # An expert stored as its own matrix was an nn.Linear where the adapter
                    # was made (transformers 4's Mixtral): merged as one. A slice of a 3-D
                    # stack stays an Expert, which no peft LoRA module adapts.
                    target_type = LINEAR
            else:
                found = match_by_suffix(f"{name}.weight", key_index)
                if found is None:
                    raise PermanentModelError(
                        f"adapter module {name} matches no weight of the base model: "
                        "wrong base model?"
                    )
                key, target_type = found, EMBEDDING if module.embedding else None
                if key not in keys_read:
                    unanalysed.append(name)
                    continue
            targeted = module.targeted(target_type)
            targeted.check_target()
            merges.setdefault(key, []).append((position, targeted))
        replaced: dict[str, torch.Tensor] = {}
        for name, tensor in self.replaced.items():
            layer = match_by_suffix(name, name_index, min_parts=1)
            if layer is not None:
                replaced[layer] = tensor
        # Two updates of one tensor (tied modules) in the model's order, as peft merges
        # them: it matters for the methods that multiply (DoRA, IA3, OFT, BOFT).
        ordered = {key: [u for _, u in sorted(mods, key=lambda m: m[0])]
                   for key, mods in merges.items()}
        return AdapterMatch(ordered, replaced, unanalysed)


