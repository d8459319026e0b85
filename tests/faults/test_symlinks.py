"""Files planted in a shared results folder: a symlink or a FIFO where the sweep writes its lease
or a log is refused, and nothing it points at is created, truncated, appended to or chmod'ed.

Whoever can write a shared results folder could otherwise make another user's sweep truncate
(the lease) or append to and chmod 0600 (a log) any file that user can write, by linking
`_lease.json` or a log's name to it; a FIFO there made the sweep wait for a reader forever.
A refused lease or run log stops the run before it starts (exit 2, one line naming the
file), as any other unusable lease or log does; a model's own log is left out with one line
and the model is analysed. A regular file another user created at a log's name is refused the
same way (they could read every line appended to it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from esd_worker.core.store.stores import LocalStore
from tests.controller.test_sweep import write_model_list
from tests.faults.conftest import esd_sweep, run_args, whole

pytestmark = pytest.mark.slow

PRECIOUS = b"the victim's own file\n"
PRECIOUS_MODE = 0o640


def plant(path: Path, kind: str, target: Path) -> None:
    """Put a `kind` at `path`: a symlink to `target` (a file with content), a dangling one
    to `target` (which does not exist), or a FIFO."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        target.write_bytes(PRECIOUS)
        target.chmod(PRECIOUS_MODE)
    path.symlink_to(target)


def sweep_refusing(models: Path, out: Path, path: Path, why: str, exit_code: int,
                   key: str) -> None:
    """Run the sweep and check its one refusal of `path`: exit 2 (its last line, nothing
    analysed), or the model analysed whole without that file (exit 0)."""
    done = esd_sweep(*run_args(models, str(out)), timeout=120)
    assert done.returncode == exit_code, done.stderr
    assert "Traceback" not in done.stderr
    refusals = [line for line in done.stderr.splitlines() if why in line]
    assert len(refusals) == 1, done.stderr
    assert str(path) in refusals[0]
    if exit_code == 2:
        assert refusals[0] == done.stderr.strip().splitlines()[-1]
        assert refusals[0].startswith("esd-sweep: error: ")
        assert not (out / key / "result.json").exists()
    else:
        assert whole(LocalStore(out), key)


@pytest.mark.parametrize(
    ("planted", "kind", "exit_code"),
    [
        ("_lease.json", "symlink", 2),
        ("_lease.json", "dangling", 2),
        ("logs/esd-sweep.log", "symlink", 2),
        ("logs/esd-sweep.log", "dangling", 2),
        ("logs/esd-sweep.log", "fifo", 2),
        ("logs/workers/_worker-1.log", "symlink", 2),
        ("logs/workers/{key}.log", "symlink", 0),
        ("logs/workers/{key}.log", "fifo", 0),
    ],
    ids=["lease-symlink", "lease-dangling-symlink", "run-log-symlink",
         "run-log-dangling-symlink", "run-log-fifo", "worker-log-symlink",
         "model-log-symlink", "model-log-fifo"],
)
def test_a_planted_lease_or_log_is_refused_and_its_target_left_alone(
    tiny_models: list[Path], keys: list[str], tmp_path: Path, planted: str, kind: str,
    exit_code: int,
) -> None:
    """The lease and the run's log are the run's to hold: one the sweep may not use stops it
    before any model starts, exit 2, as a log folder it cannot write does, with one line
    that names the file. A model's log is one file of thousands: its model is analysed
    without it (exit 0, the model whole) after one line naming it. Either way the file the
    link names keeps its bytes and its mode, and a dangling link's target is not created."""
    models = write_model_list(tmp_path / "models.csv", [(str(tiny_models[0]), "", "")])
    out = tmp_path / "results"
    path = out / planted.format(key=keys[0])
    target = tmp_path / "victim" / "precious.txt"
    plant(path, kind, target)

    sweep_refusing(models, out, path, "not a regular file", exit_code, keys[0])
    if kind == "symlink":
        assert target.read_bytes() == PRECIOUS
        assert target.stat().st_mode & 0o777 == PRECIOUS_MODE
    if kind == "dangling":
        assert not target.exists()
    assert path.is_symlink() or path.is_fifo()  # refused, not replaced nor removed


OTHER_UID = 65534  # nobody


@pytest.mark.parametrize(
    ("planted", "exit_code"),
    [("logs/esd-sweep.log", 2), ("logs/workers/_worker-1.log", 2),
     ("logs/workers/{key}.log", 0)],
    ids=["run-log", "worker-log", "model-log"],
)
def test_a_log_another_user_created_is_refused_and_left_alone(
    tiny_models: list[Path], keys: list[str], tmp_path: Path, planted: str, exit_code: int,
) -> None:
    """A regular file at a log's name that another user created (0666 in a shared results
    folder) would get our log lines, which name private repos and paths even redacted, where
    that user reads them (before: appended to, exit 0; as root even chmod'ed, still theirs).
    It is refused as a symlink is: the run's and a worker's log stop the run (exit 2, one
    line naming the file), a model's log is left out and the model analysed; the file keeps
    its bytes, mode and owner."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's file takes root (chown), and these tests do "
                    "not run as root here")
    models = write_model_list(tmp_path / "models.csv", [(str(tiny_models[0]), "", "")])
    out = tmp_path / "results"
    path = out / planted.format(key=keys[0])
    path.parent.mkdir(parents=True)
    path.write_bytes(PRECIOUS)
    path.chmod(0o666)
    os.chown(path, OTHER_UID, -1)

    sweep_refusing(models, out, path, "another user", exit_code, keys[0])
    found = path.stat()
    assert (path.read_bytes(), found.st_mode & 0o777, found.st_uid) == (
        PRECIOUS, 0o666, OTHER_UID)
