"""What a worker pod asks for: resource classes and the memory and disk a model needs.

Owns ResourceClass (one Indexed Job's pod requests and the biggest model it takes), the
sizing rules from a model's weight bytes to a memory request (memory_for) and a disk
request (disk_for, disk_gib), and the download budget a disk request leaves a worker
(cache_budget). Both Kubernetes modes size pods with it (common.settings: one Job per model;
the sharded plan: a class per size band). Pure: which classes a run uses and which model
goes to which (the sharded mode's plan) are not its business.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from esd_worker.core.command.flags import parse_size

GIB = 1024**3
# Disk beyond two models: configs, the HF cache's bookkeeping, logs, a partial download.
_DISK_HEADROOM_GIB = 8
_BASE_MEMORY_GIB = 4  # Python, torch, a CUDA context, the HF and safetensors readers
MAX_MEMORY_GIB = 64  # the most a worker asks for: its host memory is bounded by a tensor


@dataclass(frozen=True)
class ResourceClass:
    """What one Indexed Job's pods request, and which models it takes.

    name: a DNS-1123 label part ("gpu", "gpu-large", "cpu"), used in Job names and store
    keys; gpus: nvidia.com/gpu per pod (0: a CPU pod); max_bytes: the largest model (weights
    bytes) this class takes, None for no bound; memory, ephemeral_storage: the pod's requests
    as Kubernetes quantities ("16Gi"), the storage being room for the downloads.
    """

    name: str
    gpus: int
    max_bytes: int | None
    memory: str
    ephemeral_storage: str


def memory_for(size: int) -> str:
    """The host memory a worker asks for to analyse models of up to `size` weight bytes.

    The worker reads a checkpoint tensor by tensor, so host memory is bounded by the largest
    tensor, not the model: the embedding or output matrix, at most ~20% of a real
    checkpoint's bytes, held once as stored and once in float32 (2x a bf16 copy) while it
    goes to the device, hence 0.4 x size on top of the process's own ~4 GiB, capped at 64Gi.
    An 8 GB model asks for 7Gi, so it fits a 16 GiB single-GPU instance (whose allocatable
    memory is ~14 GiB); 30 GB asks for 16Gi.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    gib = _BASE_MEMORY_GIB + math.ceil(0.4 * size / GIB)
    return f"{min(gib, MAX_MEMORY_GIB)}Gi"


def disk_for(size: int, *, copies: int = 2) -> str:
    """The ephemeral storage a worker asks for: `copies` models of up to `size` bytes on disk
    (the one analysed and the next one downloaded ahead, or a base and its adapter) and
    room for configs, the HF cache's bookkeeping and logs."""
    return f"{disk_gib(size, copies)}Gi"


def disk_gib(size: int, copies: int) -> int:
    """disk_for's request in whole GiB (what a class that asks for at least so much
    compares)."""
    if size < 0 or copies < 1:
        raise ValueError(f"size must be >= 0 and copies >= 1, got {size}, {copies}")
    return math.ceil(copies * size / GIB) + _DISK_HEADROOM_GIB


def cache_budget(disk: str | None) -> int | None:
    """The download budget of a worker whose disk request is `disk` (a quantity: "23Gi",
    "200G"): the request less the headroom, at least 1 GiB, in bytes; None for no request
    or a quantity that is not a plain size (milli-units: Kubernetes' "m", which
    parse_size, being case-blind, would read as mega)."""
    if disk is None or disk.endswith("m"):
        return None
    try:
        size = parse_size(disk)
    except argparse.ArgumentTypeError:
        return None
    return max(size - _DISK_HEADROOM_GIB * GIB, GIB)
