"""What the host says of memory, for the supervisor (esd_worker.serve.supervisor): the
container's memory limit, the kernel's OOM kills in it, a process group's resident bytes.

Owns reading cgroup (v2, then v1) and /proc files, each path injectable for tests; no
policy (what share of the limit a worker gets, what a kill means: the supervisor's).
Linux only: elsewhere each answer is "not known".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# The container's memory limit, cgroup v2 then v1; "max" or a number this large is none.
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),
                      Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
NO_LIMIT = 1 << 60
# cgroup v2's count of the kernel's OOM kills in the container: a SIGKILL it explains is the
# memory limit's, not a crash.
CGROUP_EVENTS_FILE = Path("/sys/fs/cgroup/memory.events")


def container_memory_limit(files: Sequence[Path] = CGROUP_LIMIT_FILES) -> int | None:
    """The container's memory limit in bytes (cgroup v2, else v1); None when there is none
    ("max", a number of 2**60 or more, no cgroup file: not in a container)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if not text.isdigit():
            return None  # "max": no limit
        value = int(text)
        return value if 0 < value < NO_LIMIT else None
    return None


def oom_kills(path: Path | None) -> int | None:
    """The kernel's OOM kills so far in the container (memory.events' oom_kill); None when
    not known (no file: cgroup v1 or not in a container)."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def group_rss(pgid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of every process of group `pgid` (the child and what it started)."""
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # After the command name, which may hold spaces and ')': state, ppid, pgrp.
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or a kernel thread
    return total
