"""The Kubernetes backend (`--backend kubernetes`), in two modes that share `common`:

sharded (the default): one Indexed Job per resource class over shards of the list;
per_model (`--shard-size 1`): one Job per model.

Neither mode imports the other (an import-linter contract). Only common.client imports the
optional `kubernetes` package, so `import controller.backends.kubernetes.common.settings`
works without it.
"""
