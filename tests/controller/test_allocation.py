"""Tests of an inherited CUDA_VISIBLE_DEVICES as the sweep's GPU boundary: the parsing
(controller.gpu.allocation) and the tracker that keeps to it (controller.gpu.gpus), with NVML's
answers
faked at the pynvml function boundary (tests/support/nvml.py), and one run through the local
backend.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from controller.backends.local.backend import LocalBackend
from controller.errors import EXIT_INFRA, EXIT_USAGE, InfrastructureError, SweepError
from controller.gpu.allocation import VARIABLE, Allocation, needs_uuids, parse_visible_devices
from controller.gpu.gpus import (
    GpuSettings,
    GpuTracker,
    Nvml,
    NvmlUnavailable,
    inherited_allocation,
    open_tracker,
)
from tests.support.local import FAST, make_task
from tests.support.nvml import FakePynvml

# Four GPUs: 0 and 1 share the prefix GPU-ab, 2 is the CUDA documentation's example UUID.
UUIDS = (
    "GPU-ab11f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-ab22c0de-1111-2222-3333-444455556666",
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-c0ffee00-aaaa-bbbb-cccc-ddddeeeeffff",
)
BOX = tuple(enumerate(UUIDS))


def fake_box(as_bytes: bool = False) -> FakePynvml:
    """Four idle GPUs with UUIDS."""
    return FakePynvml([[10.0]] * 4, uuids=UUIDS, as_bytes=as_bytes)


# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "indices", "stopped_at", "ignored", "repeated", "warns"),
    [
        ("2,0", (2, 0), None, (), (), False),
        ("0,1,2,3", (0, 1, 2, 3), None, (), (), False),
        (" 1 , 3 ", (1, 3), None, (), (), False),
        ("007", (), "007", ("007",), (), True),  # not NVML index 7: there is none
        ("03", (3,), None, (), (), False),
        (UUIDS[2], (2,), None, (), (), False),
        (f"{UUIDS[3]},{UUIDS[1]}", (3, 1), None, (), (), False),
        ("GPU-8932f937", (2,), None, (), (), False),
        ("GPU-ab2", (1,), None, (), (), False),
        ("GPU-8932f937,0,GPU-c0ffee", (2, 0, 3), None, (), (), False),
        ("GPU-ab,2", (), "GPU-ab", ("GPU-ab", "2"), (), True),  # prefix of GPUs 0 and 1
        ("1,GPU-deadbeef,2", (1,), "GPU-deadbeef", ("GPU-deadbeef", "2"), (), True),
        ("8932f937-d72c-4106-c12f-20bd9faed9f6", (), "8932f937-d72c-4106-c12f-20bd9faed9f6",
         ("8932f937-d72c-4106-c12f-20bd9faed9f6",), (), True),  # no GPU- part
        ("gpu-8932f937", (), "gpu-8932f937", ("gpu-8932f937",), (), True),
        ("0,7,1", (0,), "7", ("7", "1"), (), True),
        ("0,2,-1,1", (0, 2), "-1", ("-1", "1"), (), True),
        ("3,1gpu,2", (3,), "1gpu", ("1gpu", "2"), (), True),
        ("+1", (), "+1", ("+1",), (), True),
        ("0,,1", (0,), "", ("", "1"), (), True),
        ("0,1,", (0, 1), "", ("",), (), False),  # a trailing comma ends the list quietly
        ("2,-1", (2,), "-1", ("-1",), (), False),
        ("", (), "", ("",), (), False),
        ("-1", (), "-1", ("-1",), (), False),
        ("NoDevFiles", (), "NoDevFiles", ("NoDevFiles",), (), False),
        ("0,0,1", (0, 1), None, (), ("0",), True),
        (f"{UUIDS[0]},0,GPU-ab1", (0,), None, (), ("0", "GPU-ab1"), True),
    ],
    ids=[
        "indices-in-order", "all", "spaces", "leading-zeros-past-the-box", "leading-zero",
        "full-uuid", "full-uuids-in-order", "uuid-prefix", "uuid-prefix-short", "mixed",
        "ambiguous-prefix", "unknown-uuid", "uuid-without-gpu-part", "lower-case-gpu",
        "index-past-the-box", "minus-one-mid-list", "digits-then-letters", "plus-sign",
        "empty-entry", "trailing-comma", "minus-one-last", "empty", "minus-one",
        "slurm-no-dev-files", "repeated-index", "repeated-via-uuid-and-prefix",
    ],
)
def test_parse_follows_cuda(
    value: str,
    indices: tuple[int, ...],
    stopped_at: str | None,
    ignored: tuple[str, ...],
    repeated: tuple[str, ...],
    warns: bool,
) -> None:
    allocation = parse_visible_devices(value, BOX)
    assert allocation.indices == indices
    assert (allocation.stopped_at, allocation.ignored) == (stopped_at, ignored)
    assert allocation.repeated == repeated
    assert bool(allocation.warnings()) is warns


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0,7,1", ["CUDA_VISIBLE_DEVICES=0,7,1", "'7' is not a GPU (NVML sees 4",
                   "'7,1' is ignored", "NVML GPU(s) 0"]),
        ("GPU-ab,2", ["'GPU-ab' matches more than one GPU's UUID (NVML GPUs 0,1)",
                      "uses no GPU"]),
        ("1,GPU-deadbeef", ["'GPU-deadbeef' matches no GPU's UUID", "NVML GPU(s) 1"]),
        ("0,x", ["'x' is neither a GPU index nor a GPU- UUID"]),
        ("0,2,-1,1", ["'-1' ends the list", "'-1,1' is ignored"]),
        ("1,1", ["'1' name(s) a GPU already listed", "NVML GPU(s) 1"]),
    ],
    ids=["missing-index", "ambiguous", "unknown-uuid", "junk", "minus-one", "repeated"],
)
def test_warning_names_the_entry_and_what_was_ignored(value: str, words: list[str]) -> None:
    [line] = parse_visible_devices(value, BOX).warnings()
    for word in words:
        assert word in line


@pytest.mark.parametrize(
    "value",
    [f"MIG-{UUIDS[2]}/1/2", f"0,MIG-{UUIDS[2]}/1/2", "MIG-a1b2c3d4-0000-1111-2222-333344445555"],
    ids=["mig-gpu-uuid-form", "after-a-gpu", "mig-uuid-form"],
)
def test_mig_entries_are_refused_with_one_error(value: str) -> None:
    with pytest.raises(SweepError, match="not MIG instances") as info:
        parse_visible_devices(value, BOX)
    assert f"CUDA_VISIBLE_DEVICES={value} names MIG instance" in str(info.value)
    assert info.value.exit_code == EXIT_USAGE
    assert "\n" not in str(info.value)


def test_mig_entry_after_the_list_ended_is_ignored_like_cuda_does() -> None:
    allocation = parse_visible_devices(f"0,7,MIG-{UUIDS[2]}/1/2", BOX)
    assert allocation.indices == (0,)


def test_uuid_entries_need_the_uuids_index_entries_do_not() -> None:
    assert needs_uuids("1, GPU-ab1") and not needs_uuids("0,1,-1")
    # Index-only values read with unknown ("") UUIDs give the same answer.
    unknown = tuple((i, "") for i in range(4))
    assert parse_visible_devices("3,1", unknown) == parse_visible_devices("3,1", BOX)


def test_describe_shortens_uuids_for_log_lines() -> None:
    allocation = parse_visible_devices(f"{UUIDS[2]},GPU-c0ffee,1", BOX)
    assert allocation.describe() == f"CUDA_VISIBLE_DEVICES={UUIDS[2]},GPU-c0ffee,1"
    assert allocation.describe(short=True) == "CUDA_VISIBLE_DEVICES=GPU-8932f937..,GPU-c0ffee,1"


# --- reading it through NVML --------------------------------------------------------------------


def test_unset_variable_means_no_boundary() -> None:
    fake = fake_box()
    assert inherited_allocation(Nvml(fake), {"PATH": "/bin"}) is None
    assert fake.info_reads == []


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str-uuids", "bytes-uuids"])
def test_uuids_are_read_from_nvml(as_bytes: bool) -> None:
    """Older bindings answer bytes: decoded before matching."""
    fake = fake_box(as_bytes=as_bytes)
    allocation = inherited_allocation(Nvml(fake), {VARIABLE: "GPU-c0ffee,GPU-8932"})
    assert allocation is not None and allocation.indices == (3, 2)
    assert sorted(fake.info_reads) == [0, 1, 2, 3]


def test_index_only_value_reads_no_uuid() -> None:
    """A lost GPU outside the allocation must not stop a sweep that names GPUs by index."""
    fake = fake_box()
    fake.fail_info.add(0)
    allocation = inherited_allocation(Nvml(fake), {VARIABLE: "2,3"})
    assert allocation is not None and allocation.indices == (2, 3)
    assert fake.info_reads == []


def test_unreadable_uuid_is_nvml_unavailable() -> None:
    fake = fake_box()
    fake.fail_info.add(1)
    with pytest.raises(NvmlUnavailable, match="could not read GPU 1's UUID: GPU is lost"):
        inherited_allocation(Nvml(fake), {VARIABLE: "GPU-8932"})


# --- the tracker keeps to the allocation --------------------------------------------------------


def tracker_in(value: str, fake: FakePynvml, **settings: Any) -> GpuTracker | None:
    """open_tracker with --device auto, max_checks 1, over `fake`, CUDA_VISIBLE_DEVICES=value."""
    settings.setdefault("max_checks", 1)
    return open_tracker("auto", GpuSettings(**settings), 1, environ={VARIABLE: value},
                        module=fake)


@pytest.mark.parametrize(
    ("value", "managed"),
    [("3,1", (3, 1)), (f"{UUIDS[2]},GPU-ab1", (2, 0)), ("1,9,0", (1,))],
    ids=["indices", "uuids", "stopped-at-invalid"],
)
def test_tracker_polls_and_hands_out_only_allocated_gpus(
    value: str, managed: tuple[int, ...]
) -> None:
    """All four GPUs idle: only the allocated ones are read or handed out, in its order."""
    fake = fake_box()
    tracker = tracker_in(value, fake)
    assert tracker is not None and tracker.gpus == managed
    assert tracker.allocation is not None and tracker.allocation.value == value
    for _ in range(3):
        tracker.poll()
    assert set(fake.memory_reads) == set(managed)
    handed = [tracker.acquire(1) for _ in range(len(managed))]
    assert handed == [(i,) for i in managed]
    assert tracker.acquire(1) is None  # the others are not this job's


def test_without_the_variable_every_gpu_is_managed() -> None:
    fake = fake_box()
    tracker = open_tracker("auto", GpuSettings(max_checks=1), 1, environ={}, module=fake)
    assert tracker is not None and tracker.gpus == (0, 1, 2, 3)
    assert tracker.allocation is None


def test_gpu_list_selects_within_the_allocation() -> None:
    """--gpu-list keeps NVML indices (nvidia-smi's) and its own order of preference."""
    fake = fake_box()
    tracker = tracker_in(f"0,{UUIDS[2]},3", fake, gpu_list=(3, 0))
    assert tracker is not None and tracker.gpus == (3, 0)
    tracker.poll()
    assert set(fake.memory_reads) == {3, 0}


@pytest.mark.parametrize(
    ("value", "gpu_list", "outside", "allowed"),
    [("0,2,3", (1, 2), "[1]", "0,2,3"), ("GPU-c0ffee,GPU-8932", (3, 0, 9), "[0, 9]", "3,2")],
    ids=["index", "uuids"],
)
def test_gpu_list_outside_the_allocation_is_a_usage_error(
    value: str, gpu_list: tuple[int, ...], outside: str, allowed: str
) -> None:
    fake = fake_box()
    with pytest.raises(SweepError) as info:
        tracker_in(value, fake, gpu_list=gpu_list)
    assert info.value.exit_code == EXIT_USAGE
    assert str(info.value) == (
        f"gpu_list: GPU(s) {outside} are outside this job's GPUs: "
        f"CUDA_VISIBLE_DEVICES={value} allows NVML indices {allowed}"
    )
    assert fake.memory_reads == [] and fake.shutdown_calls == 1


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles", "7", "GPU-0000"],
                         ids=["empty", "minus-one", "no-dev-files", "missing-index", "unknown"])
