"""Which peft adapters the streamed merge refuses, and why: a permanent error naming the
method or option (UnsupportedAdapterError, exit 3)."""

from __future__ import annotations

from typing import Any

from esd_worker.core.errors import UnsupportedAdapterError

# The methods merged (peft_type → name in messages).
MERGED = {
    "LORA": "LoRA",
    "ADALORA": "AdaLoRA",
    "IA3": "IA3",
    "LOHA": "LoHa",
    "LOKR": "LoKr",
    "VERA": "VeRA",
    "OFT": "OFT",
    "BOFT": "BOFT",
}

# Methods that change no weight matrix of the base model: nothing to analyse but the base.
NO_WEIGHT_CHANGE = {
    "PROMPT_TUNING": "prompt tuning (learned virtual-token embeddings put before the input)",
    "MULTITASK_PROMPT_TUNING": "multitask prompt tuning (learned virtual-token embeddings)",
    "P_TUNING": "p-tuning (virtual tokens from a prompt encoder)",
    "PREFIX_TUNING": "prefix tuning (learned key/value prefixes for the attention layers)",
    "CPT": "context-aware prompt tuning (CPT: learned virtual-token embeddings)",
    "CARTRIDGE": "Cartridges (a trained key/value-cache prefix)",
    "ADAPTION_PROMPT": "adaption prompt (LLaMA-Adapter: gated prompts added to attention)",
    "LN_TUNING": "LayerNorm tuning (it trains normalisation weights only, never analysed)",
}

# Methods whose merge is not done (yet), with what makes them different.
NOT_MERGED = {
    "POLY": "Polytropon (routes between LoRA skills per task: no single merged weight)",
    "XLORA": "X-LoRA (mixes LoRA experts per token: no single merged weight)",
    "TRAINABLE_TOKENS": "trainable tokens (replaces rows of the embedding)",
}

# LoRA (and AdaLoRA, whose config is LoRA's) options whose merge is not W + scale·B@A or
# that change which weights exist; an adapter using one is refused rather than analysed
# wrongly. Option → what to call it.
LORA_OPTIONS = {
    "layer_replication": "LoRA with layer_replication (adds layers the base does not have)",
    "target_parameters": "LoRA on target_parameters (parameters such as MoE experts, not "
                         "modules)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "use_qalora": "QA-LoRA (use_qalora: quantisation-aware, pooled inputs)",
    "kasa_config": "KaSA (kasa_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: cannot be merged)",
    "trainable_token_indices": "LoRA with trainable tokens (trainable_token_indices)",
}


def check_supported(config: dict[str, Any]) -> None:
    """Raise UnsupportedAdapterError naming the adapter type or option this merge cannot do."""
    peft_type = str(config.get("peft_type") or "").upper()
    if peft_type in NO_WEIGHT_CHANGE:
        base = config.get("base_model_name_or_path")
        raise UnsupportedAdapterError(
            f"adapter type {peft_type} is {NO_WEIGHT_CHANGE[peft_type]}: it changes no weight "
            "matrix of its base model, so there is nothing to analyse beyond the base model"
            + (f" ({base}) itself" if base else " itself")
        )
    if peft_type not in MERGED:
        what = NOT_MERGED.get(peft_type)
        raise UnsupportedAdapterError(
            f"adapter type {peft_type or 'unknown'!r}"
            + (f" ({what})" if what else "")
            + " is not supported: merged are "
            + ", ".join(MERGED.values()) + " (LoRA with rsLoRA or DoRA)"
        )
    if peft_type in ("LORA", "ADALORA"):
        for option, what in LORA_OPTIONS.items():
            if config.get(option):
                raise UnsupportedAdapterError(f"adapter type {what} is not supported")
    if peft_type == "ADALORA" and config.get("use_dora"):
        raise UnsupportedAdapterError("adapter type AdaLoRA with use_dora is not supported")
    if peft_type == "VERA" and not config.get("save_projection", True):
        raise UnsupportedAdapterError(
            "adapter type VeRA saved without its shared projections (save_projection=false) "
            "is not supported: peft regenerates vera_A and vera_B from projection_prng_key "
            "with torch's CPU random generator, which this merge does not reproduce"
        )
