"""The long-lived worker's heartbeat: `progress` lines on the protocol stream while a model is
analysed (its bytes on disk once its files are there, then the layers done so far), so that
whoever watches the worker (esd_worker.core.watchdog) tells a hung model from a slow one.

The real `esd-worker --models` on a tiny local model in a subprocess, the throttle with a
clock the test moves, and discovery's beats counted by the real watch."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from esd_worker.analysis.analyze import analyse_model
from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.protocol import PROGRESS, parse_event, progress_line
from esd_worker.core.watchdog import ModelWatch
from esd_worker.serve.batch import Heartbeat
from tests.support import REPO_ROOT
from tests.support.builders import make_gpt2, make_llama, worker_command


def test_a_progress_line_reads_back_as_written() -> None:
    line = progress_line("org--m-0123456789", layers=12, size_bytes=3_000_000)
    assert parse_event(line) == {"event": PROGRESS, "key": "org--m-0123456789", "layers": 12,
                                 "bytes": 3_000_000}
    assert parse_event(progress_line("k", layers=0))["bytes"] is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beats(calls: list[tuple[float, int, int | None]], interval_s: float = 0.5
          ) -> list[tuple[int, int | None]]:
    """The (layers, bytes) lines sent for calls of (time offset, layers, size_bytes)."""
    sent: list[tuple[int, int | None]] = []
    clock = Clock()
    heartbeat = Heartbeat(lambda line: sent.append((json.loads(line)["layers"],
                                                    json.loads(line)["bytes"])),
                          interval_s=interval_s, clock=clock)
    heartbeat.begin("k")
    for offset, layers, size in calls:
        clock.now = 100.0 + offset
        heartbeat(layers, size)
    heartbeat.end()
    heartbeat(99, 1)  # after the model: nothing
    return sent


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        pytest.param([(0.0, 0, 500)], [(0, 500)], id="size-at-once"),
        pytest.param([(0.0, 0, 500), (0.01, 1, None), (0.02, 2, None)], [(0, 500), (1, 500)],
                     id="first-layer-at-once-then-throttled"),
        pytest.param([(0.0, 0, 500), (0.01, 1, None), (0.6, 7, None)],
                     [(0, 500), (1, 500), (7, 500)], id="after-the-interval"),
        pytest.param([(0.0, 0, 500)] + [(i / 10_000, i, None) for i in range(1, 6_001)],
                     [(0, 500), (1, 500), (5_001, 500)], id="6000-tiny-layers-in-0.6-s"),
        pytest.param([(0.0, 0, 100), (0.01, 0, 300)], [(0, 100), (0, 300)],
                     id="a-base-adds-bytes-at-once"),
        pytest.param([(0.0, 3, None), (0.7, 2, None)], [(3, None), (3, None)],
                     id="layers-never-go-back"),
    ],
)
def test_the_heartbeat_is_throttled(calls: list[tuple[float, int, int | None]],
                                    expected: list[tuple[int, int | None]]) -> None:
    """At most one line per interval, but what raises a watch's limit (a new size) or first
    shows analysis under way (the first layer) goes at once: thousands of tiny layers make
    a handful of lines, not thousands."""
    assert beats(calls) == expected


def test_a_models_run_beats_between_start_and_result(llama_dir: Path, tmp_path: Path) -> None:
    """The real worker: start, then progress lines whose layers grow and whose bytes are
    the model's on disk, then the result."""
    listed = tmp_path / "models.csv"
    listed.write_text(f"model_id\n{llama_dir}\n")
    run = subprocess.run([*worker_command(), "--models", str(listed), "--output",
                          str(tmp_path / "out"), "--device", "cpu"], capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert run.returncode == 0, run.stderr
    events: list[dict[str, Any]] = [parse_event(line) for line in run.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "ready" and kinds[1] == "start" and kinds[-1] == "result", kinds
    progress = [e for e in events if e["event"] == PROGRESS]
    assert progress and set(kinds[2:-1]) == {PROGRESS}, kinds
    assert {e["key"] for e in progress} == {events[1]["key"]}
    layers = [e["layers"] for e in progress]
    assert layers == sorted(layers) and layers[-1] > layers[0], layers
    on_disk = sum(p.stat().st_size for p in llama_dir.iterdir() if p.is_file())
    assert {e["bytes"] for e in progress} == {on_disk}


def _shards(folder: Path) -> int:
    return len(list(folder.glob("*.safetensors")))


@pytest.mark.parametrize(
    ("build", "at_least"),
    [
        pytest.param(lambda d: make_gpt2(d, n_layer=24), lambda d: 24,
                     id="meta-model-of-24-blocks"),
        pytest.param(lambda d: make_llama(d, max_shard_size="20KB"), _shards,
                     id="known-map-of-many-shards"),
    ],
)
def test_discovery_beats_the_watch(tmp_path: Path, build: Callable[[Path], Path],
                                   at_least: Callable[[Path], int]) -> None:
    """Between the model's files being there (the beat with its size) and its first layer,
    discovery beats the watch as it goes: once a weight file opened, and as the meta model
    is built and mapped, at least once a block. A model of 700 blocks otherwise sends
    nothing for minutes, and a watch under a short --model-timeout kills it as hung."""
    model = build(tmp_path / "model")
    watch = ModelWatch(floor_s=1.0)
    watch.start("k", time.monotonic())
    before_first_layer: list[int] = []  # the watch's beats at each progress with 0 layers

    def progress(layers: int, size_bytes: int | None = None) -> None:
        watch.beat("k", time.monotonic(), size_bytes)
        if layers == 0:
            before_first_layer.append(watch.beats)

    analyse_model(WorkerSettings(model=str(model), output=str(tmp_path / "out"),
                                 device="cpu"), progress=progress)
    assert watch.size_bytes is not None and before_first_layer[0] == 1  # the files' size
    assert len(before_first_layer) - 1 >= at_least(model), before_first_layer
