"""One sweep at a time writes an output (controller.output.lease): a second one exits 2 naming the
first, or waits with --wait-lock; a crashed holder frees a local output at once and an S3
one once its lease expires; and the store, not a read-then-write, decides between two
sweeps that take an S3 lease at the same moment.

Holders are real: another process holding the lock (tests/support holds nothing for them),
a real `esd-sweep run`, and S3 is moto's server over HTTP through real boto3.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.output.lease import (
    EXPIRED,
    FREE,
    HELD,
    LEASE_TTL_S,
    FileLease,
    Held,
    ObjectLease,
    Owner,
    Seen,
    decide,
    observe,
    take_lease,
)
from esd_worker.core.store.layout import LEASE_KEY
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.s3 import S3Store
from esd_worker.core.store.stores import LocalStore
from tests.support import REPO_ROOT
from tests.support.leasechecks import (
    overwritten_behind_its_back,
    owner,
    race_for_the_lease,
    renewal_keeps_the_lease,
)
from tests.support.s3server import S3Server, make_store, serve_s3

HOLD = textwrap.dedent("""
    import sys
    from controller.output.lease import take_lease
    from esd_worker.core.store.opener import open_store

    lease = take_lease(open_store(sys.argv[1]), command="esd-sweep run", run_id="holder-run",
                       ttl_s=float(sys.argv[2]))
    if sys.argv[3:] == ["worker"]:  # a worker started while holding, as a sweep starts them
        import subprocess
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  close_fds=False)
        print(worker.pid, flush=True)
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
    lease.release()
""")


@dataclass
class Holder:
    """Another process holding an output's lease until released (or killed)."""

    proc: subprocess.Popen[str]
    worker_pid: int | None = None

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        """A crash: SIGKILL, nothing released by the holder itself."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def hold(url: str, *, ttl_s: float = LEASE_TTL_S, env: dict[str, str] | None = None,
         worker: bool = False) -> Holder:
    argv = [sys.executable, "-c", HOLD, url, str(ttl_s), *(["worker"] if worker else [])]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    holder = Holder(proc)
    line = proc.stdout.readline()
    if worker:
        holder.worker_pid = int(line)
        line = proc.stdout.readline()
    assert line == "held\n", proc.stderr.read() if proc.stderr else line
    return holder


def esd_sweep(*argv: str, env: dict[str, str] | None = None,
              wait: bool = True) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "controller.cli", *argv]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = esd_sweep(*argv, env=env)
    assert isinstance(done, subprocess.CompletedProcess)
    return done


def commands_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "commands.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def custom(tmp_path: Path, out: str, *lines: str) -> list[str]:
    """`esd-sweep run` in custom mode: cheap sweeps (no model, no torch)."""
    return ["run", "--mode", "custom", "--commands", str(commands_file(tmp_path, *lines)),
            "--device", "cpu", "--output-dir", out]


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("esd-sweep: error:")]


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


# -- the decision (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize(("seen", "expected"), [
    (None, FREE),
    (Seen(owner(), "e", age_s=0.0), HELD),
    (Seen(owner(), "e", age_s=10.5), HELD),  # past the TTL, within a clock tick: not yet
    (Seen(owner(), "e", age_s=11.5), EXPIRED),
    (Seen(None, "e", age_s=LEASE_TTL_S), HELD),  # unreadable: the default TTL
    (Seen(None, "e", age_s=LEASE_TTL_S + 2), EXPIRED),
], ids=["no-object", "fresh", "within-a-tick", "expired", "garbage-fresh", "garbage-expired"])
def test_decide(seen: Seen | None, expected: str) -> None:
    """A lease object is taken over only when it is older than its holder's TTL by more
    than the one second that HTTP dates can hide; an unreadable one with the default TTL."""
    assert decide(seen) == expected


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"host": "h"}', b"\xff"],
                         ids=["empty", "half-written", "list", "missing-fields", "not-utf8"])
def test_a_record_that_is_no_record_reads_as_unknown(data: bytes) -> None:
    """A half-written or foreign lease file must not break the second sweep's message."""
    assert Owner.from_json(data) is None


