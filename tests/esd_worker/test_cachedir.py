"""esd_worker.fetch.cachedir: the workers' own download directory. Real folders and real flock
locks; two CacheDir objects in one process are two workers (flock locks belong to open
files, not processes), and one test holds a repo from another process to show that too."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from esd_worker.core.errors import TransientError
from esd_worker.fetch.cachedir import STATE_DIR, CacheDir
from tests.support import REPO_ROOT

REPO = "org/model"
FOLDER = "models--org--model"


def download(cache: Path, folder: str = FOLDER, name: str = "weights") -> Path:
    """What a download leaves: the repo folder with a snapshot file."""
    path = cache / folder / "snapshots" / "abc" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"w" * 64)
    return path


def state(cache: Path, part: str) -> list[str]:
    return sorted(p.name for p in (cache / STATE_DIR / part).iterdir())


def test_a_folder_the_workers_created_goes_with_its_last_holder(tmp_path: Path) -> None:
    """Two workers hold the repo (one analysing it, one that fetched it ahead): the first to
    finish cannot evict it; the second, the last holder, does, and leaves no lock or mark."""
    one, two = CacheDir(tmp_path), CacheDir(tmp_path)
    first = one.hold(REPO)
    download(tmp_path)
    second = two.hold(REPO)
    assert state(tmp_path, "owned") == [FOLDER]
    assert one.release(first, evict=True) is False
    assert (tmp_path / FOLDER).is_dir()
    assert two.release(second, evict=True) is True
    assert not (tmp_path / FOLDER).exists()
    assert state(tmp_path, "owned") == state(tmp_path, "locks") == state(tmp_path, "trash") == []


def test_evict_false_keeps_the_folder(tmp_path: Path) -> None:
    cache = CacheDir(tmp_path)
    hold = cache.hold(REPO)
    download(tmp_path)
    assert cache.release(hold, evict=False) is False
    assert (tmp_path / FOLDER).is_dir()
    assert cache.release(cache.hold(REPO), evict=True) is True  # still the workers'


def test_a_folder_that_was_there_before_is_never_evicted(tmp_path: Path) -> None:
    """The user's own download (and another repo of theirs) in the folder given as
    --cache-dir: a worker uses it and adds a revision's file, and nothing of it goes."""
    mine = download(tmp_path)
    other = download(tmp_path, "models--user--other")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (mine, other)}
    cache = CacheDir(tmp_path)
    hold = cache.hold(REPO)
    added = download(tmp_path, name="added-by-the-worker")
    assert cache.release(hold, evict=True) is False
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (mine, other)} == before
    assert added.exists() and state(tmp_path, "owned") == []


def test_a_marked_folder_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """Someone swaps the workers' folder for a link to a folder of the user's: the link is
    not a folder the workers made, and what it points at is untouched."""
    cache = CacheDir(tmp_path / "cache")
    hold = cache.hold(REPO)
    precious = download(tmp_path / "users-files", "kept")
    (tmp_path / "cache" / FOLDER).symlink_to(tmp_path / "users-files" / "kept")
    assert cache.release(hold, evict=True) is False
    assert precious.read_bytes() == b"w" * 64


def test_a_holder_waits_out_an_eviction_and_takes_the_new_lock_file(tmp_path: Path) -> None:
    """An evicter holds the exclusive lock and then removes the lock file: the waiting
    worker must end up locking the file that is there now (it opens the file again after
    each try, and checks it is still the one at the path), or a third worker could evict
    the repo while the second uses it (it would get the exclusive lock on the new file)."""
    CacheDir(tmp_path)
    lock = tmp_path / STATE_DIR / "locks" / f"{FOLDER}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    waiter = CacheDir(tmp_path)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.hold(REPO)))
    thread.start()
    time.sleep(0.3)
    assert got == []  # waiting on the eviction
    lock.unlink()
    os.close(fd)  # the evicter is done
    thread.join(10)
    [hold] = got
    download(tmp_path)
    third = CacheDir(tmp_path)
    assert third.release(third.hold(REPO), evict=True) is False
    assert (tmp_path / FOLDER).is_dir()
    assert waiter.release(hold, evict=True) is True  # type: ignore[arg-type]


def test_a_stuck_eviction_is_a_transient_error_after_the_deadline(tmp_path: Path) -> None:
    CacheDir(tmp_path)
    fd = os.open(tmp_path / STATE_DIR / "locks" / f"{FOLDER}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TransientError, match=f"kept {FOLDER} locked for 0s"):
            CacheDir(tmp_path, lock_wait_s=0.2).hold(REPO)
    finally:
        os.close(fd)


_HOLDER = """
import sys, time
from pathlib import Path
from esd_worker.fetch.cachedir import CacheDir
CacheDir(Path(sys.argv[1])).hold(sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


def test_a_repo_held_by_another_process_is_not_evicted(tmp_path: Path) -> None:
    """Another worker process holds the repo: this one cannot evict it until that process
    lets go (here: ends, which frees its lock as any exit does)."""
    cache = CacheDir(tmp_path)
    hold = cache.hold(REPO)
    download(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), REPO],
                             cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert other.stdout is not None and other.stdout.readline() == "held\n"
    assert cache.release(hold, evict=True) is False
    assert (tmp_path / FOLDER).is_dir()
    other.communicate("", timeout=30)
    assert cache.release(cache.hold(REPO), evict=True) is True


def test_a_crash_mid_eviction_leaves_nothing_usable_and_is_cleaned_up(tmp_path: Path) -> None:
    """The folder is renamed into trash/ before it is deleted: a worker killed between the
    two leaves no half-deleted repo folder, and the next worker deletes the trash."""
    trash = tmp_path / STATE_DIR / "trash" / f"{FOLDER}.123.456"
    (trash / "snapshots").mkdir(parents=True)
    CacheDir(tmp_path)
    assert not trash.exists()
