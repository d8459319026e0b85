"""esd_worker.serve.tablewriter: a batch worker writes the models it finished as results-tables
parts (by count, by layer rows, by age, at close), and a store that refuses a part costs a
warning, never a model; end to end, a real `esd-worker --models` run and a `--serve` worker
stopped by SIGTERM leave parts that say what the per-model files say (the `--models` run is
tests/esd_worker/test_worker_batch.py's first: one worker process less), as does a local
`esd-sweep run`, whose served workers write them when drained."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from controller.results.tables import Tables, read_done_models
from esd_worker.core.errors import StoreError
from esd_worker.core.models.naming import model_key
from esd_worker.core.protocol import Request
from esd_worker.core.store.layout import list_markers, model_file_key
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.results import LAYER_COLUMNS, layers_from_csv
from esd_worker.core.store.stores import LocalStore
from esd_worker.core.store.tables import LAYERS_TABLE, MODELS_TABLE, DoneModel
from esd_worker.serve.tablewriter import TableWriter
from tests.support import REPO_ROOT
from tests.support.builders import worker_command


def done(key: str, arch: str = "LlamaForCausalLM", layers: int = 2,
         finished: str = "2026-01-01T00:00:00+00:00", alpha: float = 3.0) -> DoneModel:
    marker = Marker(model=f"org/{key}", model_key=key, model_id=f"org/{key}",
                    architecture=arch, finished_at=finished, timings={"total_s": 1.5})
    rows = [{"layer": f"h.{i}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": alpha,
             "status": "ok"} for i in range(layers)]
    return DoneModel(marker, rows)


def table_rows(store: LocalStore, table: str) -> list[dict[str, Any]]:
    """Every row of the parts the writer wrote, as written (the models here have no files
    of their own, so a reader of the store would count none of them: what counts is
    tests/controller/results/test_tables_truth.py's)."""
    tables = Tables(store)
    return [row for _, part in tables.read_parts(tables.parts(table)) if part is not None
            for row in part.to_pylist()]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RefusingStore(LocalStore):
    """A store whose table parts cannot be written (an outage, a full disk)."""

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.startswith("_tables/"):
            raise StoreError(f"write {key}: connection reset")
        super().put_bytes(key, data)


@pytest.mark.parametrize(("limits", "adds", "parts_after"), [
    # max_models: the third model fills the buffer
    ({"max_models": 3}, [("a", 2), ("b", 2)], 0),
    ({"max_models": 3}, [("a", 2), ("b", 2), ("c", 2)], 1),
    # max_layer_rows: 4 + 5 rows reach 9
    ({"max_layer_rows": 9}, [("a", 4)], 0),
    ({"max_layer_rows": 9}, [("a", 4), ("b", 5)], 1),
    # under both limits: nothing until close
    ({}, [("a", 300), ("b", 300)], 0),
])
def test_the_buffer_is_written_once_full(tmp_path: Path, limits: dict[str, Any],
                                         adds: list[tuple[str, int]], parts_after: int) -> None:
    store = LocalStore(tmp_path)
    writer = TableWriter(store, **limits)
    for key, layers in adds:
        writer.add(done(key, layers=layers))
    assert len(Tables(store).parts(MODELS_TABLE)) == parts_after
    expected_pending = 0 if parts_after else len(adds)
    assert writer.pending_models == expected_pending
    writer.close()
    assert sorted(r["model_key"] for r in table_rows(store, MODELS_TABLE)) == [k for k, _ in adds]
    assert len(table_rows(store, LAYERS_TABLE)) == sum(n for _, n in adds)
    assert writer.pending_models == writer.pending_layer_rows == 0


def test_one_part_per_architecture_and_a_model_added_twice_counts_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = TableWriter(store)
    writer.add(done("a", "LlamaForCausalLM", layers=3, alpha=2.0))
    writer.add(done("b", "GPT2LMHeadModel", layers=1))
    writer.add(done("a", "LlamaForCausalLM", layers=2, alpha=5.0))  # analysed again
    assert writer.pending_layer_rows == 3
    parts = writer.close()
    assert sorted(p.arch for p in parts) == ["GPT2LMHeadModel", "LlamaForCausalLM"]
    assert (writer.parts_written, writer.models_written) == (2, 2)
    layers = table_rows(store, LAYERS_TABLE)
    assert sorted((r["model_key"], r["alpha"]) for r in layers) == [
        ("a", 5.0), ("a", 5.0), ("b", 3.0)]
    assert writer.close() == []  # nothing left: no empty part


def test_an_old_buffer_is_written_on_add_and_by_the_timer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    clock = Clock()
    writer = TableWriter(store, max_age_s=60, clock=clock)
    writer.add(done("a"))
    clock.now = 59.0
    writer.add(done("b"))
    assert writer.pending_models == 2
    clock.now = 60.0
    writer.add(done("c"))  # the oldest is 60 s old
    assert writer.pending_models == 0 and writer.parts_written == 1

    timed = TableWriter(store, max_age_s=0.04).start()  # a worker idle between requests
    timed.add(done("d"))
    flushed = threading.Event()
    for _ in range(200):
        if timed.parts_written:
            flushed.set()
            break
        flushed.wait(0.01)
    timed.close()
    assert flushed.is_set() and timed.pending_models == 0
    assert sorted(r["model_key"] for r in table_rows(store, MODELS_TABLE)) == ["a", "b", "c", "d"]


def test_a_store_that_refuses_parts_costs_a_warning_and_the_buffer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = RefusingStore(tmp_path)
    writer = TableWriter(store, max_models=2)
    with caplog.at_level(logging.WARNING, logger="esd_worker"):
        writer.add(done("a"))
        writer.add(done("b"))  # full: the write fails, no exception
        writer.add(done("c"))
        assert writer.close() == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one line per failed write
    assert warnings[0].startswith("results tables: 2 finished model(s) not written")
    assert "connection reset" in warnings[0] and "esd-sweep compact" in warnings[0]
    assert writer.pending_models == 0 and writer.parts_written == 0
    assert not list(store.list_keys("_tables/"))


def test_a_model_whose_rows_the_schema_refuses_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    writer = TableWriter(store)
    bad = DoneModel(done("bad").marker, [{"layer": "x", "M": 1e30}])  # past int64
    with caplog.at_level(logging.WARNING, logger="esd_worker"):
        writer.add(bad)
        writer.add(done("good"))
    writer.close()
    assert "model_key=bad left out" in caplog.text
    assert [r["model_key"] for r in table_rows(store, MODELS_TABLE)] == ["good"]


# -- end to end: the real worker ---------------------------------------------------------------


def same(rows: Any) -> list[dict[str, Any]]:
    """Rows with NaN as text, so that equal rows compare equal (NaN != NaN)."""
    return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
            for r in rows]


