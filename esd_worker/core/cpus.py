"""How many CPUs this process may use: the cores it may run on (its affinity) within its
cgroup's CPU quota (a container's or a Kubernetes pod's CPU limit), and a share the
controller gives a worker beside others on one machine ($ESD_CPU_SHARE).

Owns reading those limits (torch-free: the controller asks too). Does not decide what the
CPUs are used for (esd_worker.analysis.hostsolve, the controller's worker threads).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

CPU_SHARE_ENV = "ESD_CPU_SHARE"  # CPUs the controller gives this worker on a shared machine
CGROUP_ROOT = Path("/sys/fs/cgroup")


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
    with contextlib.suppress(ValueError):  # not a number: no share given
        limits.append(float(share) if share.strip() else math.inf)
    return max(1.0, min(limits))


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
