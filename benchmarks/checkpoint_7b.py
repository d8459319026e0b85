"""A random bf16 checkpoint shaped like Llama-2-7B (or smaller), written tensor by tensor as
sharded safetensors with its index and config.json, for benchmarks/bench_worker.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPEC_FILE = "bench_spec.json"
INDEX_FILE = "model.safetensors.index.json"


SCALE = 0.02  # std of the random weights, as Llama's initializer_range


def tensor_plan(
    *, blocks: int, hidden: int, intermediate: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor of a LlamaForCausalLM, in the order HF writes them."""
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(blocks):
        p = f"model.layers.{i}."
        plan += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    plan += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return plan


def shard_plan(
    plan: list[tuple[str, tuple[int, ...]]], shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of about shard_bytes (bf16: 2 bytes a value)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for key, shape in plan:
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    return shards


def _heads(hidden: int) -> int:
    """32 heads as Llama-2-7B when they divide hidden_size, else the most that do."""
    return next(h for h in (32, 16, 8, 4, 2, 1) if hidden % h == 0)


def write_config(out: Path, *, blocks: int, hidden: int, intermediate: int, vocab: int) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=blocks,
        num_attention_heads=_heads(hidden),
        num_key_value_heads=_heads(hidden),
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = "bfloat16"  # what from_pretrained reads as the checkpoint's dtype
    config.save_pretrained(out)


def _random_bf16(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """N(0, SCALE²) in bf16 on `device`, reproducible per seed; norms get ones elsewhere."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        # randn straight into bf16 on the GPU: ~6.7e9 values in about a second.
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        return t.mul_(SCALE)
    t32 = torch.randn(shape, generator=gen, dtype=torch.float32)
    return t32.mul_(SCALE).to(torch.bfloat16)


def write_checkpoint(
    out: Path,
    *,
    blocks: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    seed: int,
    shard_mb: int,
    device: torch.device,
) -> dict[str, Any]:
    """Write (or reuse, when bench_spec.json matches) the random checkpoint; returns its facts."""
    from safetensors.torch import save_file

    spec = {
        "blocks": blocks,
        "hidden": hidden,
        "intermediate": intermediate,
        "vocab": vocab,
        "seed": seed,
        "shard_mb": shard_mb,
        "scale": SCALE,
        "dtype": "bfloat16",
    }
    plan = tensor_plan(blocks=blocks, hidden=hidden, intermediate=intermediate, vocab=vocab)
    shards = shard_plan(plan, shard_mb * 2**20)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(2 * int(np.prod(shape)) for _, shape in plan)
    facts = {
        "dir": str(out),
        "tensors": len(plan),
        "shards": len(shards),
        "bytes": total,
        "params": total // 2,
    }
    spec_path = out / SPEC_FILE
    if (
        spec_path.is_file()
        and json.loads(spec_path.read_text()) == spec
        and all((out / n).is_file() for n in [*names, INDEX_FILE, "config.json"])
    ):
        return facts | {"reused": True, "write_s": 0.0}

    out.mkdir(parents=True, exist_ok=True)
    spec_path.unlink(missing_ok=True)  # marks the directory incomplete until the end
    t0 = time.perf_counter()
    write_config(out, blocks=blocks, hidden=hidden, intermediate=intermediate, vocab=vocab)
    weight_map: dict[str, str] = {}
    index = 0
    # One thread writes shard k while the main thread generates shard k+1: the disk and the
    # generator overlap, and at most two shards live in host memory.
    writer: threading.Thread | None = None
    errors: list[BaseException] = []

    def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
        try:
            save_file(tensors, str(path), metadata={"format": "pt"})
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    for name, shard in zip(names, shards, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for key, shape in shard:
            if len(shape) == 1:
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = _random_bf16(shape, seed + index, device).cpu()
            weight_map[key] = name
            index += 1
        if writer is not None:
            writer.join()
        if errors:
            raise errors[0]
        writer = threading.Thread(target=_save, args=(tensors, out / name))
        writer.start()
        del tensors
    if writer is not None:
        writer.join()
    if errors:
        raise errors[0]
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    spec_path.write_text(json.dumps(spec, indent=2))
    return facts | {"reused": False, "write_s": round(time.perf_counter() - t0, 2)}

