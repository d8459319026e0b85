"""Where the work runs, behind one contract (controller.backends.base.Backend).

`open_backend` is the one place that picks a backend by name; each backend builds itself
from the run's settings with its own `from_settings`. On Kubernetes, models go in shards
run by Indexed Jobs (kubernetes.sharded), or one Job each with `--shard-size 1`
(kubernetes.per_model). Custom commands run on the local backend. The Kubernetes backends,
and with them the optional `kubernetes` client, are imported only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.backends.base import Backend, WorkerSpec

if TYPE_CHECKING:
    from controller.settings import SweepSettings

BACKENDS = ("local", "kubernetes")


def open_backend(settings: SweepSettings, spec: WorkerSpec) -> Backend:
    """The backend `settings.backend` names, built from the run's settings; the local one
    for custom commands (settings.commands), whatever it names: a command line is this
    machine's (controller.cli refuses them with --backend kubernetes)."""
    kubernetes = settings.backend == "kubernetes" and settings.commands is None
    if kubernetes and settings.cluster.shard_size == 1:
        from controller.backends.kubernetes.per_model.backend import KubernetesBackend

        return KubernetesBackend.from_settings(settings, spec)
    if kubernetes:
        from controller.backends.kubernetes.sharded.backend import ShardedBackend

        return ShardedBackend.from_settings(settings, spec)
    from controller.backends.local.backend import LocalBackend

    return LocalBackend.from_settings(settings, spec)
