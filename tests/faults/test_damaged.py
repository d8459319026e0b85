"""Result files damaged after a run: what `status`, `run` and `report` make of them.

A listing shows a deleted or resized file: `status` counts the model damaged, `run` analyses
it again (one line each), and `report` leaves it out too (its table rows no longer agree with
its files, which are checked as `status` checks them: one line each), so the two agree.
Same-size corruption only a hash shows stands until its marker is deleted: the report shows
that model from its table rows. Never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import all_whole, esd_sweep, run_args, status

pytestmark = pytest.mark.slow


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_results_are_found_and_analysed_again(
    model_list: Path, keys: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "results"
    first = esd_sweep(*run_args(model_list, str(out)))
    assert first.returncode == 0, first.stderr
    assert all_whole(out, keys)
    deleted, truncated, corrupt = keys
    (out / deleted / "layers.csv").unlink()
    eigs = out / truncated / "eigs.npz"
    eigs.write_bytes(eigs.read_bytes()[:100])
    flip_a_byte(out / corrupt / "layers.csv")

    assert status(model_list, str(out)) == {
        "models": 3, "bad_rows": 0, "done": 1, "todo": 2, "stale": 0, "damaged": 2,
        "failed_permanent": 0}

    report = esd_sweep("report", "--output-dir", str(out))
    assert report.returncode == 0 and "Traceback" not in report.stderr
    assert "report: 1 model(s)" in report.stdout  # what status counts done
    for key, name in ((truncated, "eigs.npz"), (deleted, "layers.csv")):
        named = [line for line in report.stderr.splitlines() if key in line]
        assert len(named) == 1 and f"left out: {name} is missing or not" in named[0], \
            report.stderr
        assert not (out / "report" / "models" / key).exists()
    assert (out / "report" / "models" / corrupt / "esd.png").exists()

    corrupt_marker = (out / corrupt / "result.json").read_bytes()
    again = esd_sweep(*run_args(model_list, str(out)))
    assert again.returncode == 0, again.stderr
    for key in (deleted, truncated):
        assert f"model_key={key} is not done" in again.stderr
    assert all_whole(out, [deleted, truncated])
    # Same size: no listing can tell; the marker stands until it is deleted.
    assert (out / corrupt / "result.json").read_bytes() == corrupt_marker
    (out / corrupt / "result.json").unlink()
    last = esd_sweep(*run_args(model_list, str(out)))
    assert last.returncode == 0, last.stderr
    assert all_whole(out, keys)
    report = esd_sweep("report", "--output-dir", str(out))
    assert report.returncode == 0 and "left out" not in report.stderr