def assert_tables_match_the_files(store: LocalStore, keys: list[str]) -> None:
    """The parts hold exactly the done models, and each model's layer rows are its
    layers.csv's, cell for cell (as compact would make them from the files); a reader
    counts every row (each vouches for the files the worker wrote: no fallback needed)."""
    assert sorted(list_markers(store)) == sorted(keys)
    models = table_rows(store, MODELS_TABLE)
    assert sorted(r["model_key"] for r in models) == sorted(keys)
    assert sorted(k for b in Tables(store).models(["model_key"], fallback=False)
                  for k in b.column(0).to_pylist()) == sorted(keys)
    from_files = {d.marker.model_key: d for d in read_done_models(store, keys)}
    assert same(sorted(models, key=lambda r: r["model_key"])) == same(sorted(
        (d.model_row() for d in from_files.values()), key=lambda r: r["model_key"]))
    layers = table_rows(store, LAYERS_TABLE)
    for key in keys:
        csv_rows = layers_from_csv(store.get_bytes(model_file_key(key, "layers.csv")) or b"")
        got = sorted((r for r in layers if r["model_key"] == key),
                     key=lambda r: r["layer_index"])
        assert len(got) == len(csv_rows) > 0
        assert same(got) == same(from_files[key].layer_rows())
        assert [r["layer"] for r in got] == [r["layer"] for r in csv_rows]
        assert set(LAYER_COLUMNS) <= set(got[0])


def _env() -> dict[str, str]:
    return os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_a_serving_worker_stopped_by_sigterm_writes_what_it_finished(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([*worker_command(), "--serve", "--output", str(out), "--device",
                             "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    assert proc.stdin is not None and proc.stdout is not None
    key = model_key(str(gpt2_dir))
    proc.stdin.write(Request(model=str(gpt2_dir), key=key).to_line())
    proc.stdin.flush()
    try:
        for line in proc.stdout:
            if '"event": "result"' in line or '"event":"result"' in line:
                break
        # Finished, idle, its buffer not yet written (two minutes): a stop writes it.
        assert not (out / "_tables").exists()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 4, stderr
    assert_tables_match_the_files(LocalStore(out), [key])


@pytest.mark.slow
def test_a_local_sweep_leaves_parts_of_its_models(
    llama_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    """`esd-sweep run` on this machine: its served workers write the parts (one per
    architecture) when the controller drains them at the end."""
    models = tmp_path / "models.csv"
    models.write_text(f"model_id\n{llama_dir}\n{gpt2_dir}\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "controller.cli", "run", "--model-list",
                          str(models), "--output-dir", str(out), "--device", "cpu"],
                         capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    store = LocalStore(out)
    assert sorted(p.arch for p in Tables(store).parts(MODELS_TABLE)) == [
        "GPT2LMHeadModel", "LlamaForCausalLM"]
    assert_tables_match_the_files(store, [model_key(str(llama_dir)), model_key(str(gpt2_dir))])
