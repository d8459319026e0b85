"""Tests of controller.gpu.gpus: GPU free-ness from NVML readings, faked at the pynvml boundary.

The fake module has the pynvml functions the adapter calls (nvmlInit, nvmlShutdown,
nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo, nvmlDeviceGetUUID,
nvmlDeviceGetName, NVMLError) and plays back scripted used-memory readings, one per GPU per
poll. The CUDA_VISIBLE_DEVICES boundary is tested in test_allocation.py.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from controller.gpu.gpus import (
    GpuSettings,
    GpuState,
    GpuTracker,
    Nvml,
    NvmlUnavailable,
    open_nvml,
)
from tests.support.nvml import NAME, TOTAL_MIB, FakePynvml, fake_uuid


def make_tracker(
    readings: Sequence[Iterable[float]], **settings: Any
) -> tuple[GpuTracker, FakePynvml]:
    """A tracker over fake GPUs; settings default to threshold 500 MiB, 3 checks."""
    fake = FakePynvml(readings)
    settings.setdefault("max_checks", 3)
    return GpuTracker(Nvml(fake), GpuSettings(**settings)), fake


def poll(tracker: GpuTracker, times: int) -> None:
    for _ in range(times):
        tracker.poll()


# --- threshold and consecutive checks --------------------------------------------------------


@pytest.mark.parametrize(
    ("used_mib", "free"),
    [(0.0, True), (499.0, True), (499.99, True), (500.0, False), (501.0, False), (40000.0, False)],
    ids=["idle", "just-under", "fraction-under", "at-threshold", "just-over", "busy"],
)
def test_free_means_strictly_under_the_threshold(used_mib: float, free: bool) -> None:
    """'Stays under the threshold': a reading equal to it is not free (old gputracker: <)."""
    tracker, _ = make_tracker([[used_mib]], threshold_mib=500, max_checks=1)
    tracker.poll()
    assert (tracker.acquire(1) == (0,)) is free


def test_gpu_needs_max_checks_consecutive_free_polls() -> None:
    """With max_checks=3 the third free poll in a row makes the GPU available, not earlier."""
    tracker, _ = make_tracker([[10.0]], max_checks=3)
    poll(tracker, 2)
    assert tracker.acquire(1) is None
    tracker.poll()
    assert tracker.acquire(1) == (0,)


def test_another_users_process_appearing_mid_count_resets_it() -> None:
    """A reading over the threshold (someone else's job) sets the count back to zero."""
    tracker, _ = make_tracker([[10, 10, 9000, 10, 10, 10]], max_checks=3)
    poll(tracker, 5)  # free, free, busy, free, free: only 2 in a row
    assert tracker.snapshot()[0].free_checks == 2
    assert tracker.acquire(1) is None
    tracker.poll()
    assert tracker.acquire(1) == (0,)


def test_gpu_busy_with_other_users_is_never_handed_out() -> None:
    tracker, _ = make_tracker([[12000.0], [10.0]], max_checks=2)
    poll(tracker, 10)
    assert tracker.acquire(1) == (1,)
    assert tracker.acquire(1) is None


# --- taken and released -----------------------------------------------------------------------


def test_taken_gpu_stays_taken_whatever_its_memory_says() -> None:
    """Our worker's low memory (still loading) must not let a second job onto its GPU."""
    tracker, _ = make_tracker([[10.0]], max_checks=1)
    tracker.poll()
    assert tracker.acquire(1) == (0,)
    poll(tracker, 5)  # the worker has not allocated anything yet: reads stay low
    assert tracker.acquire(1) is None
    assert tracker.snapshot() == (GpuState(index=0, used_mib=10.0, free_checks=0, taken=True),)


def test_released_gpu_needs_one_fresh_free_poll() -> None:
    """After our own worker exits, one poll under the threshold is enough (not max_checks):
    we know its memory was ours."""
    tracker, fake = make_tracker([[10.0]], max_checks=5)
    poll(tracker, 5)
    assert tracker.acquire(1) == (0,)
    fake.script(0, 30000.0)  # our worker's memory: no effect while taken
    poll(tracker, 3)
    tracker.release((0,))
    assert tracker.acquire(1) is None  # no fresh reading yet
    fake.script(0, 10.0)
    tracker.poll()
    assert tracker.acquire(1) == (0,)


def test_released_gpu_tolerates_memory_still_being_freed() -> None:
    """Right after exit the driver may still show the worker's memory for a poll or two."""
    tracker, fake = make_tracker([[10.0]], max_checks=5)
    poll(tracker, 5)
    assert tracker.acquire(1) == (0,)
    tracker.release((0,))
    fake.script(0, 30000.0, 2000.0, 10.0)
    poll(tracker, 3)
    assert tracker.acquire(1) == (0,)


def test_released_gpu_that_stays_busy_needs_max_checks_again() -> None:
    """Busy for max_checks polls after our release: someone else took it."""
    tracker, fake = make_tracker([[10.0]], max_checks=3)
    poll(tracker, 3)
    assert tracker.acquire(1) == (0,)
    tracker.release((0,))
    fake.script(0, 9000.0, 9000.0, 9000.0, 10.0)
    poll(tracker, 4)
    assert tracker.acquire(1) is None
    poll(tracker, 2)
    assert tracker.acquire(1) == (0,)


def test_released_gpu_seen_free_then_busy_needs_max_checks_again() -> None:
    """Free after our release, then another user's process appears: the fast path is over."""
    tracker, fake = make_tracker([[10.0]], max_checks=3)
    poll(tracker, 3)
    assert tracker.acquire(1) == (0,)
    tracker.release((0,))
    fake.script(0, 10.0, 9000.0, 10.0)
    poll(tracker, 3)
    assert tracker.acquire(1) is None
    poll(tracker, 2)
    assert tracker.acquire(1) == (0,)


def test_release_of_a_gpu_not_held_is_an_error() -> None:
    tracker, _ = make_tracker([[10.0]])
    with pytest.raises(ValueError, match="not held"):
        tracker.release((0,))


# --- several GPUs per job, gpu_list, max_gpus ---------------------------------------------------


def test_gpus_per_job_needs_all_free_at_once() -> None:
    """A 2-GPU job waits while only one GPU is free, and takes nothing meanwhile."""
    tracker, fake = make_tracker([[10.0], [9000.0], [10.0], [9000.0]], max_checks=2)
    fake.script(2, 9000.0, 10.0)
    poll(tracker, 2)
    assert tracker.acquire(2) is None
    assert not any(g.taken for g in tracker.snapshot())
    tracker.poll()  # GPU 2 has now been free for 2 polls
    assert tracker.acquire(2) == (0, 2)
    assert tracker.acquire(1) is None


def test_gpu_list_restricts_and_orders_the_gpus() -> None:
    tracker, _ = make_tracker([[10.0]] * 4, max_checks=1, gpu_list=(3, 1))
    assert tracker.gpus == (3, 1)
    tracker.poll()
    assert tracker.acquire(1) == (3,)
    assert tracker.acquire(1) == (1,)
    assert tracker.acquire(1) is None  # 0 and 2 are not ours to use


def test_gpu_list_naming_a_missing_gpu_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"GPU\(s\) \[4, 7\] do not exist; NVML sees 2"):
        make_tracker([[10.0], [10.0]], gpu_list=(1, 4, 7))


