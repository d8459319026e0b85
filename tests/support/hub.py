"""The offline HuggingFace cache the worker tests resolve models from: repo names and what the
session fixture built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HUB_REPO = "esd-test/tiny-llama"
HUB_ADAPTER_REPO = "esd-test/tiny-llama-lora"


HUB_MISSING_REPO = "esd-test/not-in-cache"


@dataclass(frozen=True)
class HubCache:
    """An offline HF cache (HF_HOME/hub) holding HUB_REPO and HUB_ADAPTER_REPO (a LoRA whose
    adapter_config names HUB_REPO as its base); `env` runs the worker against it offline."""

    home: Path
    commit: str
    adapter_commit: str
    env: dict[str, str]
