"""What an output lease must do on any store with conditional writes, as checks that the
lease tests run on S3 (tests/controller/test_lease.py, moto's server) and on GCS's dialect
(tests/controller/test_lease_gcs.py, tests/support/gcsproxy.py): one body per behaviour,
whatever the store's precondition headers."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from controller.output.lease import (
    HELD,
    Held,
    LeaseHeldError,
    ObjectLease,
    Owner,
    Seen,
    decide,
    make_owner,
    observe,
    take_lease,
)
from esd_worker.core.store.layout import LEASE_KEY
from esd_worker.core.store.s3 import S3Store


def owner(ttl_s: float | None = 10.0) -> Owner:
    """A contender's identity (a run of `esd-sweep run`)."""
    return make_owner(command="esd-sweep run", run_id="r", ttl_s=ttl_s)


def renewal_keeps_the_lease(store: S3Store) -> None:
    """Held for three TTLs: renewed all along (its version changes), so a contender still
    finds it held and cannot take it; released, it is gone."""
    lease = take_lease(store, command="esd-sweep run", run_id="a", ttl_s=1.0)
    assert isinstance(lease, ObjectLease)
    first_etag = lease.etag
    time.sleep(3.0)
    seen = observe(store)
    assert seen is not None and seen.owner is not None
    assert seen.owner.token == lease.owner.token and seen.etag != first_etag
    assert decide(seen) == HELD
    with lease.tenure.holding() as held:
        assert held and not lease.tenure.expired  # each renewal moved its expiry on
    with pytest.raises(LeaseHeldError, match="in use by another sweep"):
        take_lease(store, command="esd-sweep run", run_id="b", ttl_s=1.0)
    lease.release()
    assert observe(store) is None


def race_for_the_lease(store: S3Store, seen: Seen | None, *, renew: bool = True) -> ObjectLease:
    """Two contenders that both saw the lease as `seen` (None: free) write at once: exactly
    one wins, the other is refused and, looking again, finds it held. The winner."""
    a, b = owner(), owner()
    barrier = threading.Barrier(2)

    def claim(contender: Owner) -> ObjectLease | Held | None:
        barrier.wait()
        return ObjectLease.claim(store, contender, seen, renew=renew)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(claim, [a, b]))
    won = [r for r in results if isinstance(r, ObjectLease)]
    assert len(won) == 1 and results.count(None) == 1
    loser = b if won[0].owner is a else a
    assert isinstance(ObjectLease.attempt(store, loser), Held)
    return won[0]


def overwritten_behind_its_back(store: S3Store) -> tuple[ObjectLease, str]:
    """A renewing lease whose object another holder then overwrites: returned once its
    renewal has noticed (lost), with the other holder's token."""
    stale = ObjectLease.claim(store, owner(ttl_s=0.6), None)
    assert isinstance(stale, ObjectLease)
    record = json.loads(stale.owner.to_json()) | {"token": "someone-else"}
    store.put_bytes(LEASE_KEY, json.dumps(record).encode())
    deadline = time.monotonic() + 10
    while not stale.lost:
        assert time.monotonic() < deadline, "the renewal never noticed"
        time.sleep(0.05)
    return stale, "someone-else"
