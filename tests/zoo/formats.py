"""The zoo's checkpoint formats and multi-part models: .bin, sharded safetensors with an index,
tied embeddings, bfloat16, a config.json without `architectures`, a sentence-transformers
model with a 2_Dense module folder, a diffusers-shaped pipeline folder and GGUF files.

diffusers is not a dependency of the project: the pipeline's unet/ and vae/ are written
tensor by tensor under diffusers' names and shapes (UNet2DConditionModel, AutoencoderKL:
conv_in, time_embedding.linear_1, resnets, transformer blocks with attn1/attn2 and a GEGLU
feed-forward, up/down samplers, conv_out); its text_encoder/ is transformers' CLIPTextModel.
GGUF files are written with the `gguf` package's GGUFWriter in llama's tensor names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from tests.zoo.hf import _CLIP_TEXT, V, build_hf, hf_model, spec


def build_bin(directory: Path) -> Path:
    """A Llama with only pytorch_model.bin (what transformers 4 wrote unsafe)."""
    model = hf_model(spec("llama"), seed=1)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory


def build_sharded(directory: Path) -> Path:
    """A Qwen2 in several safetensors shards with model.safetensors.index.json."""
    return build_hf(spec("qwen2"), directory, seed=2, max_shard_size="20KB")


def build_tied(directory: Path) -> Path:
    """A Llama whose lm_head is its embedding (no lm_head.weight stored)."""
    import transformers

    torch.manual_seed(3)
    kwargs = dict(spec("llama").kwargs)
    config = transformers.LlamaConfig(**kwargs, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def build_bf16(directory: Path) -> Path:
    """A Mistral stored in bfloat16."""
    return build_hf(spec("mistral"), directory, seed=4, dtype=torch.bfloat16)


def build_bert_no_architectures(directory: Path) -> Path:
    """A BertModel whose config.json names no `architectures` (many old uploads): what
    transformers' AutoModel loads is the whole checkpoint."""
    build_hf(dataclasses.replace(spec("bert"), model="BertModel"), directory, seed=5)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.pop("architectures", None)
    path.write_text(json.dumps(config, indent=2))
    return directory


def _bert_tokenizer(directory: Path) -> None:
    from transformers import BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    BertTokenizer(vocab_file=str(vocab)).save_pretrained(directory)