def test_max_gpus_caps_gpus_in_use_at_once_not_which() -> None:
    """max_gpus=2 on 4 GPUs whose first is busy: GPUs 1 and 2 are used, never 3 at once."""
    tracker, _ = make_tracker([[9000.0], [10.0], [10.0], [10.0]], max_checks=1, max_gpus=2)
    assert tracker.gpus == (0, 1, 2, 3)
    assert tracker.capacity == 2
    tracker.poll()
    assert tracker.acquire(1) == (1,)
    assert tracker.acquire(1) == (2,)
    assert tracker.acquire(1) is None
    tracker.release((1,))
    tracker.poll()
    assert tracker.acquire(1) == (1,)


def test_acquiring_more_than_can_ever_be_free_is_an_error() -> None:
    tracker, _ = make_tracker([[10.0]] * 4, max_gpus=2, gpus_per_job=2)
    with pytest.raises(ValueError, match="can never be free at once"):
        tracker.acquire(3)


# --- settings -----------------------------------------------------------------------------------


def test_settings_validation_names_every_bad_field() -> None:
    settings = GpuSettings(
        threshold_mib=-1, max_checks=0, poll_interval_s=0, gpu_list=(1, 1, -2), max_gpus=0,
        gpus_per_job=0,
    )
    with pytest.raises(ValueError) as info:
        settings.validate()
    message = str(info.value)
    for name in ("threshold_mib", "max_checks", "poll_interval_s", "gpu_list", "max_gpus",
                 "gpus_per_job", "[-2]", "[1]"):
        assert name in message


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (GpuSettings(gpus_per_job=3, max_gpus=2), "more than max_gpus 2"),
        (GpuSettings(gpus_per_job=3, gpu_list=(0, 1)), "more than the 2 GPU(s) in gpu_list"),
        (GpuSettings(gpu_list=()), "at least one GPU"),
    ],
    ids=["per-job-over-max", "per-job-over-list", "empty-list"],
)
def test_settings_validation_cross_field(settings: GpuSettings, problem: str) -> None:
    with pytest.raises(ValueError, match="invalid GPU settings") as info:
        settings.validate()
    assert problem in str(info.value)


