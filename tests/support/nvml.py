"""pynvml faked at its function boundary (the only NVML code the controller calls), for the GPU
tracker and local-backend tests."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 2**20


TOTAL_MIB = 81559.0  # an H100's memory
NAME = "NVIDIA H100 80GB HBM3"


def fake_uuid(index: int) -> str:
    """GPU `index`'s default UUID, as nvidia-smi prints one: the same in every run."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'esd-sweep fake GPU {index}')}"


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
    whose memory reads raise NVMLError, `fail_info` those whose UUID and name reads do; `v2`
    False makes the _v2 entry point missing, as with old drivers. `uuids` and `names` are
    what nvmlDeviceGetUUID and nvmlDeviceGetName answer (fake_uuid(i) and an H100 by
    default; settable per test), as str, or as bytes with `as_bytes` (older bindings).
    `memory_reads` records the GPU index of every memory read, `info_reads` of every UUID
    or name read.
    """

    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(
        self,
        readings: Sequence[Iterable[float]],
        *,
        init_error: str | None = None,
        v2: bool = True,
        uuids: Sequence[str] | None = None,
        as_bytes: bool = False,
    ) -> None:
        self.scripts = [deque(r) for r in readings]
        self.init_error = init_error
        self.v2 = v2
        self.uuids = list(uuids) if uuids is not None else [
            fake_uuid(i) for i in range(len(self.scripts))
        ]
        self.names = [NAME] * len(self.scripts)
        self.as_bytes = as_bytes
        self.fail_reads: set[int] = set()
        self.fail_info: set[int] = set()
        self.memory_reads: list[int] = []
        self.info_reads: list[int] = []
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
        self.memory_reads.append(index)
        if index in self.fail_reads:
            raise FakeNVMLError("GPU is lost")
        script = self.scripts[index]
        used = script.popleft() if len(script) > 1 else script[0]
        used_bytes = int(used * MIB)
        total = int(TOTAL_MIB * MIB)
        return FakeMemory(used=used_bytes, free=total - used_bytes, total=total)

    def nvmlDeviceGetUUID(self, handle: tuple[str, int]) -> str | bytes:
        return self._info(handle, self.uuids)

    def nvmlDeviceGetName(self, handle: tuple[str, int]) -> str | bytes:
        return self._info(handle, self.names)

    def _info(self, handle: tuple[str, int], values: list[str]) -> str | bytes:
        index = handle[1]
        self.info_reads.append(index)
        if index in self.fail_info:
            raise FakeNVMLError("GPU is lost")
        return values[index].encode() if self.as_bytes else values[index]
