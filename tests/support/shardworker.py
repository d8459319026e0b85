"""A shard pod's worker for the Indexed Job simulator: the real batch loop, a scripted analysis.

`ShardWorker` is the `worker(job, index, attempt)` callback of
tests.support.indexed.IndexedJobSimulator. For each pod it does what `esd-worker --shards`
does in a pod: reads its shard from the store (the shard folder in the Job's argv, the index
the simulator gives), runs the worker's own per-model loop (esd_worker.serve.batch.Batch: skip
what is done, attempt notes that find a model which killed a pod, failure records), and
ends the pod as the worker's exit status says (0 → succeed, 4 → exit 4). Only the analysis
is scripted, by the prefix of the model's name (after `org/`):

- `ok-…`: writes the model's marker (what analyse_model writes last);
- `bad-…`: a permanent error (a failure record, the shard goes on);
- `flaky-…`: a transient error on its first try, fine afterwards;
- `oom-…`: the pod is OOM-killed while analysing it (nothing recorded, the note stays);
- `crash-…`, `hang-…`, `leak-…`: the worker under the pod's supervisor
  (esd_worker.serve.supervisor) dies with SIGSEGV, is killed as hung, or is killed past its
  memory limit while analysing it: the supervisor writes the cause into the model's attempt
  note (its own write_cause) and starts a new worker in the same pod, which goes on; the
  batch's poison record names the cause once the model is out of retries.

`broken_nodes`: nodes whose GPU is broken: a pod there exits 6 (EXIT_DEVICE) at once,
having recorded nothing, as the worker's device check makes it; its log names the node
as the real worker's does, from NODE_NAME (the Downward API's spec.nodeName).
`evict` maps an index to the pod attempts that are evicted before they start (disruptions).
`analysed` counts analyses per model key: "done exactly once" is checked against it.
`progress`: the pod's supervisor keeps the shard's progress document as the real one does
(esd_worker.serve.shardprogress, fed the batch's own protocol lines, written after every
outcome; a done model's marker says it spent 1.5 s discovering and 2.5 s analysing).
"""

from __future__ import annotations

import collections
import io
import json
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings
from esd_worker.core.errors import (
    ERROR_PREFIX,
    EXIT_DEVICE,
    EXIT_OK,
    EXIT_PERMANENT,
    PermanentModelError,
    TransientError,
)
from esd_worker.core.store.layout import attempt_key, write_model_result
from esd_worker.core.store.marker import Marker, canonical_parameters
from esd_worker.core.store.stores import Store
from esd_worker.core.watchdog import ModelWatch
from esd_worker.serve.batch import Batch, BatchSettings
from esd_worker.serve.inbox import requests_from_list
from esd_worker.serve.shardprogress import ShardProgress, shard_progress
from esd_worker.serve.supervisor import crash_cause, memory_cause, write_cause
from tests.support.indexed import Exit, Outcome
from tests.support.podenv import resolve_env

PARAMS = canonical_parameters(AnalysisSettings().as_dict())


def _cause(name: str, model: str, key: str) -> str:
    """What the pod's supervisor says of a worker that died under a `crash-`, `hang-` or
    `leak-` model: the real supervisor's words."""
    if name.startswith("crash-"):
        return crash_cause(model, signum=signal.SIGSEGV)
    if name.startswith("leak-"):
        return memory_cause(model, 8 << 30, 9 << 30, "--memory-limit")
    watch = ModelWatch()
    watch.start(key, 0.0)
    return watch.overdue(watch.limit_s) or ""


class _ChildKilled(BaseException):
    """The supervised worker died under model `key` (`cause`); the pod lives on."""

    def __init__(self, key: str, cause: str) -> None:
        super().__init__(cause)
        self.key, self.cause = key, cause


class _PodKilled(BaseException):
    """The pod died under the worker (the kernel's OOM killer): nothing after runs."""


def shard_url(job: Mapping[str, Any]) -> str:
    """The shard folder in the worker's argv (`--shards URL`)."""
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index("--shards") + 1])


def run_id_of(job: Mapping[str, Any]) -> str:
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index("--run-id") + 1])


