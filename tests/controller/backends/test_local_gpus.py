"""The local backend gives each model the GPUs the rule says (controller.gpu.gpurule): a big model a
worker on several GPUs, small ones workers on one, never a model to a worker of another count,
and idle workers of the wrong count give their GPUs back so nothing waits forever.

Real subprocesses: the stand-in worker (tests/support/served_worker.py) speaks the real
protocol and records every worker's CUDA_VISIBLE_DEVICES and every model it starts; GPUs are
a GpuTracker over FakePynvml (tests/support/nvml.py). Shapes come from the list's columns,
or from the hub double over HTTP for the look-ahead test.
"""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from controller.backends.base import Outcome, Task, WorkerSpec
from controller.backends.local.backend import LocalBackend
from controller.backends.local.settings import LocalSettings
from controller.gpu.gpurule import GpuRule
from controller.weights.sizing import Sizer
from controller.weights.weightmeta import ShapeFinder
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import parse_ref
from tests.controller.backends.test_served import FAKE_WORKER, starts, workers
from tests.controller.test_weightmeta import llama_layers, write_st
from tests.support.hubserver import HubServer
from tests.support.local import FAST, by_key, make_tracker

HUGE = {"num_params": "405e9", "matrix_dim": "16384"}  # ~72 GPU-minutes on one GPU
SMALL = {"num_params": "125e6", "matrix_dim": "768"}
OFFLINE = ShapeFinder(Sizer(offline=True), GpuRule())


def model(ref: str, columns: dict[str, str] | None = None) -> Task:
    model_id, revision, problem = parse_ref(ref)
    assert problem is None, problem
    return Task.for_model(ModelRow(model_id, revision, "", None, metadata=dict(columns or {})))


def backend(state: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, rule: GpuRule, *,
            finder: ShapeFinder | None = None, **settings: Any) -> LocalBackend:
    monkeypatch.setenv("FAKE_WORKER_STATE", str(state))
    spec = WorkerSpec(run_id="run-1", store_url=str(state / "out"), prefetch=0)
    fields = {"max_retries": FAST.max_retries, "backoff_s": FAST.backoff_s,
              "backoff_max_s": FAST.backoff_max_s, "terminate_grace_s": 2.0} | settings
    return LocalBackend(LocalSettings(**fields), make_tracker([10.0] * gpus), rule=rule,
                        finder=finder or ShapeFinder(Sizer(offline=True), rule), spec=spec,
                        worker_cmd=FAKE_WORKER)


def run_within(b: LocalBackend, tasks: list[Task], seconds: float = 60) -> list[Outcome]:
    """run() on a thread: a dispatch that waits forever fails the test instead of hanging
    it (the workers are stopped)."""
    out: list[Outcome] = []
    thread = threading.Thread(target=lambda: out.extend(b.run(tasks)), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        b.request_stop()
        b.request_stop()
        thread.join(10)
        pytest.fail(f"the run did not end within {seconds} s: a dispatch deadlock")
    return out


def assert_counts_kept(state: Path, expected: dict[str, int]) -> None:
    """Every model started on a worker holding exactly its count of GPUs."""
    held = {w["pid"]: len(w["gpus"].split(",")) for w in workers(state)}
    for pid, key, _ in starts(state):
        assert held[pid] == expected[key], (key, held[pid])


GPU_CASES = {
    # rule, GPUs on the box, models (name, columns), each model's expected count
    "big-two-small-one": (GpuRule(multi_gpu_minutes=40), 3,
                          [("wait-big", HUGE), ("wait-a", SMALL), ("wait-b", None)],
                          [2, 1, 1]),
    "capped-at-the-box": (GpuRule(), 3, [("ok-big", HUGE), ("ok-a", SMALL)], [3, 1]),
    "max-gpus-per-job": (GpuRule(max_gpus_per_job=2), 4, [("ok-big", HUGE)], [2]),
    "no-parallel-gpu": (GpuRule(parallel=False), 3, [("ok-big", HUGE), ("ok-a", SMALL)],
                        [1, 1]),
    "explicit-n": (GpuRule(explicit=2), 4, [("ok-big", HUGE), ("ok-a", SMALL)], [2, 2]),
}


@pytest.mark.parametrize(("rule", "gpus", "models", "expected"), GPU_CASES.values(),
                         ids=GPU_CASES.keys())
def test_each_model_gets_the_rules_gpu_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: GpuRule, gpus: int,
    models: list[tuple[str, dict[str, str] | None]], expected: list[int],
) -> None:
    tasks = [model(name, columns) for name, columns in models]
    outcomes = by_key(run_within(backend(tmp_path, monkeypatch, gpus, rule), tasks))
    assert [outcomes[t.key].status for t in tasks] == ["done"] * len(tasks)
    assert [len(outcomes[t.key].gpus) for t in tasks] == expected
    assert_counts_kept(tmp_path, {t.key: n for t, n in zip(tasks, expected, strict=True)})


