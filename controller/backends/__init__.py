"""Where the work runs, behind one contract (controller.backends.base.Backend).

`open_backend` is the one place that picks a backend by name; each backend builds itself
from the run's settings with its own `from_settings`. The Kubernetes backend, and with it
the optional `kubernetes` client, is imported only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.backends.base import Backend, WorkerSpec

if TYPE_CHECKING:
    from controller.settings import SweepSettings

BACKENDS = ("local", "kubernetes")


def open_backend(settings: SweepSettings, spec: WorkerSpec) -> Backend:
    """The backend `settings.backend` names, built from the run's settings."""
    if settings.backend == "kubernetes":
        from controller.backends.kubernetes.backend import KubernetesBackend

        return KubernetesBackend.from_settings(settings, spec)
    from controller.backends.local import LocalBackend

    return LocalBackend.from_settings(settings, spec)