def test_default_settings_are_the_old_gputracker_defaults() -> None:
    settings = GpuSettings()
    settings.validate()
    assert (settings.threshold_mib, settings.max_checks, settings.gpus_per_job) == (500, 10, 1)


# --- the NVML adapter ---------------------------------------------------------------------------


def test_used_memory_comes_from_the_v2_struct_in_mib() -> None:
    """v2 leaves out driver-reserved memory; v1 would make an idle GPU look ~busy."""
    fake = FakePynvml([[1234.5]])
    nvml = Nvml(fake)
    assert nvml.used_mib(0) == pytest.approx(1234.5)
    assert fake.versions == [FakePynvml.nvmlMemory_v2]


def test_used_memory_falls_back_to_v1_on_old_drivers() -> None:
    fake = FakePynvml([[42.0]], v2=False)
    nvml = Nvml(fake)
    assert nvml.used_mib(0) == pytest.approx(42.0)
    assert nvml.used_mib(0) == pytest.approx(42.0)
    assert fake.versions == [None, None]  # v2 tried once, then not again


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_uuid_and_name_are_text_whatever_the_bindings_return(as_bytes: bool) -> None:
    """Current pynvml answers str, older versions bytes."""
    fake = FakePynvml([[0.0], [0.0]], as_bytes=as_bytes)
    fake.names[1] = "NVIDIA A100-SXM4-80GB"
    nvml = Nvml(fake)
    assert [nvml.uuid(i) for i in (0, 1)] == [fake_uuid(0), fake_uuid(1)]
    assert fake_uuid(0) != fake_uuid(1) and fake_uuid(0).startswith("GPU-")
    assert [nvml.name(i) for i in (0, 1)] == [NAME, "NVIDIA A100-SXM4-80GB"]


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_total_memory_in_mib(v2: bool) -> None:
    fake = FakePynvml([[100.0]], v2=v2)
    assert Nvml(fake).total_mib(0) == pytest.approx(TOTAL_MIB)


