"""dcgm-exporter's metric names for GPU memory: what `esd-sweep gpu-exporter` writes
(controller.gpu.exporter) and the Kubernetes backend's telemetry reads
(controller.backends.kubernetes.common.telemetry). One owner, so the two cannot drift apart.
Gauges in MiB, as DCGM's field list names them."""

from __future__ import annotations

FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
