"""The shared core: what the worker and the controller both need, torch-free.

The controller imports nothing else of esd_worker (an import-linter contract). Here live the
exit-code contract (errors), text that leaves a process (echo, redact, logs), files in shared
folders (files), the command line (flags, settings), the machine protocol (protocol), the
power-law fit (powerlaw), a token bucket (ratelimit), how hub requests are retried
(hubretry), model references and lists, which files are weights and the safetensors header
(models/) and the store (store/). Nothing here imports torch, transformers, peft or huggingface_hub.
"""
