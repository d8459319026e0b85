"""Tests of controller.backends.kubernetes.sharded.plan and common.resources: resource classes,
units, shard counts, packing, shard CSVs."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from controller.backends.kubernetes.common.resources import (
    GIB,
    ResourceClass,
    cache_budget,
    disk_for,
    memory_for,
)
from controller.backends.kubernetes.sharded.plan import (
    SMALL_BYTES,
    Item,
    Packer,
    Shard,
    Unit,
    classify,
    default_classes,
    shard_count,
    shard_csv,
    target_bytes,
    units,
)
from esd_worker.core.models.modellist import ModelRow, base_first, read_model_list
from esd_worker.core.models.naming import parse_ref

MB = 10**6
GB = 10**9

# --- builders -------------------------------------------------------------------------------


def make_row(ref: str, relation: str = "", source: str | None = None) -> ModelRow:
    model_id, revision, problem = parse_ref(ref)
    assert problem is None, problem
    return ModelRow(model_id, revision, relation, source)


def make_item(ref: str, relation: str = "", source: str | None = None, size: int = 1) -> Item:
    return Item.of(make_row(ref, relation, source), size)


def make_unit(*sizes: int, prefix: str = "m") -> Unit:
    """A unit of one model per size (ids unique per prefix and position)."""
    items = tuple(make_item(f"org/{prefix}-{i}", size=s) for i, s in enumerate(sizes))
    return Unit(items, sum(sizes))


def gib_of(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity.removesuffix("Gi"))


def pack(packer: Packer, all_units: Sequence[Unit]) -> list[Shard]:
    shards = [s for s in (packer.add(u) for u in all_units) if s is not None]
    last = packer.finish()
    return shards + ([last] if last is not None else [])


# --- resource classes -----------------------------------------------------------------------


@pytest.mark.parametrize(("device", "gpus", "large", "names"), [
    ("cpu", 1, 20 * GIB, ["cpu-small", "cpu", "cpu-large"]),
    ("cuda", 0, 20 * GIB, ["cpu-small", "cpu", "cpu-large"]),
    ("cuda", 1, 20 * GIB, ["gpu-small", "gpu", "gpu-large"]),
    ("auto", 2, 20 * GIB, ["gpu-small", "gpu", "gpu-large"]),
    ("cuda", 1, 5 * 10**9, ["gpu", "gpu-large"]),
], ids=["cpu-device", "no-gpus", "one-gpu", "two-gpus", "large-below-small"])
def test_default_classes(device: str, gpus: int, large: int, names: list[str]) -> None:
    """Size bands smallest first, the last one unbounded; every class's download budget
    holds its largest model (the -small class two: the one being analysed and the one
    prefetched); a class that takes bigger models never asks for less memory or disk than
    the one below it."""
    classes = default_classes(device=device, gpus_per_job=gpus, large_bytes=large)
    assert [c.name for c in classes] == names
    assert classes[-1].max_bytes is None
    assert classes[-2].max_bytes == large
    for cls in classes:
        assert cls.gpus == (0 if names[0].startswith("cpu") else gpus)
        copies = 2 if cls.name.endswith("-small") else 1
        assert (cache_budget(cls.ephemeral_storage) or 0) >= copies * (cls.max_bytes or large)
    for low, high in itertools.pairwise(classes):
        assert gib_of(high.memory) >= gib_of(low.memory)
        assert gib_of(high.ephemeral_storage) >= gib_of(low.ephemeral_storage)


def test_default_classes_gpu_large_disk_grows_with_large_bytes() -> None:
    """A class that takes bigger models never gets less disk than the one below it."""
    *_, gpu, large = default_classes(device="cuda", gpus_per_job=1, large_bytes=300 * GIB)
    assert gib_of(large.ephemeral_storage) >= gib_of(gpu.ephemeral_storage) >= 300


# Allocatable ephemeral storage (GiB) of common GPU node root disks, what a pod's request is
# compared with: EKS / Karpenter's default 20 GiB root volume (less 10% eviction threshold
# and the kubelet's reservation), GKE's default 100 GB boot disk (GKE's own example: 47.06
# GB allocatable of 98.8 GiB), AKS's 128 GB OS disk (less 10%), and a 1 TB node-local NVMe
# array (EKS instanceStorePolicy RAID0, GKE local SSD ephemeral storage).
NODE_DISKS = {"eks-20GiB-root": 17, "gke-100GB-boot": 43, "aks-128GB-os": 107,
              "nvme-1TB": 838}


@pytest.mark.parametrize(("node", "fits"), [
    ("eks-20GiB-root", set()),
    ("gke-100GB-boot", {"gpu-small", "gpu"}),
    ("aks-128GB-os", {"gpu-small", "gpu"}),
    ("nvme-1TB", {"gpu-small", "gpu", "gpu-large"}),
], ids=list(NODE_DISKS))
def test_default_disk_requests_schedule_on_common_node_disks(node: str, fits: set[str]) -> None:
    """The default classes' ephemeral-storage requests against the node disks clouds give by
    default: gpu-small and gpu schedule on a ~100 GB boot disk; gpu-large needs node-local
    NVMe (or a bigger root volume); nothing fits a 20 GiB root volume, which the worker
    image alone half fills. Each class's budget still holds its largest model."""
    classes = default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * 10**9)
    assert {c.name for c in classes
            if gib_of(c.ephemeral_storage) <= NODE_DISKS[node]} == fits
    for cls in classes:
        budget = cache_budget(cls.ephemeral_storage)
        assert budget is not None and budget >= (cls.max_bytes or 30 * 10**9)


