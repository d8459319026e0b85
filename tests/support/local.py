"""Builders for the local backend's tests: tiny Python scripts as tasks, fake GPUs, a concurrency
probe."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

from controller.backends.base import Outcome, Task
from controller.backends.local.settings import LocalSettings
from controller.gpu.gpus import GpuSettings, GpuTracker, Nvml
from tests.support.nvml import FakePynvml

FAST = LocalSettings(max_retries=2, backoff_s=0.01, backoff_max_s=0.05, terminate_grace_s=2.0)


def make_task(key: str, code: str, **env: str) -> Task:
    """A task running `code` in a fresh Python interpreter."""
    return Task(key=key, argv=(sys.executable, "-c", textwrap.dedent(code)), label=key, env=env)


def exit_task(key: str, code: int) -> Task:
    return make_task(key, f"import sys; sys.exit({code})")


def make_tracker(used_mib: list[float], **settings: Any) -> GpuTracker:
    """A tracker over fake GPUs that read `used_mib` (MiB) on every poll."""
    settings.setdefault("poll_interval_s", 0.005)
    settings.setdefault("max_checks", 2)
    return GpuTracker(Nvml(FakePynvml([[mib] for mib in used_mib])), GpuSettings(**settings))


class Concurrency:
    """on_start/on_outcome callbacks that track how many tasks run at once."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.gpus_in_use: set[int] = set()
        self.overlap = False

    def start(self, task: Task, gpus: tuple[int, ...]) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        if self.gpus_in_use & set(gpus):
            self.overlap = True
        self.gpus_in_use |= set(gpus)

    def end(self, outcome: Outcome) -> None:
        self.now -= 1
        self.gpus_in_use -= set(outcome.gpus)


def by_key(outcomes: list[Outcome]) -> dict[str, Outcome]:
    return {o.task.key: o for o in outcomes}