def test_no_allocated_gpu_with_device_auto_runs_on_the_cpu(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = fake_box()
    with caplog.at_level(logging.INFO, logger="controller.gpu.gpus"):
        assert tracker_in(value, fake) is None
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"CUDA_VISIBLE_DEVICES={value} leaves no GPU visible: running on the "
                     "CPU with 1 worker(s) at a time (--cpu-workers)"]
    assert fake.memory_reads == [] and fake.shutdown_calls == 1


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_no_allocated_gpu_with_device_cuda_is_an_infrastructure_error(value: str) -> None:
    fake = fake_box()
    with pytest.raises(InfrastructureError) as info:
        open_tracker("cuda", GpuSettings(), 1, environ={VARIABLE: value}, module=fake)
    assert info.value.exit_code == EXIT_INFRA
    assert f"CUDA_VISIBLE_DEVICES={value} leaves no GPU visible" in str(info.value)
    assert fake.shutdown_calls == 1


def test_open_tracker_logs_ignored_entries(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="controller.gpu.gpus"):
        tracker = tracker_in(f"{UUIDS[3]},7,1", fake_box())
    assert tracker is not None and tracker.gpus == (3,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'7,1' is ignored" in warnings[0]
    assert caplog.records[-1].getMessage().startswith(
        "GPUs 3 managed (CUDA_VISIBLE_DEVICES=GPU-c0ffee00..,7,1): free after 1 checks"
    )


@pytest.mark.parametrize(
    ("value", "fail_uuid", "error", "exit_code", "words"),
    [
        (f"MIG-{UUIDS[0]}/1/0", None, SweepError, EXIT_USAGE, "not MIG instances"),
        ("GPU-8932", 3, InfrastructureError, EXIT_INFRA,
         "cannot match CUDA_VISIBLE_DEVICES to the GPUs NVML sees: NVML could not read "
         "GPU 3's UUID"),
    ],
    ids=["mig", "uuid-unreadable"],
)
def test_open_tracker_errors_close_nvml(
    value: str, fail_uuid: int | None, error: type[SweepError], exit_code: int, words: str
) -> None:
    fake = fake_box()
    if fail_uuid is not None:
        fake.fail_info.add(fail_uuid)
    with pytest.raises(error, match=words) as info:
        tracker_in(value, fake)
    assert info.value.exit_code == exit_code
    assert fake.shutdown_calls == 1 and fake.memory_reads == []


def test_tracker_given_an_empty_allocation_refuses_it() -> None:
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=-1 leaves no GPU to use"):
        GpuTracker(Nvml(fake_box()), GpuSettings(), Allocation("-1", ()))


# --- through the local backend ------------------------------------------------------------------


def test_local_backend_starts_workers_only_on_allocated_gpus() -> None:
    """Four idle GPUs, CUDA_VISIBLE_DEVICES=GPU-<2>,3 inherited: every worker gets 2 or 3 (as
    NVML indices, with CUDA_DEVICE_ORDER=PCI_BUS_ID), never 0 or 1."""
    fake = fake_box()
    environ = {VARIABLE: f"{UUIDS[2]},3"}
    backend = LocalBackend(
        FAST, None,
        open_tracker=lambda: open_tracker("auto", GpuSettings(max_checks=1, poll_interval_s=0.005),
                                          1, environ=environ, module=fake),
    )
    script = """
        import os, time
        time.sleep(0.1)
        print(os.environ["CUDA_DEVICE_ORDER"], os.environ["CUDA_VISIBLE_DEVICES"])
    """
    try:
        outcomes = backend.run([make_task(f"t{i}", script) for i in range(6)])
    finally:
        backend.close()
    assert all(o.status == "done" for o in outcomes)
    assert {o.gpus for o in outcomes} == {(2,), (3,)}
    for o in outcomes:
        assert o.stderr_tail == (f"PCI_BUS_ID {o.gpus[0]}",)
    assert set(fake.memory_reads) == {2, 3}