# Allocatable memory of common 16 GiB single-GPU instances (g4dn.xlarge, g5.xlarge,
# n1-standard-4 + T4): what is left of 16 GiB after the kubelet's and system reservations.
ALLOCATABLE_16GIB_NODE = 14


@pytest.mark.parametrize(("size", "memory", "disk"), [
    (0, "4Gi", "8Gi"),
    (500 * 10**6, "5Gi", "9Gi"),           # a 250M-parameter model in bf16
    (SMALL_BYTES, "7Gi", "23Gi"),          # the -small band's largest
    (14 * 10**9, "10Gi", "35Gi"),          # a 7B model in bf16
    (30 * 10**9, "16Gi", "64Gi"),          # the default --large-model-size
    (140 * 10**9, "57Gi", "269Gi"),        # a 70B model in bf16
    (810 * 10**9, "64Gi", "1517Gi"),       # a 405B model: memory capped
])
def test_requests_are_sized_from_the_weights(size: int, memory: str, disk: str) -> None:
    """Memory grows with the largest tensor (~20% of the weights, in float32) on top of the
    process; disk holds two models and headroom."""
    assert memory_for(size) == memory
    assert disk_for(size) == disk
    assert disk_for(size, copies=1) == f"{math.ceil(size / GIB) + 8}Gi"


def test_small_models_fit_a_16_gib_single_gpu_node() -> None:
    """Every model up to a 7B in bf16 asks for less memory than a 16 GiB instance has."""
    small, *_ = default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * 10**9)
    assert gib_of(small.memory) < ALLOCATABLE_16GIB_NODE
    assert gib_of(memory_for(14 * 10**9)) < ALLOCATABLE_16GIB_NODE


@pytest.mark.parametrize(("disk", "budget"), [
    ("23Gi", 15 * GIB),                 # what disk_for writes: the request less the headroom
    ("200G", 200 * 10**9 - 8 * GIB),    # an explicit --ephemeral-storage-request
    ("4Gi", GIB),                       # less than the headroom: still room for one download
    ("500m", None),                     # not a plain size: the worker's own default
    (None, None),
])
def test_cache_budget_from_the_disk_request(disk: str | None, budget: int | None) -> None:
    assert cache_budget(disk) == budget


@pytest.mark.parametrize(("size", "copies"), [(-1, 2), (1, 0)])
def test_sizing_refuses_nonsense(size: int, copies: int) -> None:
    with pytest.raises(ValueError):
        disk_for(size, copies=copies)
    if size < 0:
        with pytest.raises(ValueError):
            memory_for(size)


SMALL = ResourceClass("gpu", 1, 100, "16Gi", "64Gi")
BIG = ResourceClass("gpu-large", 1, None, "64Gi", "400Gi")


@pytest.mark.parametrize(("size", "classes", "expected"), [
    (0, (SMALL, BIG), SMALL),
    (100, (SMALL, BIG), SMALL),
    (101, (SMALL, BIG), BIG),
    (10**15, (SMALL, BIG), BIG),
    (101, (BIG, SMALL), BIG),
], ids=["zero", "at-max", "one-over", "huge", "first-wins"])
def test_classify_boundaries(size: int, classes: tuple[ResourceClass, ...],
                             expected: ResourceClass) -> None:
    """max_bytes is inclusive; the first class that takes the size wins."""
    assert classify(size, classes) == expected


def test_classify_without_a_class_that_fits() -> None:
    with pytest.raises(ValueError, match="101 bytes"):
        classify(101, (SMALL,))


# --- units ----------------------------------------------------------------------------------

