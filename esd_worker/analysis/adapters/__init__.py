"""peft adapters merged into their base one layer at a time, as the layer is analysed.

Every method that changes weights: LoRA (rsLoRA, DoRA, rank/alpha patterns), AdaLoRA,
IA3, LoHa, LoKr, VeRA, OFT and BOFT; modules_to_save replace the base layer. Methods that
change no weight matrix (prompt and prefix tuning, …) and options not merged are refused
(refusals). docs/metrics.md ("Adapters") gives each merge formula.
"""

from esd_worker.analysis.adapters.adapter import PeftAdapter
from esd_worker.analysis.adapters.common import (
    ADAPTER_CONFIG,
    AdapterInfo,
    AdapterMatch,
    WeightUpdate,
    read_adapter_config,
)
from esd_worker.analysis.adapters.lowrank import LoraModule, VeraModule, add_lora_, lora_delta
from esd_worker.analysis.adapters.lycoris import LohaModule, LokrModule
from esd_worker.analysis.adapters.orthogonal import BoftModule, OftModule
from esd_worker.analysis.adapters.refusals import check_supported
from esd_worker.analysis.adapters.scaling import Ia3Module

__all__ = [
    "ADAPTER_CONFIG",
    "AdapterInfo",
    "AdapterMatch",
    "BoftModule",
    "Ia3Module",
    "LohaModule",
    "LokrModule",
    "LoraModule",
    "OftModule",
    "PeftAdapter",
    "VeraModule",
    "WeightUpdate",
    "add_lora_",
    "check_supported",
    "lora_delta",
    "read_adapter_config",
]
