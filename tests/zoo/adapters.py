"""The zoo's peft adapters, each made with peft's get_peft_model on the zoo's tiny llama and
saved with save_pretrained; every adapter parameter is perturbed with seeded noise so that
each update is non-zero (peft starts LoRA's B, VeRA's λ_b, AdaLoRA's E, … at zero and IA3's
vectors at one). The reference is peft's own `merge_and_unload()` (tests.zoo.references).

Prompt and prefix tuning change no weight of the model: the worker is expected to refuse
them (`REFUSED`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _configs() -> dict[str, Callable[[], Any]]:
    import peft

    return {
        "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0),
        "rslora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                          use_rslora=True, lora_dropout=0.0),
        "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_dora=True,
                                        lora_dropout=0.0),
        "adalora": lambda: peft.AdaLoraConfig(init_r=6, target_r=4, lora_alpha=8,
                                              target_modules=["q_proj", "v_proj", "down_proj"],
                                              total_step=10, lora_dropout=0.0),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                      feedforward_modules=["down_proj"]),
        "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=ALL),
        "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=ALL),
        "vera": lambda: peft.VeraConfig(r=8, target_modules=["q_proj", "o_proj"],
                                        save_projection=True, vera_dropout=0.0),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "o_proj",
                                                                             "down_proj"]),
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, boft_n_butterfly_factor=1,
                                        target_modules=["q_proj", "o_proj"], boft_dropout=0.0),
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                         num_virtual_tokens=4),
        "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                         num_virtual_tokens=4),
    }


METHODS: tuple[str, ...] = ("lora", "rslora", "dora", "adalora", "ia3", "loha", "lokr", "vera",
                            "oft", "boft", "prompt_tuning", "prefix_tuning")
REFUSED: dict[str, str] = {
    "prompt_tuning": "prompt tuning changes no weight of the model",
    "prefix_tuning": "prefix tuning changes no weight of the model",
}


def load_base(base: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The base model as the class its config.json names (what the worker builds)."""
    import transformers

    config = json.loads((base / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    loader = getattr(transformers, arch, None) or transformers.AutoModel
    return loader.from_pretrained(str(base), dtype=dtype).eval()


def build_adapter(method: str, base: Path, directory: Path, *, seed: int = 30) -> Path:
    """`method`'s adapter on `base`, its parameters perturbed, saved; its
    adapter_config.json names `base` as base_model_name_or_path."""
    import warnings

    from peft import get_peft_model

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(load_base(base), _configs()[method]())
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        model.save_pretrained(str(directory))
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base)
    path.write_text(json.dumps(config, indent=2))
    return directory


def merged(base: Path, adapter: Path) -> torch.nn.Module:
    """peft's merge_and_unload() of the adapter on its base, in float64."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(load_base(base, torch.float64), str(adapter))
        result: torch.nn.Module = model.merge_and_unload()
    return result