# -- a local output -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["run", "--model-list", "{list}", "--output-dir", "{out}", "--device", "cpu"],
    ["run", "--mode", "custom", "--commands", "{commands}", "--output-dir", "{out}",
     "--device", "cpu"],
    ["refit", "--output-dir", "{out}"],
], ids=["run", "run-custom", "refit"])
def test_a_second_sweep_on_a_held_local_output_exits_2_naming_the_holder(
    argv: list[str], tmp_path: Path
) -> None:
    """Exit 2 and one line naming the holder (host, its pid, user, run id, since when) and
    what to do; nothing of the second sweep's reaches the output (no worker log, no run
    report)."""
    out = tmp_path / "out"
    models = tmp_path / "models.csv"
    models.write_text(f"model_id\n{tmp_path / 'some-model'}\n")
    values = {"list": str(models), "out": str(out),
              "commands": str(commands_file(tmp_path, "true"))}
    holder = hold(str(out))
    try:
        done = run(*(arg.format(**values) for arg in argv))
    finally:
        holder.release()
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done)
    assert f"{out} is in use by another sweep: host={socket.gethostname()} " \
           f"pid={holder.proc.pid} " in line
    assert "run=holder-run (esd-sweep run) since " in line and "--wait-lock" in line
    assert not (out / "runs").exists() and not (out / "logs" / "workers").exists()
    assert not (out / LEASE_KEY).exists()  # the holder deleted its file on release


def test_dry_run_takes_no_lease(tmp_path: Path) -> None:
    """--dry-run writes nothing, so it prints its commands while another sweep runs."""
    out = tmp_path / "out"
    models = tmp_path / "models.csv"
    models.write_text(f"model_id\n{tmp_path / 'some-model'}\n")
    holder = hold(str(out))
    try:
        done = run("run", "--model-list", str(models), "--output-dir", str(out),
                   "--device", "cpu", "--dry-run")
    finally:
        holder.release()
    assert done.returncode == 0, done.stderr
    assert "esd_worker.cli" in done.stdout


def test_a_running_sweep_holds_its_output_and_wait_lock_waits_for_it(tmp_path: Path) -> None:
    """A real sweep holds the output while it runs: a second one exits 2 naming it (its pid
    and run id); a third with --wait-lock says it waits, starts once the first has ended
    (its run starts no earlier than the first's ends) and exits 0."""
    out = tmp_path / "out"
    first = esd_sweep(*custom(tmp_path, str(out), "sleep 4"), wait=False)
    assert isinstance(first, subprocess.Popen)
    deadline = time.monotonic() + 60
    while not (out / LEASE_KEY).is_file() or not (out / LEASE_KEY).read_bytes():
        assert first.poll() is None and time.monotonic() < deadline, "the first sweep ended"
        time.sleep(0.05)
    record = json.loads((out / LEASE_KEY).read_text())

    second = run(*custom(tmp_path, str(out), "true"))
    third = esd_sweep(*custom(tmp_path, str(out), "true"), "--wait-lock", "120", wait=False)
    assert isinstance(third, subprocess.Popen)
    _, first_err = first.communicate(timeout=120)
    _, third_err = third.communicate(timeout=120)

    assert second.returncode == 2, second.stderr
    [line] = error_lines(second)
    assert f"pid={first.pid} " in line and f"run={record['run_id']} " in line
    assert first.returncode == 0, first_err
    assert third.returncode == 0, third_err
    assert "waiting for" in third_err and f"pid={first.pid} " in third_err
    reports = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    by_run = {r["run_id"]: r for r in reports}
    assert len(reports) == 2  # the second sweep ran nothing
    later = next(r for r in reports if r["run_id"] != record["run_id"])
    assert later["started_at"] >= by_run[record["run_id"]]["finished_at"]
    assert not (out / LEASE_KEY).exists()


def test_a_crashed_holder_frees_a_local_output_at_once(tmp_path: Path) -> None:
    """A holder killed with SIGKILL releases nothing itself and leaves its record behind;
    the kernel drops its lock, so the next sweep runs at once (no --wait-lock, no expiry)."""
    out = tmp_path / "out"
    holder = hold(str(out))
    holder.kill()
    assert json.loads((out / LEASE_KEY).read_text())["pid"] == holder.proc.pid  # left behind

    done = run(*custom(tmp_path, str(out), "true"))
    assert done.returncode == 0, done.stderr
    assert not (out / LEASE_KEY).exists()


