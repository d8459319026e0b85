"""The zoo's transformers models: tiny random-weight checkpoints of each family, built with
transformers' own config and model classes and written with `save_pretrained` (seeded).

Sizes are the smallest that keep every projection's smaller side >= 10 (the worker's
default --min-evals) where the architecture allows: hidden 32, one or two layers, vocab
96, four experts. A family is a `Spec`: its config class, its model class and the config's
keyword arguments; `build_hf(spec, directory)` builds and saves it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Families (the table's first column).
DENSE = "dense LLM"
MOE = "MoE LLM"
ENCODER = "encoder/seq2seq/speech"
VISION = "vision"
MULTIMODAL = "multimodal"

V = 96  # vocabulary
_ATTN = {"num_attention_heads": 2, "num_key_value_heads": 1}
_LM = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": V,
       "max_position_embeddings": 64, **_ATTN}
_MOE = {"hidden_size": 32, "num_hidden_layers": 1, "vocab_size": V, "max_position_embeddings": 64,
        "num_experts_per_tok": 2, **_ATTN}
_VIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "image_size": 32, "patch_size": 8, "num_channels": 3}
_CLIP_TEXT: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "vocab_size": V, "max_position_embeddings": 16}
_CLIP_VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "image_size": 32, "patch_size": 8}


@dataclass(frozen=True)
class Spec:
    """One family: `config` and `model` are transformers class names; `kwargs` the config's
    arguments (nested dicts stay dicts: transformers builds sub-configs from them);
    `adjust` edits the built model's config before it is built (None: nothing)."""

    name: str
    family: str
    config: str
    model: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    adjust: Callable[[Any], None] | None = None


