"""The list's numeric columns (size_bytes, num_params, matrix_dim) through `esd-sweep run
--backend kubernetes`, dry and real: a cell that is no number in its column's range (NaN,
1e999, negative, past any model, not a number) is unknown (looked up, or estimated), never
the end of the run, and said once per column, not once per row.

Real runs go through the CLI, the real client and KubeSim: tests.support.cluster's
MarkerSimulator for one Job per model, the IndexedJobSimulator and the worker's own batch loop
(tests.support.shardworker) for shards. The hub is offline (the conftest): every unknown size
is the estimate.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.cli import main
from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import list_markers
from esd_worker.core.store.stores import Store
from tests.support.cluster import NS, MarkerSimulator
from tests.support.indexed import IndexedJobSimulator
from tests.support.kubesim import KubeSim
from tests.support.shardworker import ShardWorker

pytestmark = pytest.mark.usefixtures("restore_logging")

COLUMNS = ("size_bytes", "num_params", "matrix_dim")
# (size_bytes, num_params, matrix_dim) of rows 2.. of the list; the first row is good.
BAD_CELLS = [
    ("NaN", "nan", "NaN"),
    ("1e999", "1e999", "1e999"),  # inf once read as a float
    ("inf", "-inf", "Infinity"),
    ("-5", "-5", "-5"),
    ("lots", "many", "wide"),
    ("1e30", "1e30", "1e30"),  # finite, and past any model (1000T bytes or parameters)
    ("9" * 400, "9" * 400, "9" * 400),  # a whole number too long for a float
    ("1e999G", "0", "0"),
]
ROWS = [("1000000000", "1B", "2048"), *BAD_CELLS * 25]  # 201 models, 200 with bad cells


def write_numbers_list(path: Path, rows: Sequence[tuple[str, str, str]]) -> list[str]:
    """A list of org/ok-<i> with these cells; the ids (ShardWorker analyses `ok-…` ones)."""
    ids = [f"org/ok-{i}" for i in range(len(rows))]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model_id", *COLUMNS])
        writer.writerows([(model, *cells) for model, cells in zip(ids, rows, strict=True)])
    return ids


def column_warnings(err: str) -> dict[str, list[str]]:
    """The warning lines about each column's cells."""
    return {column: [line for line in err.splitlines()
                     if "WARNING" in line and f"{column} " in line and "line " in line]
            for column in COLUMNS}


def assert_said_once_per_column(err: str) -> None:
    """One warning per column for 200 bad rows, naming the first bad row's line (3: the
    header is line 1, the good row line 2) and its cell."""
    assert "Traceback" not in err
    warnings = column_warnings(err)
    for column, lines in warnings.items():
        assert len(lines) == 1, (column, lines)
        assert "line 3:" in lines[0], lines[0]
    assert "'NaN'" in warnings["size_bytes"][0]


def run_args(models: Path, out: Path, shard_size: str, *extra: str) -> list[str]:
    return ["run", "--backend", "kubernetes", "--shard-size", shard_size, "--namespace", NS,
            "--model-list", str(models), "--output-dir", str(out), "--allow-local-output",
            "--no-telemetry", "--image", "ghcr.io/example/esd-sweep:0.1.0",
            "--poll-interval", "0.05", "--max-parallel", "8", *extra]


@pytest.mark.parametrize("shard_size", ["1", "0"], ids=["job-per-model", "sharded"])
def test_a_dry_run_reads_bad_cells_as_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shard_size: str,
) -> None:
    """Before: ValueError (NaN) or OverflowError (1e999) from int() ended the run, exit 1.
    Now every model gets its Job (one each, or in a shard), each bad cell is sized as if
    empty (the estimate: the hub is offline here), and each column is warned of once."""
    models = tmp_path / "m.csv"
    ids = write_numbers_list(models, ROWS)
    code = main(run_args(models, tmp_path / "out", shard_size, "--dry-run"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert_said_once_per_column(captured.err)
    docs = [d for d in yaml.safe_load_all(captured.out) if d]
    if shard_size == "1":
        assert len(docs) == len(ids)
    else:
        assert sum(d["spec"]["completions"] for d in docs) >= 1
    assert not (tmp_path / "out").exists()


def test_a_run_of_one_job_per_model_analyses_every_row(
    sim: KubeSim, kubeconfig: Path, cluster: MarkerSimulator, out: Path, store: Store,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Every model, bad cells or not, gets its Job and is done: exit 0."""
    models = tmp_path / "m.csv"
    ids = write_numbers_list(models, ROWS[:9])

    def script(job: Mapping[str, Any]) -> list[Any]:
        return ["succeed"]

    with cluster.autopilot(script):
        code = main(run_args(models, out, "1"))
    err = capsys.readouterr().err
    assert code == 0, err
    assert_said_once_per_column(err)
    assert list_markers(store) == {model_key(i) for i in ids}


def test_a_sharded_run_analyses_every_row(
    sim: KubeSim, kubeconfig: Path, out: Path, store: Store, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The shards hold every row (the shard lists keep the cells: the worker does not read
    them), the worker's batch loop analyses each: exit 0."""
    models = tmp_path / "m.csv"
    ids = write_numbers_list(models, ROWS[:9])
    with IndexedJobSimulator(sim, namespace=NS).autopilot(ShardWorker(store)):
        code = main(run_args(models, out, "0"))
    err = capsys.readouterr().err
    assert code == 0, err
    assert_said_once_per_column(err)
    assert list_markers(store) == {model_key(i) for i in ids}
