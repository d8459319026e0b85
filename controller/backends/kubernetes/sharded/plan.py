"""The shard plan of a sharded Kubernetes run: the run's classes, units, shard counts, packing.

Owns how the models to run are split into the shards of one Indexed Job per resource class:
the classes a run uses (size bands) and which class a model goes to (by the bytes it has on
disk: its weights, with its base's for an adapter; or "gpu-x<N>" for the models the GPU
rule gives N > 1 GPUs: controller.gpu.gpurule), which models must share a shard (a base and
the adapters that follow it), how many shards a class gets, the greedy packing by bytes,
the line of a model too big for its class's download budget, and a shard's model-list CSV.
Pure: no store, no hub, no Kubernetes; what a class's pods ask for (common.resources),
where a shard is written (esd_worker.core.store.layout.shard_key) and how sizes are found
(controller.weights.sizing) are not its business. Streaming: every step takes an iterator
and keeps at most one unit and one shard, so a list of millions of models is planned in
constant memory.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from controller.backends.kubernetes.common.resources import (
    GIB,
    MAX_MEMORY_GIB,
    ResourceClass,
    disk_for,
    disk_gib,
    memory_for,
)
from esd_worker.core.models.modellist import ADAPTER_RELATIONS, ModelRow
from esd_worker.core.models.naming import split_model_ref

API_COMPLETIONS_LIMIT = 100_000  # completions of an Indexed Job with backoffLimitPerIndex
SHARD_COLUMNS = ("model_id", "base_model_relation", "source_model", "size_bytes")
SMALL_BYTES = 8 * 10**9  # the "-small" classes: models that fit a 16 GiB single-GPU node


def default_classes(
    *, device: str, gpus_per_job: int, large_bytes: int
) -> tuple[ResourceClass, ...]:
    """The classes a run uses unless told otherwise, smallest first (classify's order).

    Three size bands, each asking for what its biggest model needs (memory_for, disk_for),
    so a shard of small models fits a 16 GiB single-GPU node and only big models wait for
    big nodes: "<kind>-small" up to SMALL_BYTES, "<kind>" up to `large_bytes` (those that
    fit a 24 GiB GPU), "<kind>-large" beyond (64Gi of memory, at least 400Gi of disk: two
    140 GB checkpoints and room). kind is "gpu", or "cpu" for device "cpu" or gpus_per_job
    0 (CPU pods, no GPU request). A band is left out when `large_bytes` is below it.

    Disk: the -small class holds two of its largest models (the one analysed and the next
    one downloaded ahead: 23Gi), the middle class one (36Gi at the default 30 GB; smaller
    models still get their read-ahead within that budget), so both schedule on the ~100 GB
    boot disks clouds give GPU nodes by default (GKE: ~44 GiB allocatable). -large wants
    node-local NVMe or a bigger root volume (docs/kubernetes.md); no class fits a 20 GiB
    root volume, which the worker image itself half fills.
    """
    if large_bytes <= 0:
        raise ValueError(f"large_bytes must be > 0, got {large_bytes}")
    if gpus_per_job < 0:
        raise ValueError(f"gpus_per_job must be >= 0, got {gpus_per_job}")
    cpu = device == "cpu" or gpus_per_job == 0
    kind, gpus = ("cpu", 0) if cpu else ("gpu", gpus_per_job)
    out = []
    if large_bytes > SMALL_BYTES:
        out.append(ResourceClass(f"{kind}-small", gpus, SMALL_BYTES, memory_for(SMALL_BYTES),
                                 disk_for(SMALL_BYTES)))
    out.append(ResourceClass(kind, gpus, large_bytes, memory_for(large_bytes),
                             disk_for(large_bytes, copies=1)))
    large_disk = max(400, disk_gib(large_bytes, 1))
    out.append(ResourceClass(f"{kind}-large", gpus, None, f"{MAX_MEMORY_GIB}Gi",
                             f"{large_disk}Gi"))
    return tuple(out)


def multi_gpu_class(gpus: int, largest: int) -> ResourceClass:
    """The class of the models the GPU rule gives `gpus` (> 1) GPUs each: "gpu-x<gpus>", its
    pods asking for that many, with the memory and disk of its largest model (`largest`
    weight bytes, with its base for an adapter; at least gpu-large's 400Gi of disk, and
    room for that model once: two of a 700 GB model would ask for a disk no node has)."""
    if gpus < 2 or largest < 0:
        raise ValueError(f"gpus must be >= 2 and largest >= 0, got {gpus}, {largest}")
    return ResourceClass(f"gpu-x{gpus}", gpus, None, memory_for(largest),
                         f"{max(400, disk_gib(largest, 1))}Gi")


def classify(size: int, classes: Sequence[ResourceClass]) -> ResourceClass:
    """The first class whose max_bytes is None or >= size (classes smallest first)."""
    for cls in classes:
        if cls.max_bytes is None or cls.max_bytes >= size:
            return cls
    names = ", ".join(f"{c.name} (<= {c.max_bytes})" for c in classes) or "none"
    raise ValueError(f"no resource class takes a model of {size} bytes: {names}")


@dataclass(frozen=True, slots=True)
class Item:
    """One model to shard: ref (id[@revision] or a local path, as the worker takes it), key
    (its model_key), relation, source_model (an adapter's base), size (bytes; an estimate
    when unknown), gpus (the GPU rule's count for it: 1 unless it needs several),
    base_size (an adapter's base's bytes, which the worker downloads and holds with it;
    0 for a model that is no adapter: with_bases fills it in)."""

    ref: str
    key: str
    relation: str
    source_model: str | None
    size: int
    gpus: int = 1
    base_size: int = 0

    @classmethod
    def of(cls, row: ModelRow, size: int, gpus: int = 1) -> Item:
        return cls(row.ref, row.key, row.relation, row.source_model, size, gpus)

    @property
    def is_adapter(self) -> bool:
        return self.relation in ADAPTER_RELATIONS

    @property
    def footprint(self) -> int:
        """The bytes on the pod's disk while this model is analysed: its own and its base's.
        What decides its class and what its class's download budget must hold."""
        return self.size + self.base_size

    @property
    def names(self) -> tuple[str, str]:
        """The names an adapter's source_model may give this model by: its ref, its id."""
        return self.ref, split_model_ref(self.ref)[0]


def with_bases(items: Iterable[Item], base_size: Callable[[str], int]) -> Iterator[Item]:
    """The items, each adapter with its base's bytes (base_size).

    A base listed before its adapters (esd_worker.core.models.modellist.base_first puts
    them right after it) gives its own size, the list's; adapters of a base not listed
    ask `base_size(source_model)` (controller.weights.sizing.Sizer.base_size) once per run
    of them. Streaming, as units() is: one base remembered.
    """
    listed: Item | None = None  # the last model that is no adapter
    asked: tuple[str, int] | None = None  # the last base asked for, and its bytes
    for item in items:
        if not item.is_adapter:
            listed = item
        elif item.source_model:
            source = item.source_model
            if listed is not None and source in listed.names:
                item = replace(item, base_size=listed.size)
            else:
                if asked is None or asked[0] != source:
                    asked = source, base_size(source)
                item = replace(item, base_size=asked[1])
        yield item


@dataclass(frozen=True)
class Unit:
    """Models that go in the same shard: a base and the adapters of it that follow it, so
    the worker downloads the base once. size: the bytes it downloads, the items' sizes and,
    for adapters of a base not listed with them, that base once."""

    items: tuple[Item, ...]
    size: int

    @property
    def gpus(self) -> int:
        """The most GPUs one of its models needs (the base's, usually): the unit's pods'."""
        return max(item.gpus for item in self.items)

    @property
    def footprint(self) -> int:
        """The most bytes on disk for one of its models (with its base): its class's."""
        return max(item.footprint for item in self.items)


def unit_of(items: Sequence[Item]) -> Unit:
    """The unit of these items (a base and its adapters, or adapters of one base)."""
    first = items[0]
    base = first.base_size if first.is_adapter else 0  # else the base is an item
    return Unit(tuple(items), sum(item.size for item in items) + base)


def units(items: Iterable[Item]) -> Iterator[Unit]:
    """Consecutive items grouped into units, in order.

    A non-adapter starts a unit. An adapter joins the current unit when its source_model
    names the unit's base (its ref or its model id, as esd_worker.core.models.modellist.base_first
    pairs them) or equals the source_model of the adapter right before it (adapters of the
    same unlisted base share that base's download); otherwise it starts a unit of its own.
    Order the rows with base_first first, or adapters listed apart from their base stay
    apart.
    """
    current: list[Item] = []
    base_names: tuple[str, ...] = ()  # the ref and id of the current unit's base, if any
    for item in items:
        if item.is_adapter and current and item.source_model is not None:
            prev = current[-1]
            same_base = prev.is_adapter and prev.source_model == item.source_model
            if item.source_model in base_names or same_base:
                current.append(item)
                continue
        if current:
            yield unit_of(current)
        current = [item]
        base_names = () if item.is_adapter else item.names
    if current:
        yield unit_of(current)


def too_big_error(item: Item, cls: ResourceClass, budget: int, remedy: str) -> str:
    """The one line of a model whose download (with its base) passes the download budget of
    its class's pods: the model, its bytes, the class, the budget, and `remedy` (where
    the budget comes from and the flag that raises it)."""
    base = f" with its base {item.source_model}" if item.base_size else ""
    return (f"ModelTooLarge: {item.ref} needs {item.footprint / 10**9:.1f} GB on disk{base}, "
            f"more than the {budget / GIB:.1f} GiB download budget of class {cls.name}'s "
            f"pods: {remedy}")


@dataclass(frozen=True)
class Shard:
    """One shard: index (0-based, the Job's completion index), its items, their bytes."""

    index: int
    items: tuple[Item, ...]
    size: int


def shard_count(
    *, total_bytes: int, total_models: int, parallelism: int, max_models: int,
    per_slot: int = 4, limit: int = API_COMPLETIONS_LIMIT, min_shard_bytes: int = 0,
) -> int:
    """How many shards one class's models are packed into (the packer may close a few more).

    parallelism * per_slot, so that every parallel slot takes about per_slot shards one
    after another and the last ones to finish are short (the tail); at least
    ceil(total_models / max_models); at most total_models (a shard holds a model) and
    `limit` (the API's bound on an Indexed Job's completions with backoffLimitPerIndex);
    1 when there is any model, 0 when there is none. min_shard_bytes > 0 also keeps shards
    from being smaller than that (not worth a pod's start-up), unless max_models needs more.
    Raises ValueError when max_models cannot be kept within `limit` shards.
    """
    for name, value in (("parallelism", parallelism), ("max_models", max_models),
                        ("per_slot", per_slot), ("limit", limit)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if total_bytes < 0 or total_models < 0 or min_shard_bytes < 0:
        raise ValueError("total_bytes, total_models and min_shard_bytes must be >= 0")
    if total_models == 0:
        return 0
    needed = -(-total_models // max_models)
    if needed > limit:
        raise ValueError(
            f"{total_models} models at most {max_models} a shard need {needed} shards, more "
            f"than {limit}: allow at least {-(-total_models // limit)} models a shard"
        )
    count = parallelism * per_slot
    if min_shard_bytes:
        count = min(count, max(1, total_bytes // min_shard_bytes))
    return max(needed, min(count, total_models, limit), 1)


def target_bytes(total_bytes: int, shards: int) -> int:
    """ceil(total_bytes / shards), at least 1: the bytes a shard is filled up to."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return max(1, -(-total_bytes // shards))


class Packer:
    """Greedy in list order: a unit goes into the current shard unless that would pass target
    bytes (and the shard is not empty) or max_models; units are never split (a unit bigger
    than the target is a shard of its own, one of more than max_models models too). Indexes
    count from 0.

    Each shard ends a little under the target, so a list packs into somewhat more shards
    than total / target (about one average unit's worth of bytes less per shard), and
    max_models closes add to that: compare `shards` with the Job's limits after finish().
    """

    def __init__(self, *, target_bytes: int, max_models: int) -> None:
        if target_bytes < 1 or max_models < 1:
            raise ValueError(
                f"target_bytes and max_models must be >= 1, got {target_bytes}, {max_models}"
            )
        self.target_bytes = target_bytes
        self.max_models = max_models
        self.shards = 0  # closed so far
        self._items: list[Item] = []
        self._bytes = 0

    def add(self, unit: Unit) -> Shard | None:
        """Put `unit` in; returns the shard that was closed to make room, if any."""
        closed = None
        if self._items and (self._bytes + unit.size > self.target_bytes
                            or len(self._items) + len(unit.items) > self.max_models):
            closed = self._close()
        self._items.extend(unit.items)
        self._bytes += unit.size
        return closed

    def finish(self) -> Shard | None:
        """The last, partial shard (None when nothing is left); counted in `shards`."""
        return self._close() if self._items else None

    def _close(self) -> Shard:
        shard = Shard(self.shards, tuple(self._items), self._bytes)
        self.shards += 1
        self._items, self._bytes = [], 0
        return shard


def shard_csv(items: Sequence[Item]) -> bytes:
    """The shard as a model-list CSV that esd_worker.core.models.modellist.read_model_list reads
    back into
    the same rows: the ref as model_id (parse_ref splits a hub ref's last '@' off as the
    revision and takes a local path as written), the csv module's quoting so commas, quotes
    and line breaks survive, and size_bytes (a column the worker keeps as metadata)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SHARD_COLUMNS)
    for item in items:
        writer.writerow((item.ref, item.relation, item.source_model or "", item.size))
    return out.getvalue().encode("utf-8")
