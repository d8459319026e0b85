"""The adapter merge under its historical name: see esd_worker.analysis.adapters (every peft
method that changes weights, not only LoRA)."""

from esd_worker.analysis.adapters import (
    ADAPTER_CONFIG,
    AdapterInfo,
    AdapterMatch,
    LoraAdapter,
    LoraModule,
    PeftAdapter,
    WeightUpdate,
    add_lora_,
    check_supported,
    lora_delta,
    read_adapter_config,
)

__all__ = [
    "ADAPTER_CONFIG",
    "AdapterInfo",
    "AdapterMatch",
    "LoraAdapter",
    "LoraModule",
    "PeftAdapter",
    "WeightUpdate",
    "add_lora_",
    "check_supported",
    "lora_delta",
    "read_adapter_config",
]