# (ref, relation, source_model) in list order -> the refs of each unit
UNIT_CASES = {
    "base-and-its-adapters": (
        [("org/b", "", None), ("org/a1", "lora", "org/b"), ("org/a2", "adapter", "org/b")],
        [["org/b", "org/a1", "org/a2"]]),
    "adapter-names-base-by-id": (
        [("org/b@v1", "base", None), ("org/a1", "peft", "org/b"), ("org/a2", "lora", "org/b@v1")],
        [["org/b@v1", "org/a1", "org/a2"]]),
    "adapters-of-an-unlisted-base": (
        [("org/x1", "lora", "org/u"), ("org/x2", "lora", "org/u"), ("org/x3", "peft", "org/u")],
        [["org/x1", "org/x2", "org/x3"]]),
    "adapter-whose-base-is-elsewhere": (
        [("org/b", "", None), ("org/a", "lora", "org/c")],
        [["org/b"], ["org/a"]]),
    "non-adapter-breaks-a-group": (
        [("org/x1", "lora", "org/u"), ("org/n", "finetune", None), ("org/x2", "lora", "org/u")],
        [["org/x1"], ["org/n"], ["org/x2"]]),
    "adapters-without-source-stay-alone": (
        [("org/b", "", None), ("org/a1", "lora", None), ("org/a2", "lora", None)],
        [["org/b"], ["org/a1"], ["org/a2"]]),
    "finetune-of-the-base-is-its-own-unit": (
        [("org/b", "", None), ("org/f", "finetune", "org/b")],
        [["org/b"], ["org/f"]]),
    "other-base-after-the-base's-adapters": (
        [("org/b", "", None), ("org/a1", "lora", "org/b"), ("org/x1", "lora", "org/u"),
         ("org/x2", "lora", "org/u"), ("org/a2", "lora", "org/b")],
        [["org/b", "org/a1"], ["org/x1", "org/x2"], ["org/a2"]]),
    "local-base-with-an-at-sign": (
        [("/models/base@v2", "", None), ("org/a", "lora", "/models/base@v2")],
        [["/models/base@v2", "org/a"]]),
}


@pytest.mark.parametrize(("listed", "expected"), UNIT_CASES.values(), ids=UNIT_CASES.keys())
def test_units_grouping(listed: list[tuple[str, str, str | None]],
                        expected: list[list[str]]) -> None:
    """A unit is what the worker downloads a base for once: a base and the adapters right after
    it, or adapters of the same unlisted base one after another."""
    items = [make_item(ref, rel, src, size=10 + i) for i, (ref, rel, src) in enumerate(listed)]
    got = list(units(iter(items)))
    assert [[i.ref for i in u.items] for u in got] == expected
    assert [u.size for u in got] == [sum(i.size for i in u.items) for u in got]


def test_units_after_base_first() -> None:
    """base_first moves an adapter listed before its base right after it: one unit."""
    rows = [make_row("org/a", "lora", "org/b"), make_row("org/n"), make_row("org/b")]
    got = list(units(Item.of(r, 1) for r in base_first(rows)))
    assert [[i.ref for i in u.items] for u in got] == [["org/n"], ["org/b", "org/a"]]


def test_units_of_nothing() -> None:
    assert list(units([])) == []


# --- shard counts ---------------------------------------------------------------------------

# keyword arguments of shard_count -> the count
COUNT_CASES = {
    "no-models": (dict(total_bytes=0, total_models=0, parallelism=8, max_models=100), 0),
    "one-model": (dict(total_bytes=5, total_models=1, parallelism=8, max_models=100), 1),
    "parallelism-over-models": (
        dict(total_bytes=3 * GB, total_models=3, parallelism=8, max_models=100), 3),
    "per-slot-shards": (
        dict(total_bytes=10**13, total_models=10_000, parallelism=8, max_models=1000), 32),
    "per-slot-given": (
        dict(total_bytes=10**13, total_models=10_000, parallelism=8, max_models=1000,
             per_slot=2), 16),
    "max-models-bound": (
        dict(total_bytes=10**13, total_models=10_000, parallelism=2, max_models=100), 100),
    "max-models-rounds-up": (
        dict(total_bytes=10**13, total_models=10_001, parallelism=2, max_models=100), 101),
    "api-limit": (
        dict(total_bytes=10**15, total_models=2_000_000, parallelism=50_000, max_models=1000),
        100_000),
    "limit-given": (
        dict(total_bytes=10**12, total_models=1000, parallelism=64, max_models=1000, limit=10),
        10),
    "min-shard-bytes": (
        dict(total_bytes=10 * GB, total_models=1000, parallelism=8, max_models=1000,
             min_shard_bytes=4 * GB), 2),
    "min-shard-bytes-yields-to-max-models": (
        dict(total_bytes=10 * GB, total_models=1000, parallelism=8, max_models=100,
             min_shard_bytes=4 * GB), 10),
    "min-shard-bytes-over-total": (
        dict(total_bytes=GB, total_models=10, parallelism=8, max_models=100,
             min_shard_bytes=4 * GB), 1),
}


