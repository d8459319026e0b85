"""The shared core: what the worker and the controller both need, torch-free.

The controller imports nothing else of esd_worker (an import-linter contract). Here live the
worker's command line (command/: flags, settings, the parser, one invocation as a value), the
machine protocol (protocol), model references, lists, weight files and the safetensors header
(models/), the store (store/), the hub's retry policy (hubretry) and token bucket (ratelimit),
the power-law fit (powerlaw), the exit-code contract (errors), text that leaves a process
(echo, redact, logs) and files in shared folders (files). Nothing here imports torch,
transformers, peft, safetensors or huggingface_hub.
"""
