"""A failure's cause (its error class) and fault domain, for the failures metric (pure).

Owns: which domain each error class the workers, the backends and the recorder write
belongs to. Not owned: the classes themselves (esd_worker.core.errors, the backends'
diagnoses, controller.run.recorder) nor how a record is shown (controller.results).

The four domains say whose trouble a failure is, so an operator knows where to look:
  model           the model itself: not found or gated, a format the worker cannot read,
                  too big for the GPU, the host's memory or the disk, no progress in time;
  worker          the worker process: crashed, exited early, rejected its command line,
                  could not start, ended without a result;
  node            the machine under it: a broken GPU, a kill by a signal that no model
                  was charged for;
  infrastructure  what every worker shares: network and storage, the cluster's API, Jobs
                  deleted or refused, quota (Kueue), permissions (RBAC), and evictions and
                  disruptions (preemption, spot loss, a drain: the cluster's own reasons,
                  as docs/design.md "Fault domains" charges them: to nobody).
A class not listed here is the worker's (an error outside the known handling, as
WorkerCrashed is).
"""

from __future__ import annotations

import re

from esd_worker.core.errors import classify_exit
from esd_worker.core.redact import redact

MODEL = "model"
WORKER = "worker"
NODE = "node"
INFRASTRUCTURE = "infrastructure"
DOMAINS = (MODEL, WORKER, NODE, INFRASTRUCTURE)

#: Error class → fault domain (classes from esd_worker.core.errors, the supervisor and
#: watchdog, the local loop and slots, the Kubernetes diagnoses, the recorder).
DOMAIN_OF: dict[str, str] = {
    "PermanentModelError": MODEL,
    "UnsupportedAdapterError": MODEL,
    "GpuOutOfMemoryError": MODEL,
    "HostOutOfMemory": MODEL,
    "ModelTimeout": MODEL,
    "ModelTooLarge": MODEL,
    "WorkerCrashed": WORKER,
    "WorkerExited": WORKER,
    "UsageError": WORKER,
    "StartFailed": WORKER,
    "NoOutcome": WORKER,
    "MarkerMissing": WORKER,
    "DeadlineExceeded": WORKER,
    "DeviceError": NODE,
    "KilledBySignal": NODE,
    "Evicted": INFRASTRUCTURE,
    "Disrupted": INFRASTRUCTURE,
    "TransientError": INFRASTRUCTURE,
    "StoreError": INFRASTRUCTURE,
    "StorePermanentError": INFRASTRUCTURE,
    "StorePathError": INFRASTRUCTURE,
    "JobSpecError": INFRASTRUCTURE,
    "JobNameTaken": INFRASTRUCTURE,
    "JobDeleted": INFRASTRUCTURE,
    "JobFailed": INFRASTRUCTURE,
    "Kueue": INFRASTRUCTURE,
    "RBAC": INFRASTRUCTURE,
}

# A label value must stay one of few: a class is an identifier, cut at this length.
CLASS_CHARS = 60
_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def error_class(error: str, exit_code: int | None = None, signal: int | None = None) -> str:
    """The class of a failure: its error's `<Class>: <what>` prefix, else (no such prefix, or
    one that is a secret: esd_worker.core.redact) the one its exit code and signal give
    (esd_worker.core.errors.classify_exit), as controller.results names causes."""
    named = error.split(":", 1)[0].strip()
    # A token or key id is an identifier too (`hf_…: …`, `AKIA…`, the HF_TOKEN value): a
    # label is published on /metrics, so a prefix the redaction owner would hide is no class.
    if _CLASS.fullmatch(named) and redact(named) == named:
        return named[:CLASS_CHARS]
    return classify_exit(exit_code, signal)[0]


def fault_domain(cls: str) -> str:
    """The fault domain of an error class (see the module docstring); unknown: worker."""
    return DOMAIN_OF.get(cls, WORKER)
