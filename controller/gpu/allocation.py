"""The GPUs an inherited CUDA_VISIBLE_DEVICES allows, read as CUDA reads it (pure parsing).

A shared box hands a job its GPUs in CUDA_VISIBLE_DEVICES (SLURM's gres allocation, a
workstation's convention). NVML ignores that variable and always sees every GPU, so the
tracker (controller.gpu.gpus) maps the variable onto NVML indices here and manages only those.
This module owns the parsing only: it is given the variable's value and each GPU's
(NVML index, UUID) and reads no environment and calls no NVML (controller.gpu.gpus does both,
in `inherited_allocation`).

CUDA's rules, as far as they decide which GPUs are allowed:
- Comma-separated entries, each a decimal index or a GPU UUID; the GPUs are used in the
  order listed.
- A decimal index is read as an NVML index (PCI bus order), which is the numbering SLURM and
  nvidia-smi use and the one workers get (CUDA_DEVICE_ORDER=PCI_BUS_ID). CUDA's own default
  order, FASTEST_FIRST, can number GPUs differently on a box that mixes GPU models; a job
  that relies on that order should give UUIDs.
- A UUID is `GPU-` followed by the UUID nvidia-smi prints, or a prefix of it (`GPU-8932f937`)
  that matches exactly one GPU. An entry without the `GPU-` part is not read as a UUID.
- The first entry that names no GPU (an index NVML does not have, an unknown or ambiguous
  UUID, -1, anything else) ends the list: it and every entry after it are ignored, with a
  warning, except a lone end marker (-1, NoDevFiles, an empty entry) as the last entry.
  An empty value, -1 or NoDevFiles therefore allows no GPU at all.
- `MIG-…` entries name MIG instances, which are not whole GPUs the tracker can watch: they
  are refused with one error.
- A GPU named twice is used once, at its first place (with a warning).
When CUDA's behaviour is unclear the reading that allows fewer GPUs is chosen: the sweep may
use fewer GPUs than it was given, never one it was not given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from controller.errors import SweepError

VARIABLE = "CUDA_VISIBLE_DEVICES"
UUID_PREFIX = "GPU-"

_INDEX = re.compile(r"[0-9]+")
# Entries that mean "no more GPUs" by convention: -1 (CUDA's documentation), NoDevFiles
# (what SLURM sets when the job has no GPU device files), and an empty entry.
_END_MARKERS = ("-1", "NoDevFiles", "")
# Shortened UUIDs in log lines: "GPU-" and 8 hex digits identify a GPU on any real box.
_SHORT_UUID = len(UUID_PREFIX) + 8


@dataclass(frozen=True)
class Allocation:
    """What an inherited CUDA_VISIBLE_DEVICES allows.

    value: the variable as inherited. indices: the NVML indices it allows, in its order
    (empty: no GPU). stopped_at / reason: the first entry that names no GPU and why (None
    when every entry was read). ignored: that entry and every one after it. repeated:
    entries naming a GPU already listed.
    """

    value: str
    indices: tuple[int, ...]
    stopped_at: str | None = None
    reason: str = ""
    ignored: tuple[str, ...] = ()
    repeated: tuple[str, ...] = ()

    def describe(self, short: bool = False) -> str:
        """`CUDA_VISIBLE_DEVICES=<value>`; `short` cuts each UUID to GPU- and 8 hex digits."""
        value = self.value
        if short:
            value = ",".join(
                e[:_SHORT_UUID] + ".." if e.startswith(UUID_PREFIX) and len(e) > _SHORT_UUID
                else e
                for e in (p.strip() for p in value.split(","))
            )
        return f"{VARIABLE}={value}"

    def warnings(self) -> list[str]:
        """One line per thing a user should know: entries ignored, GPUs named twice."""
        lines: list[str] = []
        lone_end_marker = self.ignored == (self.stopped_at,) and self.stopped_at in _END_MARKERS
        if self.stopped_at is not None and not lone_end_marker:
            lines.append(
                f"{self.describe()}: entry {self.stopped_at!r} {self.reason}; CUDA stops "
                f"there, so {','.join(self.ignored)!r} is ignored and the sweep uses "
                f"{_gpus(self.indices)}"
            )
        if self.repeated:
            lines.append(
                f"{self.describe()}: {', '.join(map(repr, self.repeated))} name(s) a GPU "
                f"already listed; each GPU is used once ({_gpus(self.indices)})"
            )
        return lines


def _gpus(indices: Sequence[int]) -> str:
    return f"NVML GPU(s) {','.join(map(str, indices))}" if indices else "no GPU"


def needs_uuids(value: str) -> bool:
    """Whether reading `value` needs the GPUs' UUIDs (it has a `GPU-` entry)."""
    return any(e.strip().startswith(UUID_PREFIX) for e in value.split(","))


def parse_visible_devices(value: str, gpus: Sequence[tuple[int, str]]) -> Allocation:
    """The NVML indices `value` (a CUDA_VISIBLE_DEVICES value) allows on a box with `gpus`.

    `gpus`: every GPU NVML sees as (NVML index, UUID as NVML gives it, e.g.
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"); a UUID may be "" when `needs_uuids(value)`
    is False. Raises SweepError for a MIG entry (see the module docstring for the rules).
    """
    entries = [e.strip() for e in value.split(",")]
    known = {index for index, _ in gpus}
    indices: list[int] = []
    repeated: list[str] = []
    for position, entry in enumerate(entries):
        if entry.startswith("MIG-"):
            raise SweepError(
                f"{VARIABLE}={value} names MIG instance {entry}: the sweep schedules whole "
                f"GPUs it can watch with NVML, not MIG instances; give whole GPUs (indices or "
                f"GPU- UUIDs) in {VARIABLE}, or unset it"
            )
        index, reason = _resolve(entry, known, gpus)
        if index is None:
            return Allocation(value, tuple(indices), entry, reason, tuple(entries[position:]),
                              tuple(repeated))
        if index in indices:
            repeated.append(entry)
        else:
            indices.append(index)
    return Allocation(value, tuple(indices), repeated=tuple(repeated))


def _resolve(
    entry: str, known: set[int], gpus: Sequence[tuple[int, str]]
) -> tuple[int | None, str]:
    """(NVML index, "") for an entry that names one GPU; (None, why not) otherwise."""
    if entry in _END_MARKERS:
        return None, "ends the list"
    if _INDEX.fullmatch(entry):
        index = int(entry)
        if index in known:
            return index, ""
        return None, f"is not a GPU (NVML sees {len(known)}: indices {_range(known)})"
    if entry.startswith(UUID_PREFIX):
        matches = [index for index, uuid in gpus if uuid and uuid.startswith(entry)]
        if len(matches) == 1:
            return matches[0], ""
        if not matches:
            return None, "matches no GPU's UUID"
        return None, f"matches more than one GPU's UUID (NVML GPUs {_range(matches)})"
    return None, f"is neither a GPU index nor a {UUID_PREFIX} UUID"


def _range(indices: set[int] | list[int]) -> str:
    return ",".join(map(str, sorted(indices))) or "none"