@pytest.mark.parametrize(
    ("call", "fails", "message"),
    [
        ("uuid", "info", "NVML could not read GPU 1's UUID: GPU is lost"),
        ("name", "info", "NVML could not read GPU 1's name: GPU is lost"),
        ("total_mib", "memory", "NVML could not read GPU 1: GPU is lost"),
        ("uuid", "missing", "NVML could not read GPU 5's UUID: Invalid Argument"),
    ],
    ids=["uuid", "name", "total", "no-such-gpu"],
)
def test_device_reads_wrap_nvml_errors(call: str, fails: str, message: str) -> None:
    fake = FakePynvml([[0.0], [0.0]])
    if fails == "info":
        fake.fail_info.add(1)
    else:
        fake.fail_reads.add(1)
    index = 5 if fails == "missing" else 1
    with pytest.raises(NvmlUnavailable) as info:
        getattr(Nvml(fake), call)(index)
    assert str(info.value) == message


def test_unreadable_gpu_counts_as_busy_until_it_reads_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker, fake = make_tracker([[10.0], [10.0]], max_checks=2)
    tracker.poll()
    fake.fail_reads.add(0)
    with caplog.at_level(logging.WARNING, logger="controller.gpu.gpus"):
        poll(tracker, 3)
    assert [r.getMessage() for r in caplog.records].count(
        "gpu=0 cannot be read, treated as busy: NVML could not read GPU 0: GPU is lost"
    ) == 1
    assert tracker.acquire(2) is None
    assert tracker.acquire(1) == (1,)
    fake.fail_reads.clear()
    tracker.poll()
    assert tracker.acquire(1) is None  # one good read is not max_checks
    tracker.poll()
    assert tracker.acquire(1) == (0,)


def test_close_shuts_nvml_down_once() -> None:
    fake = FakePynvml([[0.0]])
    nvml = Nvml(fake)
    nvml.close()
    nvml.close()
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


# --- no NVML ----------------------------------------------------------------------------------


def test_open_nvml_without_a_driver_is_none_with_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakePynvml([[0.0]], init_error="NVML Shared Library Not Found")
    with caplog.at_level(logging.INFO, logger="controller.gpu.gpus"):
        assert open_nvml(fake) is None
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU: NVML could not start (no NVIDIA driver?): NVML Shared Library Not Found"
    ]


def test_open_nvml_with_no_gpu_is_none() -> None:
    fake = FakePynvml([])
    assert open_nvml(fake) is None
    assert fake.shutdown_calls == 1


def test_missing_bindings_raise_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without nvidia-ml-py installed, the adapter says what to install."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(NvmlUnavailable, match="pip install nvidia-ml-py"):
        Nvml()
    assert open_nvml() is None


def test_open_nvml_with_gpus_gives_the_adapter() -> None:
    nvml = open_nvml(FakePynvml([[0.0], [0.0]]))
    assert nvml is not None
    assert nvml.device_count() == 2


def test_real_nvml_when_a_gpu_is_there() -> None:
    """On a GPU machine the real bindings read every GPU; elsewhere open_nvml says None."""
    nvml = open_nvml()
    if nvml is None:
        pytest.skip("no NVIDIA driver or GPU on this machine")
    try:
        count = nvml.device_count()
        assert count >= 1
        for index in range(count):
            assert 0 <= nvml.used_mib(index) <= nvml.total_mib(index) < 10**7
            assert nvml.uuid(index).startswith("GPU-") and nvml.name(index)
        tracker = GpuTracker(nvml, GpuSettings(max_checks=1, threshold_mib=10**7))
        tracker.poll()
        assert tracker.acquire(1) == (0,)
    finally:
        nvml.close()


def test_release_fast_path_expires_with_time() -> None:
    """One free poll suffices right after our own worker exits (we know why the GPU was
    busy). Once max_checks polls' worth of time has passed without a poll, whatever is on
    the GPU is not our worker any more: the full max_checks rule applies again."""
    tracker, _ = make_tracker([[10.0]], max_checks=3, poll_interval_s=0.01)
    poll(tracker, 3)
    assert tracker.acquire(1) == (0,)
    tracker.release([0])
    time.sleep(0.05)  # > 3 × 0.01 s
    poll(tracker, 1)
    assert tracker.acquire(1) is None
    poll(tracker, 2)
    assert tracker.acquire(1) == (0,)