def test_idle_single_gpu_workers_give_way_to_a_big_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Three small models take a worker on each of the 3 GPUs; the big one needs 2: the
    single-GPU workers, once idle, leave so their GPUs come back; small models after it run
    on one GPU again. The decision is logged once."""
    small = [model(f"ok-{i}", SMALL) for i in range(3)]
    big = model("ok-big", HUGE)
    after = [model(f"ok-after-{i}") for i in range(2)]
    tasks = [*small, big, *after]
    b = backend(tmp_path, monkeypatch, 3, GpuRule(multi_gpu_minutes=40))
    with caplog.at_level(logging.INFO, logger="controller"):
        outcomes = by_key(run_within(b, tasks))
    assert all(o.status == "done" for o in outcomes.values())
    assert len(outcomes[big.key].gpus) == 2
    assert {len(outcomes[t.key].gpus) for t in small + after} == {1}
    assert_counts_kept(tmp_path, {t.key: 2 if t is big else 1 for t in tasks})
    messages = [r.getMessage() for r in caplog.records]
    assert "GPUs per model: auto: 1, or up to 3 for a model estimated above 40 GPU-min on one " \
        "GPU (--multi-gpu-minutes)" in messages
    decisions = [m for m in messages if m.startswith("model=") and "GPU-min" in m]
    assert decisions == ["model=ok-big: ~405.0B params, largest matrix 16384, est ~72 GPU-min "
                         "on one GPU → 2 GPUs"]
    assert any("leaves: its GPUs go to a model on 2 GPU(s)" in r.getMessage()
               for r in caplog.records)


def test_an_idle_multi_gpu_worker_gives_way_to_small_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On 2 GPUs the big model's worker holds both; when it is idle and small models wait,
    it leaves (without that, they would wait for it forever: the queue is not empty, so
    nothing else closes it)."""
    tasks = [model("ok-big", HUGE), *(model(f"ok-{i}") for i in range(3))]
    outcomes = by_key(run_within(backend(tmp_path, monkeypatch, 2, GpuRule()), tasks))
    assert [len(outcomes[t.key].gpus) for t in tasks] == [2, 1, 1, 1]
    assert len(workers(tmp_path)) >= 2


def test_hub_models_are_looked_up_ahead_and_offline_asks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hub models: the model info (and for the big one its first header) from the hub double,
    looked up by the look-ahead thread: the big model gets 2 GPUs. With the hub offline no
    request is made and every model gets one GPU."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1,localhost")
    with HubServer() as hub:
        write_st(tmp_path / "repos/big/model.safetensors",
                 llama_layers(16384, 53248, range(126), kv=1024))
        write_st(tmp_path / "repos/small/model.safetensors", llama_layers(64, 256, range(2)))
        hub.add_repo("org/big", tmp_path / "repos/big")
        hub.add_repo("org/small", tmp_path / "repos/small")
        tasks = [model("org/small"), model("org/big"), model("org/small@main")]
        rule = GpuRule(multi_gpu_minutes=40)
        online = ShapeFinder(Sizer(endpoint=hub.url, offline=False, rate_per_s=50), rule)
        outcomes = by_key(run_within(backend(tmp_path / "a", monkeypatch, 3, rule,
                                             finder=online), tasks))
        assert [len(outcomes[t.key].gpus) for t in tasks] == [1, 2, 1]
        assert {r.repo for r in hub.calls(kind="api")} == {"org/big", "org/small"}
        hub.clear_log()
        offline = ShapeFinder(Sizer(endpoint=hub.url, offline=True), rule)
        outcomes = by_key(run_within(backend(tmp_path / "b", monkeypatch, 3, rule,
                                             finder=offline), tasks))
        assert [len(outcomes[t.key].gpus) for t in tasks] == [1, 1, 1]
        assert hub.requests == []


def test_custom_commands_keep_gpus_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto gives commands 1 GPU (they have no shape); an explicit N still gives N."""
    from tests.support.local import exit_task

    for rule, expected in ((GpuRule(), 1), (GpuRule(explicit=2), 2)):
        b = LocalBackend(FAST, make_tracker([10.0] * 3), rule=rule, finder=OFFLINE)
        [outcome] = b.run([exit_task("cmd", 0)])
        assert len(outcome.gpus) == expected


def test_dry_run_says_which_models_get_several_gpus(tmp_path: Path) -> None:
    spec = WorkerSpec(run_id="r", store_url=str(tmp_path))
    b = LocalBackend(FAST, None, rule=GpuRule(), finder=OFFLINE, spec=spec,
                     worker_cmd=("esd-worker",), dry_run_cap=8)
    out = io.StringIO()
    assert b.dry_run([model("org/a", SMALL), model("org/big", HUGE)], out) == 2
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("# --gpus-per-job auto: each model runs on 1 GPU unless")
    assert lines[1].startswith("esd-worker --model org/a ")
    assert lines[2] == ("# gpus=4: model=org/big: ~405.0B params, largest matrix 16384, est "
                        "~72 GPU-min on one GPU → 4 GPUs")
    assert lines[3].startswith("esd-worker --model org/big ")
    fixed = LocalBackend(FAST, None, rule=GpuRule(explicit=1), spec=spec,
                         worker_cmd=("esd-worker",))
    out = io.StringIO()
    fixed.dry_run([model("org/big", HUGE)], out)
    assert not out.getvalue().startswith("#")  # an explicit count: the lines as before
