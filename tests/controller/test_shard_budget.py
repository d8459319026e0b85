"""The shard plan against the pods' disks: adapters sized and classed with their base, and no
model's download bigger than the download budget of the pod it goes to
(controller.backends.kubernetes.sharded.plan and .sharding, common.resources.cache_budget).

A LoRA is small, but the worker downloads its base too and holds both while it analyses it:
a LoRA on a 70B base classed by its own 200 MB would land in gpu-small (23Gi of disk) and
be evicted for the 141 GB it downloads. Shards are written to a local store and read back,
as a pod reads them.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from controller.backends.base import Task
from controller.backends.kubernetes.common.resources import ResourceClass, cache_budget
from controller.backends.kubernetes.sharded.plan import Item, default_classes, with_bases
from controller.backends.kubernetes.sharded.sharding import ClassShards, write_shards
from esd_worker.core.models.modellist import ModelRow, base_first, read_model_list
from esd_worker.core.models.naming import parse_ref
from esd_worker.core.store.layout import shard_key
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.stores import Store

GB = 10**9
RUN_ID = "20261126T170000Z-budget"
CLASSES = default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB)
LLAMA_70B = "meta-llama/Llama-3.1-70B"  # 141 GB of bf16 weights
BASES = {LLAMA_70B: 141 * GB, "org/base-7b": 14 * GB, "org/base-1b": 2 * GB,
         "org/base-405b": 810 * GB}


def make_row(ref: str, size: int, relation: str = "", source: str | None = None) -> ModelRow:
    model_id, revision, problem = parse_ref(ref)
    assert problem is None, problem
    return ModelRow(model_id, revision, relation, source, metadata={"size_bytes": str(size)})


def lora(name: str, base: str, size: int = 200 * 10**6) -> ModelRow:
    return make_row(f"org/{name}", size, "lora", base)


class BaseSizes:
    """The Sizer's base_size for these tests: BASES, each base asked for counted."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()

    def __call__(self, source: str) -> int:
        self.asked[source] += 1
        return BASES[source]


def plan(store: Store, rows: Sequence[ModelRow], base_size: Callable[[str], int], *,
         too_big: list[tuple[Item, ResourceClass, int]] | None = None) -> list[ClassShards]:
    return write_shards(
        [Task.for_model(r) for r in rows], store=store, run_id=RUN_ID, classes=CLASSES,
        size=lambda r: int(r.metadata["size_bytes"]), budget=8, max_models=50,
        base_size=base_size, cache_budget_of=lambda c: cache_budget(c.ephemeral_storage),
        on_too_big=None if too_big is None else lambda *found: too_big.append(found))


def shards_of(store: Store, classes: Sequence[ClassShards]) -> dict[str, list[list[ModelRow]]]:
    """Each class's shards as the pods read them back, by class name."""
    return {c.cls.name: [list(read_model_list(
        f"{store.url}/{shard_key(RUN_ID, c.cls.name, i)}").rows) for i in range(c.shards)]
        for c in classes}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "out"))


@pytest.mark.parametrize("listed", [False, True], ids=["base-not-listed", "base-listed"])
def test_a_lora_on_a_large_base_is_classed_with_its_base(store: Store, listed: bool) -> None:
    """Three LoRAs on Llama-70B go to gpu-large, the class whose budget holds the base,
    not gpu-small; they stay in one shard (the base downloads once). A listed base is
    sized from its own row (its size_bytes: no lookup); an unlisted one is asked for once
    for the three in each of the plan's two passes (the Sizer memoises it: one hub lookup,
    test_sizing)."""
    small = [make_row(f"org/small-{i}", GB) for i in range(6)]
    base = [make_row(LLAMA_70B, 141 * GB)] if listed else []
    adapters = [lora(f"lora-{i}", LLAMA_70B) for i in range(3)]
    sizes = BaseSizes()
    classes = plan(store, base_first([*small, *base, *adapters]), sizes)
    by_class = shards_of(store, classes)
    assert set(by_class) == {"gpu-small", "gpu-large"}
    (large_shard,) = by_class["gpu-large"]
    assert [r.ref for r in large_shard] == [r.ref for r in base + adapters]
    assert sizes.asked == (Counter() if listed else Counter({LLAMA_70B: 2}))


def test_no_models_download_exceeds_its_pods_budget(store: Store) -> None:
    """A mixed list (models from 100 MB to 300 GB; adapters on bases of 2 GB to 810 GB,
    listed and not): every row of every shard, with its base for an adapter, fits the
    download budget of its class's disk (the request less the headroom); the rows that fit
    no class (the 405B base and the LoRAs on it: 810 GB, more than gpu-large's 392 GiB)
    are reported, with their class and its budget, instead of sharded; nothing is lost."""
    rng = random.Random(29)
    rows: list[ModelRow] = []
    for i in range(400):
        pick = rng.random()
        if pick < 0.3:
            base = rng.choice(sorted(BASES))
            rows.append(lora(f"lora-{i}", base, rng.randint(10**6, 2 * GB)))
        elif pick < 0.35:
            rows.append(make_row(f"org/base-{i}", rng.choice(list(BASES.values()))))
        else:
            rows.append(make_row(f"org/m-{i}", rng.randint(10**8, 300 * GB)))
    too_big: list[tuple[Item, ResourceClass, int]] = []
    classes = plan(store, rows, BaseSizes(), too_big=too_big)
    footprint = {r.ref: int(r.metadata["size_bytes"]) + (BASES[r.source_model] if r.is_adapter
                                                          and r.source_model else 0)
                 for r in rows}
    sharded = []
    for name, shards in shards_of(store, classes).items():
        (cls,) = [c.cls for c in classes if c.cls.name == name]
        budget = cache_budget(cls.ephemeral_storage)
        assert budget is not None
        for shard in shards:
            for row in shard:
                assert footprint[row.ref] <= budget, (row.ref, name)
                sharded.append(row.ref)
    reported = {item.ref for item, _, _ in too_big}
    large_budget = cache_budget(CLASSES[-1].ephemeral_storage) or 0
    assert reported == {ref for ref, n in footprint.items() if n > large_budget}
    assert {r.ref for r in rows if r.source_model == "org/base-405b"} <= reported
    assert all(item.footprint > budget for item, _, budget in too_big)
    assert {cls.name for _, cls, _ in too_big} == {"gpu-large"}
    assert sorted(sharded + list(reported)) == sorted(r.ref for r in rows)


def test_with_bases_takes_a_listed_base_and_asks_for_the_others_once() -> None:
    """A base listed right before its adapters gives them its size; adapters of an
    unlisted base in a row ask for it once; a model that is no adapter has no base."""
    rows = [make_row("org/base-7b", 14 * GB), lora("a", "org/base-7b"),
            lora("b", "org/base-7b"), lora("c", LLAMA_70B), lora("d", LLAMA_70B),
            make_row("org/plain", GB)]
    sizes = BaseSizes()
    items = list(with_bases((Item.of(r, int(r.metadata["size_bytes"])) for r in rows), sizes))
    assert [i.base_size for i in items] == [0, 14 * GB, 14 * GB, 141 * GB, 141 * GB, 0]
    assert [i.footprint for i in items][1] == 14 * GB + 200 * 10**6
    assert sizes.asked == Counter({LLAMA_70B: 1})
