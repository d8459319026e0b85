"""The per-model Kubernetes mode (`--shard-size 1`): one batch/v1 Job per model, placed by GPU
telemetry (backend), created or adopted (submit), followed (events), in a shared table (state)."""
