"""The GPUs of this machine: which an inherited CUDA_VISIBLE_DEVICES allows (allocation), which
are free (gpus, NVML), how many a model gets (gpurule), and their memory as Prometheus text
(exporter)."""