@dataclass
class ShardWorker:
    store: Store
    max_retries: int = 2
    evict: Mapping[int, set[int]] = field(default_factory=dict)
    broken_nodes: frozenset[str] = frozenset()
    analysed: collections.Counter[str] = field(default_factory=collections.Counter)
    tried: collections.Counter[str] = field(default_factory=collections.Counter)
    pods: int = 0
    progress: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, job: dict[str, Any], index: int, attempt: int,
                 pod: Mapping[str, Any] | None = None) -> Outcome:
        with self._lock:
            self.pods += 1
        if pod is not None and pod["spec"].get("nodeName") in self.broken_nodes:
            node = resolve_env(pod).get("NODE_NAME") or "?"  # what the worker can tell
            return Exit(EXIT_DEVICE, log=f"{ERROR_PREFIX}DeviceError: CUDA unusable on node "
                        f"{node}: cudaErrorNoDevice (the device self-check failed)\n")
        if attempt in self.evict.get(index, set()):
            return "evict"
        requests = requests_from_list(f"{shard_url(job)}/{index}.csv")
        template = WorkerSettings(model="-", output=self.store.url)
        tracker = self._tracker(job, index, requests, pod)
        while True:  # the pod's supervisor: a new worker after one died under a model
            batch = Batch(BatchSettings(template=template, run_id=run_id_of(job),
                                        max_retries=self.max_retries, skip_own_failures=True),
                          self.store, self._analyse, emit=_follower(tracker),
                          stderr=io.StringIO())
            try:
                tally = batch.run(iter(requests))
                break
            except _PodKilled:
                return "oom"
            except _ChildKilled as killed:
                if tracker is not None:
                    tracker.child_ended()
                data = self.store.get_bytes(attempt_key(killed.key))
                write_cause(self.store, killed.key, killed.cause, run_id=run_id_of(job),
                            note=json.loads(data) if data else None)
        code = tally.exit_code
        if tracker is not None:
            tracker.finish(EXIT_OK if code == EXIT_PERMANENT else code)
        if code in (EXIT_OK, EXIT_PERMANENT):  # --shards: a permanent failure is an outcome
            return "succeed"
        return Exit(code, log=f"worker: {tally.retryable} model(s) may succeed on a retry\n")

    def _tracker(self, job: Mapping[str, Any], index: int, requests: list[Any],
                 pod: Mapping[str, Any] | None) -> ShardProgress | None:
        if not self.progress:
            return None
        tracker = shard_progress(shard_url(job), index, run_id=run_id_of(job),
                                 keys=frozenset(r.key for r in requests), results=self.store,
                                 environ=resolve_env(pod) if pod is not None else {})
        assert tracker is not None
        tracker.every_s = 0.0  # a document after every outcome
        tracker.start()
        return tracker

    def _analyse(self, settings: WorkerSettings, store: Store, key: str) -> None:
        model = settings.model.rsplit("/", 1)[-1]  # the name after org/
        with self._lock:
            self.tried[key] += 1
            tries = self.tried[key]
        if model.startswith("oom-"):
            raise _PodKilled(model)
        if model.startswith(("crash-", "hang-", "leak-")):
            raise _ChildKilled(key, _cause(model, settings.model, key))
        if model.startswith("bad-"):
            raise PermanentModelError(f"{model}: not found on the hub")
        if model.startswith("flaky-") and tries == 1:
            raise TransientError(f"{model}: hub answered 503")
        marker = Marker(model=settings.model, model_key=key, parameters=PARAMS,
                        summary={"layers": 1},
                        timings={"discover_s": 1.5, "analyse_s": 2.5} if self.progress else {})
        write_model_result(store, marker, layers=b"layer,alpha\nl0,3.0\n")
        with self._lock:
            self.analysed[key] += 1


def _follower(tracker: ShardProgress | None) -> Callable[[str], None]:
    """The batch's protocol lines to the shard's progress (the supervisor reads them so)."""
    if tracker is None:
        return lambda line: None
    return lambda line: tracker.follow(json.loads(line))
