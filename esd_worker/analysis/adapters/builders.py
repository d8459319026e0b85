"""From an adapter's saved tensors, grouped by module, to one update per module, per method."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from esd_worker.analysis.adapters.common import ADAPTER_CONFIG, WeightUpdate, pattern_value
from esd_worker.analysis.adapters.lowrank import LoraModule, VeraModule
from esd_worker.analysis.adapters.lycoris import (
    LOHA_PARTS,
    LOKR_PARTS,
    LohaModule,
    LokrModule,
    check_lycoris_parts,
)
from esd_worker.analysis.adapters.orthogonal import BoftModule, OftModule
from esd_worker.analysis.adapters.scaling import Ia3Module, is_feedforward
from esd_worker.core.errors import PermanentModelError, UnsupportedAdapterError

Parts = dict[str, dict[str, torch.Tensor]]  # module name → part name → tensor
Builder = Callable[[dict[str, Any], Parts, dict[str, torch.Tensor]], dict[str, WeightUpdate]]

# The tensors each method saves per module (`<module>.<part>[.weight]`).
PARTS: dict[str, tuple[str, ...]] = {
    "LORA": ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
             "lora_magnitude_vector"),
    "ADALORA": ("lora_A", "lora_B", "lora_E"),
    "IA3": ("ia3_l",),
    "LOHA": LOHA_PARTS,
    "LOKR": LOKR_PARTS,
    "VERA": ("vera_lambda_b", "vera_lambda_d"),
    "OFT": ("oft_R", "oft_embedding_R"),
    "BOFT": ("boft_R", "boft_s"),
}
ALL_PARTS = sorted({p for parts in PARTS.values() for p in parts}, key=len, reverse=True)


def _lora(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
          ) -> dict[str, WeightUpdate]:
    use_rslora = bool(config.get("use_rslora", False))
    use_dora = bool(config.get("use_dora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        magnitude = p.get("lora_magnitude_vector")
        if magnitude is not None and not use_dora:
            # Merged as plain LoRA (what peft does with this config), the magnitudes the
            # adapter was trained with would be dropped without a word.
            raise PermanentModelError(
                f"bad adapter: its weights hold DoRA magnitudes ({name}.lora_magnitude_vector) "
                f"though {ADAPTER_CONFIG} does not set use_dora: config and weights disagree"
            )
        if use_dora and magnitude is None:
            raise PermanentModelError(
                f"bad adapter: DoRA module {name} (use_dora) has no lora_magnitude_vector"
            )
        embedding = "lora_embedding_A" in p or "lora_embedding_B" in p
        a = p.get("lora_embedding_A" if embedding else "lora_A")
        b = p.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None:
            raise PermanentModelError(f"adapter module {name} has lora_A or lora_B missing")
        check_ranks(name, a, b, embedding=embedding)
        r = a.shape[0]
        configured_r = pattern_value(rank_pattern, name, config.get("r", r))
        if int(configured_r) != r:
            raise PermanentModelError(
                f"adapter module {name}: lora_A has rank {r}, config says r={configured_r}"
            )
        alpha = float(pattern_value(alpha_pattern, name, config.get("lora_alpha", r)))
        scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        modules[name] = LoraModule(name, a, b, scale, embedding, magnitude=magnitude)
    return modules


def check_ranks(name: str, a: torch.Tensor, b: torch.Tensor, *, embedding: bool) -> None:
    """A bad adapter (PermanentModelError naming the module and both shapes) unless B @ A
    exists: A is (r, in[, kh, kw]), B is (out, r[, 1, 1]), the same r and as many dims."""
    if a.dim() >= 2 and a.dim() == b.dim() and a.shape[0] == b.shape[1]:
        return
    part_a, part_b = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    raise PermanentModelError(
        f"bad adapter: module {name} has {part_a} of shape {tuple(a.shape)} and {part_b} of "
        f"shape {tuple(b.shape)}: their ranks disagree ({part_a} dimension 0 must equal "
        f"{part_b} dimension 1)"
    )


def _adalora(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
             ) -> dict[str, WeightUpdate]:
    """B @ (A ⊙ E) · scaling / (ranknum + 1e-5): ranknum is init_r (peft does not save it and
    keeps it after rank_pattern prunes ranks), scaling lora_alpha (r when alpha ≤ 0)."""
    ranknum = float(config.get("init_r", 12))
    alpha = float(config.get("lora_alpha", 8))
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        a, b, e = p.get("lora_A"), p.get("lora_B"), p.get("lora_E")
        if a is None or b is None or e is None:
            raise PermanentModelError(
                f"bad adapter: AdaLoRA module {name} has lora_A, lora_B or lora_E missing"
            )
        check_ranks(name, a, b, embedding=False)
        if e.numel() != a.shape[0]:
            raise PermanentModelError(
                f"bad adapter: AdaLoRA module {name} has lora_E of shape {tuple(e.shape)} for "
                f"lora_A of shape {tuple(a.shape)}"
            )
        scaling = alpha if alpha > 0 else float(a.shape[0])
        # float32 x float32 is exact in float64: the product rounds only to the work dtype.
        folded = a.double() * e.double().reshape(-1, 1)
        modules[name] = LoraModule(name, folded, b, scaling / (ranknum + 1e-5))
    return modules


def _ia3(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
         ) -> dict[str, WeightUpdate]:
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        vector = p["ia3_l"]
        feedforward = is_feedforward(config, name)
        if vector.dim() == 2 and vector.numel() > 1 and (vector.shape[0] == 1) != feedforward:
            raise PermanentModelError(
                f"bad adapter: IA3 module {name} has ia3_l of shape {tuple(vector.shape)}, but "
                f"feedforward_modules {'names' if feedforward else 'does not name'} it"
            )
        modules[name] = Ia3Module(name, vector, feedforward)
    return modules


def _lycoris(kind: str) -> Builder:
    cls = LohaModule if kind == "LoHa" else LokrModule

    def build(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
              ) -> dict[str, WeightUpdate]:
        modules: dict[str, WeightUpdate] = {}
        for name, p in parts.items():
            r = int(pattern_value(config.get("rank_pattern") or {}, name, config.get("r", 8)))
            alpha = float(pattern_value(config.get("alpha_pattern") or {}, name,
                                        config.get("alpha", 8)))
            check_lycoris_parts(name, kind, p, r)
            modules[name] = cls(name, p, alpha / r)
        return modules

    return build


def _vera(config: dict[str, Any], parts: Parts, shared: dict[str, torch.Tensor]
          ) -> dict[str, WeightUpdate]:
    vera_a, vera_b = shared.get("vera_A"), shared.get("vera_B")
    if vera_a is None or vera_b is None:
        raise PermanentModelError(
            "bad adapter: a VeRA adapter saved with save_projection holds no base_model.vera_A "
            "or base_model.vera_B (its shared projections)"
        )
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        lambda_b, lambda_d = p.get("vera_lambda_b"), p.get("vera_lambda_d")
        if lambda_b is None or lambda_d is None:
            raise PermanentModelError(
                f"bad adapter: VeRA module {name} has vera_lambda_b or vera_lambda_d missing"
            )
        if lambda_d.numel() != vera_a.shape[0] or vera_b.shape[1] != vera_a.shape[0]:
            raise PermanentModelError(
                f"bad adapter: VeRA module {name} has vera_lambda_d of {lambda_d.numel()} for "
                f"vera_A {tuple(vera_a.shape)} and vera_B {tuple(vera_b.shape)}"
            )
        modules[name] = VeraModule(name, lambda_b, lambda_d, vera_a, vera_b)
    return modules


def _oft(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
         ) -> dict[str, WeightUpdate]:
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        embedding = "oft_embedding_R" in p
        vec = p["oft_embedding_R" if embedding else "oft_R"]
        if vec.dim() != 2:
            # peft before 0.15 saved whole (r x b x b) blocks, merged by another rule.
            raise UnsupportedAdapterError(
                f"adapter type OFT as older peft versions saved it (module {name} has oft_R of "
                f"shape {tuple(vec.shape)}, not blocks' upper triangles) is not supported"
            )
        module = OftModule(
            name, vec, coft=bool(config.get("coft", False)), eps=float(config.get("eps", 6e-5)),
            use_cayley_neumann=bool(config.get("use_cayley_neumann", True)),
            num_cayley_neumann_terms=int(config.get("num_cayley_neumann_terms", 5)),
            embedding=embedding,
        )
        module.check_block_size()  # a bad adapter fails here, not in the analysis
        modules[name] = module
    return modules


def _boft(config: dict[str, Any], parts: Parts, _: dict[str, torch.Tensor]
          ) -> dict[str, WeightUpdate]:
    modules: dict[str, WeightUpdate] = {}
    for name, p in parts.items():
        rot, s = p.get("boft_R"), p.get("boft_s")
        if rot is None or s is None or rot.dim() != 4 or rot.shape[2] != rot.shape[3]:
            raise PermanentModelError(
                f"bad adapter: BOFT module {name} needs boft_R (levels x blocks x b x b) and "
                "boft_s"
            )
        modules[name] = BoftModule(name, rot, s)
    return modules


BUILDERS: dict[str, Builder] = {
    "LORA": _lora,
    "ADALORA": _adalora,
    "IA3": _ia3,
    "LOHA": _lycoris("LoHa"),
    "LOKR": _lycoris("LoKr"),
    "VERA": _vera,
    "OFT": _oft,
    "BOFT": _boft,
}
