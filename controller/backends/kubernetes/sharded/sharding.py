"""A sharded run's shards: the work cut by resource class and bytes, written to the store.

Owns reading the run's Work twice (once to total each class, once to pack it: a list of
millions is never held), the GPU budget's split across classes (a gpu-x<N> class's pods
count N GPUs each), and writing each shard as a
model list at `_shards/<run_id>/<class>/<index>.csv` (esd_worker.core.store.layout) as soon as it is
packed. The cutting itself is controller.backends.kubernetes.sharded.plan (pure); sizes come from
controller.weights.sizing.
Does not build or create Jobs (controller.backends.kubernetes.sharded.backend does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from controller.backends.base import Task
from controller.backends.kubernetes.common.resources import ResourceClass
from controller.backends.kubernetes.sharded.plan import (
    Item,
    Packer,
    Shard,
    Unit,
    classify,
    multi_gpu_class,
    shard_count,
    shard_csv,
    target_bytes,
    units,
)
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import shard_key
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

SizeFn = Callable[[ModelRow], int]
GpuFn = Callable[[ModelRow], int]  # a model's GPU count (controller.gpu.counts.GpuCounts)


@dataclass
class ClassShards:
    """One class's shards: models per shard by index (the Job's completion index), bytes."""

    cls: ResourceClass
    parallelism: int = 1
    models: int = 0
    bytes: int = 0
    per_shard: list[int] = field(default_factory=list)
    largest: int = 0  # the biggest model's bytes (a gpu-x<N> class is sized from it)

    @property
    def shards(self) -> int:
        return len(self.per_shard)


def _units(work: Iterable[Task], size: SizeFn, gpus: GpuFn | None) -> Iterator[Unit]:
    items = (Item.of(task.row, size(task.row), gpus(task.row) if gpus is not None else 1)
             for task in work if task.row is not None)
    return units(items)


def _class_of(unit: Unit, classes: Sequence[ResourceClass],
              totals: dict[str, ClassShards]) -> ClassShards:
    """The unit's class: gpu-x<N> when the GPU rule gives it N > 1 GPUs (made on first use,
    sized once pass 1 knows its largest model), else by its biggest model's bytes (the base,
    usually, decides where the whole unit runs)."""
    if unit.gpus > 1:
        name = f"gpu-x{unit.gpus}"
        if name not in totals:
            totals[name] = ClassShards(multi_gpu_class(unit.gpus, 0))
        return totals[name]
    return totals[classify(max(item.size for item in unit.items), classes).name]


def split_parallelism(totals: Sequence[ClassShards], budget: int) -> None:
    """Share `budget` GPUs (or, for CPU classes, pods) across the classes in proportion to
    their bytes: each class gets at least one pod and at most one pod per shard."""
    weight = sum(c.bytes for c in totals) or 1
    for c in totals:
        gpus = max(c.cls.gpus, 1)
        share = max(budget * c.bytes / weight, gpus)
        c.parallelism = max(1, min(c.shards, int(share // gpus)))


def write_shards(
    work: Iterable[Task], *, store: Store, run_id: str, classes: Sequence[ResourceClass],
    size: SizeFn, budget: int, max_models: int, threads: int = 16, gpus: GpuFn | None = None,
) -> list[ClassShards]:
    """Cut the work into shards and write them; the classes that got any, in class order
    (then the gpu-x<N> classes of the models `gpus` gives several GPUs, fewest first).

    Pass 1 totals bytes and models per class and picks each class's shard count
    (controller.backends.kubernetes.sharded.plan.shard_count: ~4 shards per parallel pod, at most
    max_models
    models each); pass 2 packs units in list order and writes each shard as it closes.
    """
    totals = {c.name: ClassShards(c) for c in classes}
    for unit in _units(work, size, gpus):
        c = _class_of(unit, classes, totals)
        c.models += len(unit.items)
        c.bytes += unit.size
        c.largest = max(c.largest, *(item.size for item in unit.items))
    named = {k.name for k in classes}
    multi = sorted((c for c in totals.values() if c.cls.name not in named),
                   key=lambda c: c.cls.gpus)
    for c in multi:
        c.cls = multi_gpu_class(c.cls.gpus, c.largest)
    used = [c for c in totals.values() if c.models and c.cls.name in named] + multi
    # Provisional shard counts (one pod per shard at most) to split the budget, then final.
    for c in used:
        c.per_shard = [0] * shard_count(total_bytes=c.bytes, total_models=c.models,
                                        parallelism=budget, max_models=max_models)
    split_parallelism(used, budget)
    packers: dict[str, Packer] = {}
    for c in used:
        count = shard_count(total_bytes=c.bytes, total_models=c.models,
                            parallelism=c.parallelism, max_models=max_models)
        packers[c.cls.name] = Packer(target_bytes=target_bytes(c.bytes, count),
                                     max_models=max_models)
        c.per_shard = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: list[Future[None]] = []

        def emit(c: ClassShards, shard: Shard | None) -> None:
            if shard is None:
                return
            assert shard.index == len(c.per_shard), "shards are written in index order"
            c.per_shard.append(len(shard.items))
            key = shard_key(run_id, c.cls.name, shard.index)
            pending.append(pool.submit(store.put_bytes, key, shard_csv(shard.items)))
            if len(pending) >= 4 * threads:  # bounded: a million shards are not all queued
                _settle(pending)

        for unit in _units(work, size, gpus):
            c = _class_of(unit, classes, totals)
            emit(c, packers[c.cls.name].add(unit))
        for c in used:
            emit(c, packers[c.cls.name].finish())
        _settle(pending)
    for c in used:  # fewer shards than planned when units are big: no idle pods
        c.parallelism = max(1, min(c.parallelism, c.shards))
        log.info("class %s: %d model(s), %.1f GB, %d shard(s) of ~%d model(s), %d pod(s) at "
                 "once", c.cls.name, c.models, c.bytes / 1e9, c.shards,
                 math.ceil(c.models / max(c.shards, 1)), c.parallelism)
    return used


def _settle(pending: list[Future[None]]) -> None:
    """Wait for the writes so far; the first failed one raises (a shard not written must
    not be handed to a pod)."""
    for future in pending:
        future.result()
    pending.clear()