@pytest.mark.parametrize(("lines", "signals", "code"), [
    (["true"], 0, 0),
    (["sleep 60"], 2, 130),
], ids=["finished", "ctrl-c-twice"])
def test_the_lease_is_released_however_the_sweep_ends(
    lines: list[str], signals: int, code: int, tmp_path: Path
) -> None:
    """Done or interrupted, the sweep lets go of the output: the lock file is gone and the
    next sweep takes the output at once."""
    out = tmp_path / "out"
    proc = esd_sweep(*custom(tmp_path, str(out), *lines), wait=False)
    assert isinstance(proc, subprocess.Popen)
    if signals:
        deadline = time.monotonic() + 60
        while not (out / "logs" / "workers" / "cmd-1.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert not (out / LEASE_KEY).exists()
    lease = take_lease(LocalStore(out), command="test", run_id=None)
    assert isinstance(lease, FileLease)
    lease.release()


def test_the_lease_is_released_when_the_sweep_fails(tmp_path: Path) -> None:
    """An error after the lease was taken (an unreadable --commands file) ends the sweep
    with its own message and exit status, and frees the output."""
    out = tmp_path / "out"
    done = run("run", "--mode", "custom", "--commands", str(tmp_path / "missing.txt"),
               "--device", "cpu", "--output-dir", str(out))
    assert done.returncode == 2 and "--commands" in done.stderr, done.stderr
    lease = take_lease(LocalStore(out), command="test", run_id=None)
    assert isinstance(lease, FileLease)
    lease.release()


def test_wait_lock_gives_up_after_its_seconds(tmp_path: Path) -> None:
    """--wait-lock 1 on an output that stays held: exit 2 after about a second, saying how
    long it waited and who still holds it."""
    out = tmp_path / "out"
    holder = hold(str(out))
    try:
        t0 = time.monotonic()
        done = run(*custom(tmp_path, str(out), "true"), "--wait-lock", "1")
        took = time.monotonic() - t0
    finally:
        holder.release()
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done)
    assert "still in use after waiting 1s (--wait-lock)" in line
    assert f"pid={holder.proc.pid} " in line
    assert 1.0 <= took < 30


# -- an S3 output ------------------------------------------------------------------------------


def _s3_env(server: S3Server) -> dict[str, str]:
    return server.subprocess_env(HF_TOKEN="hf_secret_token_for_the_test")


def test_a_held_s3_output_exits_2_with_the_lease_expiry(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Exit 2 naming the holder and until when its lease runs unless renewed; the lease
    object holds who, never a credential of the holder's environment."""
    url = s3_server.url(s3_server.new_bucket(), "sweeps/a")
    env = _s3_env(s3_server)
    holder = hold(url, env=env)
    try:
        bucket = url.split("/")[2]
        body = s3_server.client().get_object(Bucket=bucket, Key=f"sweeps/a/{LEASE_KEY}")[
            "Body"].read().decode()
        done = run(*custom(tmp_path, url, "true"), env=env)
    finally:
        holder.release()
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done)
    assert f"{url} is in use by another sweep: " in line and f"pid={holder.proc.pid} " in line
    assert ", lease until " in line and "unless renewed" in line
    for secret in (env["AWS_SECRET_ACCESS_KEY"], env["HF_TOKEN"]):
        assert secret not in body
    assert s3_server.keys(bucket, "sweeps/a/") == []  # released: nothing left


def test_an_expired_s3_lease_is_taken_over(s3_server: S3Server, tmp_path: Path) -> None:
    """A holder killed with SIGKILL renews nothing: its lease holds until its TTL has passed
    (exit 2 before), and the next sweep after that takes it over and says from whom."""
    url = s3_server.url(s3_server.new_bucket(), "out")
    env = _s3_env(s3_server)
    holder = hold(url, ttl_s=1.0, env=env)
    holder.kill()
    before = run(*custom(tmp_path, url, "true"), env=env)
    time.sleep(3.5)  # the TTL, the clock tick of HTTP dates, and the tick we started in
    after = run(*custom(tmp_path, url, "true"), env=env)

    assert before.returncode == 2, before.stderr
    assert after.returncode == 0, after.stderr
    assert "took over the expired lease" in after.stderr
    assert f"pid={holder.proc.pid} " in after.stderr
    assert LEASE_KEY not in {k.rsplit("/", 1)[-1] for k in s3_server.keys(url.split("/")[2])}


