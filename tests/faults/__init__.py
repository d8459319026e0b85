"""The fault suite: what a sweep survives, tried the way operators break it.

Run it alone to see the list: `.venv/bin/python -m pytest tests/faults -v`. Each test is one
fault, end to end through the real `esd-sweep` CLI on tiny models (and moto's S3 server over
HTTP where the store is S3); docs/operations.md's "Reliability" section lists the same guarantees.

- test_kill.py       the controller SIGKILLed mid-run; the rerun finishes, nothing twice.
- test_disk.py       a write refused mid-file (disk full, file too large): no marker, a
                     retryable failure record, no temporary file; the rerun finishes.
- test_store.py      the S3 store dies mid-sweep: nothing half-written counts as done; the
                     rerun, with the store back, finishes.
- test_damaged.py    result files deleted, truncated or corrupted after the run: `status` and
                     `run` see what a listing shows (missing, other size), the report what a
                     hash shows (same size, other bytes), one line each, never a traceback.
- test_concurrent.py two sweeps on one output: one runs, the other is told who holds it.
- test_shard_pod.py  a shard pod's worker crashed, hung and out of memory under bad models
                     (esd-worker --shards, --models under their supervisor): those models
                     are recorded with their cause, the rest of the shard done in one run.

Faults covered closer to their code, not repeated here: a worker SIGKILLed (the OOM killer)
and poison models (tests/controller/test_sweep.py, tests/esd_worker/test_worker_batch.py), S3
refusing, throttling and dying under the worker (tests/esd_worker/test_s3.py), every errno of
a local store (tests/esd_worker/test_store.py), signals (tests/esd_worker/test_worker_signals.py).
"""