def build_sentence_transformer(directory: Path, *, scratch: Path) -> Path:
    """BERT + mean pooling + a Dense 32 → 24 (2_Dense/ holds its own weights)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Pooling, Transformer

    bert = build_hf(spec("bert"), scratch / "st-bert", seed=6)
    _bert_tokenizer(bert)
    torch.manual_seed(6)
    transformer = Transformer(str(bert), max_seq_length=32)
    pooling = Pooling(32, pooling_mode="mean")
    dense = Dense(32, 24, activation_function=torch.nn.Tanh())
    SentenceTransformer(modules=[transformer, pooling, dense], device="cpu").save(str(directory))
    return directory


# --- a diffusers-shaped pipeline ----------------------------------------------------------

def _resnet(t: dict[str, tuple[int, ...]], p: str, cin: int, cout: int, temb: int | None) -> None:
    t[f"{p}.norm1.weight"] = (cin,)
    t[f"{p}.norm1.bias"] = (cin,)
    t[f"{p}.conv1.weight"] = (cout, cin, 3, 3)
    t[f"{p}.conv1.bias"] = (cout,)
    if temb is not None:
        t[f"{p}.time_emb_proj.weight"] = (cout, temb)
        t[f"{p}.time_emb_proj.bias"] = (cout,)
    t[f"{p}.norm2.weight"] = (cout,)
    t[f"{p}.norm2.bias"] = (cout,)
    t[f"{p}.conv2.weight"] = (cout, cout, 3, 3)
    t[f"{p}.conv2.bias"] = (cout,)
    if cin != cout:
        t[f"{p}.conv_shortcut.weight"] = (cout, cin, 1, 1)
        t[f"{p}.conv_shortcut.bias"] = (cout,)


def _transformer(t: dict[str, tuple[int, ...]], p: str, c: int, cross: int) -> None:
    t[f"{p}.norm.weight"] = (c,)
    t[f"{p}.norm.bias"] = (c,)
    t[f"{p}.proj_in.weight"] = (c, c)
    t[f"{p}.proj_out.weight"] = (c, c)
    b = f"{p}.transformer_blocks.0"
    for attn, kv in (("attn1", c), ("attn2", cross)):
        t[f"{b}.{attn}.to_q.weight"] = (c, c)
        t[f"{b}.{attn}.to_k.weight"] = (c, kv)
        t[f"{b}.{attn}.to_v.weight"] = (c, kv)
        t[f"{b}.{attn}.to_out.0.weight"] = (c, c)
        t[f"{b}.{attn}.to_out.0.bias"] = (c,)
    for norm in ("norm1", "norm2", "norm3"):
        t[f"{b}.{norm}.weight"] = (c,)
        t[f"{b}.{norm}.bias"] = (c,)
    t[f"{b}.ff.net.0.proj.weight"] = (8 * c, c)  # GEGLU: 2 × 4c
    t[f"{b}.ff.net.2.weight"] = (c, 4 * c)


def _unet_shapes(c: int = 32, cross: int = 32) -> dict[str, tuple[int, ...]]:
    temb = 4 * c
    t: dict[str, tuple[int, ...]] = {"conv_in.weight": (c, 4, 3, 3), "conv_in.bias": (c,),
                                     "time_embedding.linear_1.weight": (temb, c),
                                     "time_embedding.linear_1.bias": (temb,),
                                     "time_embedding.linear_2.weight": (temb, temb),
                                     "time_embedding.linear_2.bias": (temb,)}
    _resnet(t, "down_blocks.0.resnets.0", c, c, temb)
    _transformer(t, "down_blocks.0.attentions.0", c, cross)
    t["down_blocks.0.downsamplers.0.conv.weight"] = (c, c, 3, 3)
    _resnet(t, "mid_block.resnets.0", c, c, temb)
    _transformer(t, "mid_block.attentions.0", c, cross)
    _resnet(t, "mid_block.resnets.1", c, c, temb)
    _resnet(t, "up_blocks.0.resnets.0", 2 * c, c, temb)
    _transformer(t, "up_blocks.0.attentions.0", c, cross)
    t["conv_norm_out.weight"] = (c,)
    t["conv_norm_out.bias"] = (c,)
    t["conv_out.weight"] = (4, c, 3, 3)
    return t


def _vae_shapes(c: int = 32) -> dict[str, tuple[int, ...]]:
    t: dict[str, tuple[int, ...]] = {}
    for part, cin, cout in (("encoder", 3, 8), ("decoder", 4, 3)):
        t[f"{part}.conv_in.weight"] = (c, cin, 3, 3)
        _resnet(t, f"{part}.mid_block.resnets.0", c, c, None)
        a = f"{part}.mid_block.attentions.0"
        t[f"{a}.group_norm.weight"] = (c,)
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            t[f"{a}.{proj}.weight"] = (c, c)
            t[f"{a}.{proj}.bias"] = (c,)
        t[f"{part}.conv_norm_out.weight"] = (c,)
        t[f"{part}.conv_out.weight"] = (cout, c, 3, 3)
    _resnet(t, "encoder.down_blocks.0.resnets.0", c, c, None)
    t["encoder.down_blocks.0.downsamplers.0.conv.weight"] = (c, c, 3, 3)
    _resnet(t, "decoder.up_blocks.0.resnets.0", c, c, None)
    t["decoder.up_blocks.0.upsamplers.0.conv.weight"] = (c, c, 3, 3)
    t["quant_conv.weight"] = (8, 8, 1, 1)
    t["post_quant_conv.weight"] = (4, 4, 1, 1)
    return t


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=gen) * 0.05 if len(s) > 1 else torch.ones(s))
            for k, s in shapes.items()}


def build_diffusers(directory: Path) -> Path:
    """model_index.json, unet/, vae/, text_encoder/ (CLIPTextModel), scheduler/, tokenizer/."""
    import transformers
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.31.0",
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "requires_safety_checker": False, "safety_checker": [None, None],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
    }, indent=2))
    for name, shapes, config, seed in (
        ("unet", _unet_shapes(), {"_class_name": "UNet2DConditionModel", "in_channels": 4,
                                  "out_channels": 4, "block_out_channels": [32],
                                  "cross_attention_dim": 32, "layers_per_block": 1,
                                  "sample_size": 8}, 7),
        ("vae", _vae_shapes(), {"_class_name": "AutoencoderKL", "in_channels": 3,
                                "out_channels": 3, "latent_channels": 4,
                                "block_out_channels": [32], "layers_per_block": 1}, 8),
    ):
        folder = directory / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(
            json.dumps({**config, "_diffusers_version": "0.31.0"}, indent=2))
        save_file(_random(shapes, seed), str(folder / "diffusion_pytorch_model.safetensors"))
    torch.manual_seed(9)
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(**_CLIP_TEXT)).eval()
    text.save_pretrained(directory / "text_encoder")
    (directory / "scheduler").mkdir(exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "PNDMScheduler", "num_train_timesteps": 1000}))
    (directory / "tokenizer").mkdir(exist_ok=True)
    (directory / "tokenizer" / "vocab.json").write_text(json.dumps(
        {f"w{i}</w>": i for i in range(V)}))
    (directory / "tokenizer" / "merges.txt").write_text("#version: 0.2\n")
    return directory


# --- GGUF ---------------------------------------------------------------------------------

def build_gguf(directory: Path, *, quantized: bool, experts: int = 0) -> Path:
    """A llama GGUF file (hidden 32, ffn 64, 2 blocks, vocab 96): F32 and F16 tensors, or
    (quantized) Q8_0 and Q4_0 matrices as llama.cpp's mixed files have, norms in F32; with
    `experts`, a Mixtral-style MoE: each block's feed-forward is llama.cpp's expert stacks
    `ffn_gate_exps`/`ffn_up_exps`/`ffn_down_exps` (experts × out × in) and the router
    `ffn_gate_inp`."""
    import gguf

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(10 + quantized)
    h, f, blocks = 32, 64, 2
    writer = gguf.GGUFWriter(str(directory / "model.gguf"), "llama")
    writer.add_name("esd-zoo-llama")
    writer.add_context_length(64)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(f)
    writer.add_block_count(blocks)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-6)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    file_type = gguf.LlamaFileType
    writer.add_file_type(file_type.MOSTLY_Q8_0 if quantized else file_type.ALL_F32)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, h)}
    for b in range(blocks):
        p = f"blk.{b}"
        shapes.update({f"{p}.attn_norm.weight": (h,), f"{p}.attn_q.weight": (h, h),
                       f"{p}.attn_k.weight": (h // 2, h), f"{p}.attn_v.weight": (h // 2, h),
                       f"{p}.attn_output.weight": (h, h), f"{p}.ffn_norm.weight": (h,)})
        if experts:
            shapes.update({f"{p}.ffn_gate_inp.weight": (experts, h),
                           f"{p}.ffn_gate_exps.weight": (experts, f, h),
                           f"{p}.ffn_up_exps.weight": (experts, f, h),
                           f"{p}.ffn_down_exps.weight": (experts, h, f)})
        else:
            shapes.update({f"{p}.ffn_gate.weight": (f, h), f"{p}.ffn_up.weight": (f, h),
                           f"{p}.ffn_down.weight": (h, f)})
    shapes.update({"output_norm.weight": (h,), "output.weight": (V, h)})
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    for i, (name, shape) in enumerate(shapes.items()):
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        value = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if not quantized:
            writer.add_tensor(name, value.astype(np.float16) if i % 2 else value)
            continue
        qtype = q4 if "ffn" in name else q8
        data = gguf.quants.quantize(value, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory
