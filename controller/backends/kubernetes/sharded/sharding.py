"""A sharded run's shards: the work cut by resource class and bytes, written to the store.

Owns reading the run's Work twice (once to total each class, once to pack it: a list of
millions is never held), the GPU budget's split across classes (a gpu-x<N> class's pods
count N GPUs each), keeping out of every shard a model its class's pods cannot hold
(handed to the caller instead), and writing each shard as a
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
    unit_of,
    units,
    with_bases,
)
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.store.layout import shard_key
from esd_worker.core.store.stores import Store

log = logging.getLogger(__name__)

SizeFn = Callable[[ModelRow], int]
GpuFn = Callable[[ModelRow], int]  # a model's GPU count (controller.gpu.counts.GpuCounts)
BaseSizeFn = Callable[[str], int]  # an adapter's base's bytes, by its source_model
BudgetFn = Callable[[ResourceClass], "int | None"]  # a class's pods' download budget
TooBigFn = Callable[[Item, ResourceClass, int], None]  # a model past its class's budget


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


def _units(work: Iterable[Task], size: SizeFn, gpus: GpuFn | None,
           base_size: BaseSizeFn | None) -> Iterator[Unit]:
    items: Iterable[Item] = (
        Item.of(task.row, size(task.row), gpus(task.row) if gpus is not None else 1)
        for task in work if task.row is not None)
    if base_size is not None:
        items = with_bases(items, base_size)
    return units(items)


def _class_of(unit: Unit, classes: Sequence[ResourceClass],
              totals: dict[str, ClassShards]) -> ClassShards:
    """The unit's class: gpu-x<N> when the GPU rule gives it N > 1 GPUs (made on first use,
    sized once pass 1 knows its largest model), else by the most bytes one of its models
    has on disk, with its base for an adapter (the base, usually, decides where the whole
    unit runs: a LoRA on a 70B base goes where the 70B base fits)."""
    if unit.gpus > 1:
        name = f"gpu-x{unit.gpus}"
        if name not in totals:
            totals[name] = ClassShards(multi_gpu_class(unit.gpus, 0))
        return totals[name]
    return totals[classify(unit.footprint, classes).name]


def _within_budget(unit: Unit, c: ClassShards, budget_of: BudgetFn,
                   too_big: TooBigFn | None) -> Unit | None:
    """The unit without the models whose download (with their base) passes the download
    budget of their class's pods: each is handed to too_big (pass 2 reports them) rather
    than to a pod that could only fail it or be evicted for it. None: nothing fits.

    A gpu-x<N> class is sized from its largest model once pass 1 is over; this unit is
    checked against the class sized for it alone, which is never bigger, so both passes
    drop the same models."""
    cls = multi_gpu_class(unit.gpus, unit.footprint) if unit.gpus > 1 else c.cls
    budget = budget_of(cls)
    if budget is None or unit.footprint <= budget:
        return unit
    kept = []
    for item in unit.items:
        if item.footprint <= budget:
            kept.append(item)
        elif too_big is not None:
            too_big(item, cls, budget)
    return unit_of(kept) if kept else None


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
    base_size: BaseSizeFn | None = None, cache_budget_of: BudgetFn | None = None,
    on_too_big: TooBigFn | None = None,
) -> list[ClassShards]:
    """Cut the work into shards and write them; the classes that got any, in class order
    (then the gpu-x<N> classes of the models `gpus` gives several GPUs, fewest first).

    Pass 1 totals bytes and models per class and picks each class's shard count
    (controller.backends.kubernetes.sharded.plan.shard_count: ~4 shards per parallel pod,
    at most max_models models each); pass 2 packs units in list order and writes each
    shard as it closes. An adapter counts with its base (base_size: the bytes of a base
    not listed before it, controller.weights.sizing.Sizer.base_size; None: adapters count
    alone). cache_budget_of: the download budget of a class's pods (None: unbounded); a
    model that does not fit its class's goes to no shard and is handed once to
    on_too_big(item, class, budget), so no pod is given a model it cannot hold.
    """
    def planned(report: TooBigFn | None) -> Iterator[tuple[ClassShards, Unit]]:
        for unit in _units(work, size, gpus, base_size):
            c = _class_of(unit, classes, totals)
            kept = unit if cache_budget_of is None else _within_budget(
                unit, c, cache_budget_of, report)
            if kept is not None:
                yield c, kept

    totals = {c.name: ClassShards(c) for c in classes}
    for c, unit in planned(None):  # pass 2 reports the models too big, once
        c.models += len(unit.items)
        c.bytes += unit.size
        c.largest = max(c.largest, unit.footprint)
    named = {k.name for k in classes}
    multi = sorted((c for c in totals.values() if c.cls.name not in named and c.models),
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

        for c, unit in planned(on_too_big):
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