@pytest.mark.parametrize(("kwargs", "expected"), COUNT_CASES.values(), ids=COUNT_CASES.keys())
def test_shard_count(kwargs: dict[str, int], expected: int) -> None:
    """parallelism * per_slot shards (4 by default: the tail is a quarter of a slot's work),
    at least what max_models needs, at most one a model and the API's 100,000."""
    assert shard_count(**kwargs) == expected


@pytest.mark.parametrize("kwargs", [
    dict(total_bytes=1, total_models=2_000_001, parallelism=8, max_models=20),
    dict(total_bytes=1, total_models=11, parallelism=8, max_models=1, limit=10),
    dict(total_bytes=1, total_models=1, parallelism=0, max_models=1),
    dict(total_bytes=1, total_models=1, parallelism=1, max_models=0),
    dict(total_bytes=-1, total_models=1, parallelism=1, max_models=1),
], ids=["max-models-past-api-limit", "max-models-past-limit", "no-parallelism",
        "no-max-models", "negative-bytes"])
def test_shard_count_refuses(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        shard_count(**kwargs)


@pytest.mark.parametrize(("total", "shards", "expected"), [
    (9, 3, 3), (10, 3, 4), (1, 5, 1), (0, 5, 1), (10**15, 1, 10**15),
], ids=["even", "rounds-up", "fewer-bytes-than-shards", "no-bytes", "one-shard"])
def test_target_bytes(total: int, shards: int, expected: int) -> None:
    """shards targets of target_bytes always hold total_bytes; a target is never 0."""
    assert target_bytes(total, shards) == expected
    assert expected * shards >= total


def test_target_bytes_needs_a_shard() -> None:
    with pytest.raises(ValueError):
        target_bytes(10, 0)


# --- packing --------------------------------------------------------------------------------

# units (sizes of their models), target, max_models -> each shard's sizes
PACK_CASES = {
    "fills-up-to-target": ([(4,), (4,), (4,)], 10, 10, [[4, 4], [4]]),
    "exactly-target-fits": ([(5,), (5,), (5,)], 10, 10, [[5, 5], [5]]),
    "big-unit-alone": ([(1,), (12,), (1,)], 10, 10, [[1], [12], [1]]),
    "big-unit-first": ([(12,), (1,), (1,)], 10, 10, [[12], [1, 1]]),
    "max-models": ([(1,), (1,), (1,), (1,), (1,)], 100, 2, [[1, 1], [1, 1], [1]]),
    "unit-never-split": ([(1,), (2, 2, 2), (1,)], 100, 3, [[1], [2, 2, 2], [1]]),
    "unit-over-max-models-alone": ([(1, 1, 1, 1)], 100, 3, [[1, 1, 1, 1]]),
    "nothing": ([], 10, 10, []),
}


@pytest.mark.parametrize(("unit_sizes", "target", "max_models", "expected"),
                         PACK_CASES.values(), ids=PACK_CASES.keys())
def test_packer_cases(unit_sizes: list[tuple[int, ...]], target: int, max_models: int,
                      expected: list[list[int]]) -> None:
    all_units = [make_unit(*sizes, prefix=f"u{i}") for i, sizes in enumerate(unit_sizes)]
    packer = Packer(target_bytes=target, max_models=max_models)
    shards = pack(packer, all_units)
    assert [[i.size for i in s.items] for s in shards] == expected
    assert [s.index for s in shards] == list(range(len(expected)))
    assert [s.size for s in shards] == [sum(sizes) for sizes in expected]
    assert packer.shards == len(expected)
    assert packer.finish() is None  # finishing twice gives nothing more


def realistic_items(rng: random.Random, n_bases: int) -> list[Item]:
    """Hub-like sizes: lognormal base models from 10 MB to 140 GB (median ~1.5 GB), and about
    20% adapters of 10-200 MB right after their base (some of an unlisted base)."""
    items: list[Item] = []
    for b in range(n_bases):
        size = int(min(max(rng.lognormvariate(math.log(1.5 * GB), 1.6), 10 * MB), 140 * GB))
        base = f"org{b % 7}/base-{b}"
        if rng.random() < 0.9:
            items.append(make_item(base, "", None, size))
        while rng.random() < 0.2:
            ref = f"org{b % 7}/adapter-{len(items)}"
            items.append(make_item(ref, "lora", base, rng.randint(10 * MB, 200 * MB)))
    return items


@pytest.mark.parametrize(("seed", "n_bases", "parallelism", "max_models"), [
    (1, 2000, 8, 1000), (2, 2000, 64, 1000), (3, 2000, 8, 10), (4, 300, 100, 50),
    (5, 50, 2, 1000),
], ids=["bytes-bound", "many-slots", "models-bound", "more-slots-than-units", "tiny"])
def test_packer_balance(seed: int, n_bases: int, parallelism: int, max_models: int) -> None:
    """Over a seeded realistic size mix: every unit is in exactly one shard, whole and in list
    order; no shard has more than max_models models unless it is one unit; no shard passes
    target unless it is one unit, and a shard closed for bytes is within the largest unit of
    the target (the next unit did not fit); so shard sizes are within target +- largest unit,
    and there are at most about twice the planned shards (two shards in a row hold more than
    a target)."""
    rng = random.Random(seed)
    all_units = list(units(realistic_items(rng, n_bases)))
    total = sum(u.size for u in all_units)
    models = sum(len(u.items) for u in all_units)
    planned = shard_count(total_bytes=total, total_models=models, parallelism=parallelism,
                          max_models=max_models)
    target = target_bytes(total, planned)
    largest = max(u.size for u in all_units)
    shards = pack(Packer(target_bytes=target, max_models=max_models), all_units)

    # every unit whole in one shard, in order
    assert [i for s in shards for i in s.items] == [i for u in all_units for i in u.items]
    shard_of = {item.key: s.index for s in shards for item in s.items}
    assert all(len({shard_of[i.key] for i in u.items}) == 1 for u in all_units)
    assert [s.index for s in shards] == list(range(len(shards)))
    assert all(s.size == sum(i.size for i in s.items) for s in shards)

    # how many units each shard holds, and the unit that opened the next shard
    units_in = [0] * len(shards)
    next_unit: dict[int, Unit] = {}
    for u in all_units:
        index = shard_of[u.items[0].key]
        if units_in[index] == 0 and index > 0:
            next_unit[index - 1] = u
        units_in[index] += 1
    for s in shards:
        single = units_in[s.index] == 1
        assert len(s.items) <= max_models or single
        assert s.size <= target or single
        assert s.size <= target + largest
        following = next_unit.get(s.index)
        if following is not None and len(s.items) + len(following.items) <= max_models:
            assert s.size + following.size > target  # closed for bytes: it was nearly full
            assert s.size > target - largest
    if max_models >= models:
        assert len(shards) <= 2 * planned + 1


# --- shard CSV ------------------------------------------------------------------------------


def test_shard_csv_round_trip(tmp_path: Path) -> None:
    """read_model_list reads a shard back into the rows it was made of: odd revisions (commas,
    quotes, slashes), local paths with commas, quotes, '@' and a '#', adapters with
    hub and local bases; the size rides along as the size_bytes column. (A path with a line
    break is no row: control characters are refused in every model id.)"""
    odd_dir = tmp_path / 'dir, with "quotes"'
    at_dir = tmp_path / "model@v2"
    hash_dir = tmp_path / "#not a comment"
    for d in (odd_dir, at_dir, hash_dir):
        d.mkdir()
    rows = [
        make_row("org/model"),
        make_row("org/model@v1.0", "base"),
        make_row("org/other@refs/pr/1", "finetune", "org/model"),
        make_row('org/odd@a,b"c', "quantized"),
        make_row(str(odd_dir)),
        make_row(str(at_dir), "merge"),
        make_row(str(hash_dir), "lora", str(odd_dir)),
        make_row("org/adapter", "peft", "org/model@v1.0"),
        make_row("org/adapter2", "adapter", str(at_dir)),
    ]
    items = [Item.of(row, size) for size, row in enumerate(rows, start=100)]
    path = tmp_path / "shard.csv"
    path.write_bytes(shard_csv(items))

    read = read_model_list(path)
    assert read.problems == () and read.duplicates == 0
    got = [(r.ref, r.key, r.relation, r.source_model) for r in read.rows]
    assert got == [(i.ref, i.key, i.relation, i.source_model) for i in items]
    assert [r.metadata["size_bytes"] for r in read.rows] == [str(i.size) for i in items]
    assert (read.rows[5].model_id, read.rows[5].revision) == (str(at_dir), None)


def test_shard_csv_of_no_items_is_a_header() -> None:
    assert shard_csv([]) == b"model_id,base_model_relation,source_model,size_bytes\n"