SPECS: tuple[Spec, ...] = (
    # --- dense decoder LLMs ----------------------------------------------------------------
    Spec("llama", DENSE, "LlamaConfig", "LlamaForCausalLM", _LM),
    Spec("mistral", DENSE, "MistralConfig", "MistralForCausalLM", _LM),
    Spec("qwen2", DENSE, "Qwen2Config", "Qwen2ForCausalLM", _LM),
    Spec("qwen3", DENSE, "Qwen3Config", "Qwen3ForCausalLM", {**_LM, "head_dim": 16}),
    Spec("gemma", DENSE, "GemmaConfig", "GemmaForCausalLM", {**_LM, "head_dim": 16}),
    Spec("gemma2", DENSE, "Gemma2Config", "Gemma2ForCausalLM", {**_LM, "head_dim": 16}),
    Spec("phi", DENSE, "PhiConfig", "PhiForCausalLM", _LM),
    Spec("phi3", DENSE, "Phi3Config", "Phi3ForCausalLM",
         {**_LM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    Spec("gpt2", DENSE, "GPT2Config", "GPT2LMHeadModel",
         {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": V, "n_positions": 64}),
    Spec("gpt_neox", DENSE, "GPTNeoXConfig", "GPTNeoXForCausalLM",
         {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "vocab_size": V, "max_position_embeddings": 64}),
    Spec("falcon", DENSE, "FalconConfig", "FalconForCausalLM",
         {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "vocab_size": V, "new_decoder_architecture": False, "multi_query": True}),
    Spec("opt", DENSE, "OPTConfig", "OPTForCausalLM",
         {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "vocab_size": V, "max_position_embeddings": 64, "word_embed_proj_dim": 32}),
    Spec("bloom", DENSE, "BloomConfig", "BloomForCausalLM",
         {"hidden_size": 32, "n_layer": 2, "n_head": 2, "vocab_size": V}),
    Spec("starcoder2", DENSE, "Starcoder2Config", "Starcoder2ForCausalLM", _LM),
    # --- mixtures of experts ---------------------------------------------------------------
    Spec("mixtral", MOE, "MixtralConfig", "MixtralForCausalLM",
         {**_MOE, "intermediate_size": 48, "num_local_experts": 4}),
    Spec("qwen2_moe", MOE, "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         {**_MOE, "intermediate_size": 48, "moe_intermediate_size": 24,
          "shared_expert_intermediate_size": 40, "num_experts": 4}),
    Spec("qwen3_moe", MOE, "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         {**_MOE, "intermediate_size": 48, "moe_intermediate_size": 24, "head_dim": 16,
          "num_experts": 4}),
    Spec("olmoe", MOE, "OlmoeConfig", "OlmoeForCausalLM",
         {**_MOE, "intermediate_size": 24, "num_experts": 4, "eos_token_id": 1,
          "pad_token_id": 0}),
    Spec("deepseek_v3", MOE, "DeepseekV3Config", "DeepseekV3ForCausalLM",
         {**_MOE, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_key_value_heads": 2,
          "intermediate_size": 48, "moe_intermediate_size": 24, "n_routed_experts": 4,
          "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 16,
          "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
    Spec("gpt_oss", MOE, "GptOssConfig", "GptOssForCausalLM",
         {**_MOE, "intermediate_size": 24, "head_dim": 16, "num_local_experts": 4}),
    Spec("granitemoe", MOE, "GraniteMoeConfig", "GraniteMoeForCausalLM",
         {**_MOE, "intermediate_size": 24, "num_local_experts": 4}),
    Spec("llama4_text", MOE, "Llama4TextConfig", "Llama4ForCausalLM",
         {**_MOE, "intermediate_size": 24, "intermediate_size_mlp": 48, "head_dim": 16,
          "num_local_experts": 4, "num_experts_per_tok": 1}),
    # --- encoders, seq2seq, speech ---------------------------------------------------------
    Spec("bert", ENCODER, "BertConfig", "BertForMaskedLM",
         {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 64, "vocab_size": V, "max_position_embeddings": 64}),
    Spec("roberta", ENCODER, "RobertaConfig", "RobertaForSequenceClassification",
         {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "intermediate_size": 64, "vocab_size": V, "max_position_embeddings": 64,
          "num_labels": 12}),
    Spec("t5", ENCODER, "T5Config", "T5ForConditionalGeneration",
         {"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 1, "num_decoder_layers": 1,
          "num_heads": 2, "vocab_size": V, "relative_attention_num_buckets": 8,
          "decoder_start_token_id": 0}),
    Spec("bart", ENCODER, "BartConfig", "BartForConditionalGeneration",
         {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
          "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
          "vocab_size": V, "max_position_embeddings": 64}),
    Spec("wav2vec2", ENCODER, "Wav2Vec2Config", "Wav2Vec2ForCTC",
         {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "intermediate_size": 64, "vocab_size": 24, "conv_dim": (16, 16),
          "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
          "num_conv_pos_embedding_groups": 2}),
    Spec("whisper", ENCODER, "WhisperConfig", "WhisperForConditionalGeneration",
         {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
          "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
          "vocab_size": V, "num_mel_bins": 16, "max_source_positions": 32,
          "max_target_positions": 32, "decoder_start_token_id": 1, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2, "suppress_tokens": [],
          "begin_suppress_tokens": []}),
    # --- vision ----------------------------------------------------------------------------
    Spec("vit", VISION, "ViTConfig", "ViTForImageClassification", {**_VIT, "num_labels": 12}),
    Spec("deit", VISION, "DeiTConfig", "DeiTForImageClassificationWithTeacher",
         {**_VIT, "num_labels": 12}),
    Spec("beit", VISION, "BeitConfig", "BeitForImageClassification",
         {**_VIT, "num_labels": 12, "use_relative_position_bias": True}),
    Spec("dinov2", VISION, "Dinov2Config", "Dinov2Model", {**_VIT, "mlp_ratio": 2}),
    Spec("swin", VISION, "SwinConfig", "SwinForImageClassification",
         {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [1, 1],
          "num_heads": [2, 2], "window_size": 4, "num_labels": 12}),
    Spec("convnext", VISION, "ConvNextConfig", "ConvNextForImageClassification",
         {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2, "num_labels": 12}),
    Spec("resnet", VISION, "ResNetConfig", "ResNetForImageClassification",
         {"embedding_size": 16, "hidden_sizes": [16, 24], "depths": [1, 1],
          "layer_type": "basic", "num_labels": 12}),
    # --- multimodal ------------------------------------------------------------------------
    Spec("clip", MULTIMODAL, "CLIPConfig", "CLIPModel",
         {"text_config": _CLIP_TEXT, "vision_config": _CLIP_VISION, "projection_dim": 24}),
    Spec("siglip", MULTIMODAL, "SiglipConfig", "SiglipModel",
         {"text_config": _CLIP_TEXT, "vision_config": _CLIP_VISION}),
    Spec("llava", MULTIMODAL, "LlavaConfig", "LlavaForConditionalGeneration",
         {"text_config": {"model_type": "llama", **_LM, "num_hidden_layers": 1},
          "vision_config": {"model_type": "clip_vision_model", **_CLIP_VISION},
          "image_token_index": V - 1, "projector_hidden_act": "gelu",
          "vision_feature_layer": -1}),
    Spec("qwen2_vl", MULTIMODAL, "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
         {"text_config": {"model_type": "qwen2_vl_text", **_LM, "num_hidden_layers": 1,
                          "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "rope_theta": 10000.0}},
          "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
                            "mlp_ratio": 2, "patch_size": 4, "spatial_merge_size": 2,
                            "temporal_patch_size": 2, "in_channels": 3},
          "image_token_id": V - 1, "video_token_id": V - 2, "vision_start_token_id": V - 3}),
    Spec("gemma3", MULTIMODAL, "Gemma3Config", "Gemma3ForConditionalGeneration",
         {"text_config": {"model_type": "gemma3_text", **_LM, "num_hidden_layers": 1,
                          "head_dim": 16, "sliding_window": 16},
          "vision_config": {"model_type": "siglip_vision_model", **_CLIP_VISION},
          "mm_tokens_per_image": 4, "image_token_index": V - 1, "boi_token_index": V - 2,
          "eoi_token_index": V - 3}),
)


def hf_model(spec: Spec, *, seed: int = 0) -> Any:
    """The spec's model, built from its config with random weights (seeded), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, spec.config)(**dict(spec.kwargs))
    if spec.adjust is not None:
        spec.adjust(config)
    return getattr(transformers, spec.model)(config).eval()


def build_hf(spec: Spec, directory: Path, *, seed: int = 0, dtype: torch.dtype | None = None,
             max_shard_size: str | None = None) -> Path:
    """The spec's model saved with save_pretrained (sharded with an index when
    max_shard_size is given; cast to `dtype` first when given)."""
    model = hf_model(spec, seed=seed)
    if dtype is not None:
        model = model.to(dtype)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return directory


def spec(name: str) -> Spec:
    (found,) = [s for s in SPECS if s.name == name]
    return found
