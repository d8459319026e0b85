"""How many CPUs this process may use: the cores it may run on (its affinity) within its
cgroup's CPU quota (a container's or a Kubernetes pod's CPU limit), and a share the
controller gives a worker beside others on one machine ($ESD_CPU_SHARE).

Owns reading those limits (torch-free: the controller asks too). Does not decide what the
CPUs are used for (esd_worker.analysis.hostsolve, the controller's worker threads).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

from esd_worker.core.echo import quoted

log = logging.getLogger(__name__)

CPU_SHARE_ENV = "ESD_CPU_SHARE"  # CPUs the controller gives this worker on a shared machine
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The bad $ESD_CPU_SHARE values already warned about: usable_cpus runs more than once in a
# process (each GPU worker's share, each analysis), and one line says it.
_warned: set[str] = set()
_warned_lock = threading.Lock()


def usable_cpus(*, cgroup: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                env: dict[str, str] | None = None) -> float:
    """The CPUs this process may keep busy: min(affinity, cgroup quota, $ESD_CPU_SHARE),
    at least 1."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        cores = float(os.cpu_count() or 1)
    limits = [cores, cgroup_quota(cgroup, proc_cgroup)]
    share = (os.environ if env is None else env).get(CPU_SHARE_ENV, "")
    given = cpu_share(share)
    if given is not None:
        limits.append(given)
    elif share.strip():
        _warn_bad_share(share, max(1.0, min(limits)))
    return max(1.0, min(limits))


def cpu_share(value: str) -> float | None:
    """$ESD_CPU_SHARE's CPUs: a finite number above 0; None when unset, blank or anything
    else (text, nan, inf, 0 or less: no share a controller would give)."""
    try:
        share = float(value)
    except ValueError:
        return None
    return share if math.isfinite(share) and share > 0 else None


def _warn_bad_share(value: str, cpus: float) -> None:
    """One warning a process for each bad value: the variable, the value (echoed: it may
    hold anything, a secret or escape sequences included) and the CPUs used instead."""
    with _warned_lock:
        if value in _warned:
            return
        _warned.add(value)
    log.warning("%s=%s is not a number of CPUs above 0: ignored, using %g CPU(s) (the "
                "cores this process may run on, within its cgroup's CPU quota)",
                CPU_SHARE_ENV, quoted(value), cpus)


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                 ) -> float:
    """The CPU quota of this process's cgroup in CPUs, the smallest on its path up to the
    root (cgroup v2 cpu.max; v1 cpu.cfs_quota_us / cpu.cfs_period_us); inf where there is
    none or it cannot be read."""
    v2, v1 = "", ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and not controllers:
                v2 = path
            elif "cpu" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    quotas = [_v2_quota(folder) for folder in _up(root, v2)]
    quotas += [_v1_quota(folder) for folder in _up(root / "cpu", v1)]
    return min(quotas, default=math.inf)


def _up(base: Path, path: str) -> list[Path]:
    """`base`/`path` and each folder above it up to `base`."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(folder: Path) -> float:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return math.inf if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return math.inf


def _v1_quota(folder: Path) -> float:
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
        return math.inf if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError, ZeroDivisionError):
        return math.inf