def test_renewal_keeps_an_s3_lease_past_its_ttl(s3_server: S3Server) -> None:
    renewal_keeps_the_lease(make_store(s3_server))


def _expired(store: S3Store) -> Seen:
    """A lease object of a holder that stopped renewing, once expired."""
    dead = ObjectLease.claim(store, owner(ttl_s=1.0), None, renew=False)
    assert isinstance(dead, ObjectLease)
    time.sleep(3.0)
    seen = observe(store)
    assert seen is not None and decide(seen) == EXPIRED
    return seen


@pytest.mark.parametrize("state", [FREE, EXPIRED])
def test_two_sweeps_racing_for_an_s3_lease_exactly_one_wins(
    state: str, s3_server: S3Server
) -> None:
    """Both contenders look first and see the lease free (or expired); then both write at
    once. The conditional write lets exactly one through: the other is refused (and, on
    looking again, finds it held by the winner)."""
    store = make_store(s3_server)
    winner = race_for_the_lease(store, None if state == FREE else _expired(store))
    now = observe(store)
    assert now is not None and now.owner is not None and now.owner.token == winner.owner.token
    winner.release()


@pytest.mark.parametrize("how", ["taken-over", "overwritten"])
def test_release_deletes_only_its_own_s3_lease(how: str, s3_server: S3Server) -> None:
    """A sweep whose lease is no longer its own (taken over after it expired, or replaced
    behind its back, which its renewal then notices) leaves the object alone on release."""
    store = make_store(s3_server)
    other: ObjectLease | Held | None = None
    if how == "taken-over":
        stale = ObjectLease.claim(store, owner(ttl_s=1.0), None, renew=False)
        assert isinstance(stale, ObjectLease)
        time.sleep(3.0)
        other = ObjectLease.attempt(store, owner())
        assert isinstance(other, ObjectLease)
        other_token = other.owner.token
    else:
        stale, other_token = overwritten_behind_its_back(store)
    stale.release()
    seen = observe(store)
    assert seen is not None and seen.owner is not None and seen.owner.token == other_token
    if isinstance(other, ObjectLease):
        other.release()  # its renewal thread would outlive the module's S3 server


def test_wait_lock_waits_until_the_s3_holder_releases(s3_server: S3Server) -> None:
    """A contender that waits gets the lease once the holder lets go, not before."""
    store = make_store(s3_server)
    holder = take_lease(store, command="esd-sweep run", run_id="a")
    assert isinstance(holder, ObjectLease)
    released_at: list[float] = []

    def let_go() -> None:
        time.sleep(1.5)
        released_at.append(time.monotonic())
        holder.release()

    thread = threading.Thread(target=let_go)
    thread.start()
    waiter = take_lease(store, command="esd-sweep run", run_id="b", wait_s=30, poll_s=0.2)
    got_at = time.monotonic()
    thread.join()
    assert isinstance(waiter, ObjectLease)
    assert released_at and got_at >= released_at[0]
    seen = observe(store)
    assert seen is not None and seen.owner is not None and seen.owner.run_id == "b"
    waiter.release()


def test_a_worker_outliving_a_crashed_sweep_does_not_hold_its_output(tmp_path: Path) -> None:
    """The lock is not inherited: a sweep killed with SIGKILL while a worker it started
    (close_fds=False, the most a spawner could pass on) still runs frees the output, and
    the next sweep takes it at once."""
    out = tmp_path / "out"
    holder = hold(str(out), worker=True)
    assert holder.worker_pid is not None
    try:
        holder.kill()
        os.kill(holder.worker_pid, 0)  # the worker still runs
        lease = take_lease(open_store(str(out)), command="test", run_id=None)
        assert isinstance(lease, FileLease)
        lease.release()
    finally:
        os.kill(holder.worker_pid, signal.SIGKILL)
