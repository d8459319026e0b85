"""pynvml faked at its function boundary (the only NVML code the controller calls), for the GPU
tracker and local-backend tests."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 2**20


TOTAL_MIB = 81559.0  # an H100's memory


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeMemory:
    used: int
    free: int
    total: int


class FakePynvml:
    """pynvml at its function boundary: `readings[i]` is GPU i's used MiB, one value per read.

    The last value of a script repeats once it is reached. `fail_reads` holds GPU indices
    whose reads raise NVMLError; `v2` False makes the _v2 entry point missing, as with old
    drivers.
    """

    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(
        self,
        readings: Sequence[Iterable[float]],
        *,
        init_error: str | None = None,
        v2: bool = True,
    ) -> None:
        self.scripts = [deque(r) for r in readings]
        self.init_error = init_error
        self.v2 = v2
        self.fail_reads: set[int] = set()
        self.versions: list[int | None] = []
        self.init_calls = 0
        self.shutdown_calls = 0

    def script(self, index: int, *used_mib: float) -> None:
        """From now on GPU `index` reads these values (the last one repeating)."""
        self.scripts[index] = deque(used_mib)

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.scripts)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        if not 0 <= index < len(self.scripts):
            raise FakeNVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetMemoryInfo(self, handle: tuple[str, int], version: int | None = None) -> Any:
        if version is not None and not self.v2:
            raise FakeNVMLError("Function Not Found")
        self.versions.append(version)
        index = handle[1]
        if index in self.fail_reads:
            raise FakeNVMLError("GPU is lost")
        script = self.scripts[index]
        used = script.popleft() if len(script) > 1 else script[0]
        used_bytes = int(used * MIB)
        total = int(TOTAL_MIB * MIB)
        return FakeMemory(used=used_bytes, free=total - used_bytes, total=total)
