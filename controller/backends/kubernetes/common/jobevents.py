"""Kubernetes Events the controller writes on the sweep's Jobs: milestones and failures.

Owns building a core/v1 Event about one Job (involvedObject the Job with its uid; reason,
Normal / Warning, the message redacted by esd_worker.core.redact and cut to the API's 1 KB;
the controller as source.component / reportingComponent and the host it runs on as
reportingInstance; first/lastTimestamp in the API's RFC 3339 seconds) and sending it best
effort: each is tried once (common.client.KubeClient.create_event), a failure logs one
warning for the whole run and never reaches the run; a denial (401/403: RBAC without
`create events`) or a few failures in a row stop further tries. Bounded: an Event
(Job, reason, message) is sent once, and at most MAX_EVENTS a run. So `kubectl describe job`
shows what the sweep did with it. Does not read events (why a Job waits:
common.diagnosis, per_model.events) nor decide which milestones exist (the backends call
`normal` / `warning`).
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from controller.backends.kubernetes.common.errors import KubeError
from esd_worker.core.echo import echo

log = logging.getLogger(__name__)

COMPONENT = "esd-sweep-controller"  # source.component / reportingComponent of every Event
MAX_EVENTS = 300  # Events a run sends at most (a sweep of failures must not flood etcd)
MESSAGE_BYTES = 1024  # the API's bound on a message (UTF-8 bytes)
E = TypeVar("E", bound=Mapping[str, Any])
INSTANCE_CHARS = 128  # the API's bound on reportingInstance
FAILURES_BEFORE_GIVING_UP = 3  # failed creates in a row after which no more are tried


class EventSink(Protocol):
    """What sends an Event: KubeClient.create_event (one try, raises KubeError)."""

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None: ...


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def api_time(when: datetime.datetime) -> str:
    """A metav1.Time as the API takes it: RFC 3339 in UTC, whole seconds."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_message(text: str) -> str:
    """`text` for an Event's message: secrets redacted, control characters escaped (one
    line), at most MESSAGE_BYTES in UTF-8."""
    line = echo(text, limit=MESSAGE_BYTES - 64)  # room for echo's "… [N more characters]"
    data = line.encode("utf-8")
    if len(data) <= MESSAGE_BYTES:
        return line
    return data[:MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "…"


def failure_line(error: str, tail: Sequence[str]) -> str:
    """A failure's error and its log's last line (what a person looks at first), as the
    run's log shows them."""
    last = next((line.strip() for line in reversed(tail) if line.strip()), "")
    return f"{error} | {last}" if last and last not in error else error


def build_event(job: Mapping[str, Any], *, type_: str, reason: str, message: str,
                host: str, when: datetime.datetime, serial: int) -> dict[str, Any]:
    """The core/v1 Event about `job` (a Job as the API returned it). serial tells apart
    Events of one Job made within the same nanosecond (the name is `<job>.<hex>`, as
    client-go names them)."""
    meta = job.get("metadata") or {}
    name, namespace = str(meta.get("name") or ""), str(meta.get("namespace") or "")
    stamp = api_time(when)
    involved = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "namespace": namespace}
    if meta.get("uid"):
        involved["uid"] = str(meta["uid"])
    nanos = int(when.timestamp() * 1e9) + serial
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{name}.{nanos:x}", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason, "type": type_, "message": event_message(message),
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT, "reportingInstance": host[:INSTANCE_CHARS],
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def foreign(events: Iterable[E]) -> list[E]:
    """The events some other component wrote (the scheduler's, the Job controller's): what
    explains a Job, without the controller's own milestones."""
    return [e for e in events if (e.get("source") or {}).get("component") != COMPONENT
            and e.get("reportingComponent") != COMPONENT]


class JobEventRecorder:
    """Sends a run's Events about its Jobs (see the module docstring). kube: None records
    nothing (a dry run). sent / skipped / failed: counts, for tests and the log."""

    def __init__(self, kube: EventSink | None, *, host: str | None = None,
                 limit: int = MAX_EVENTS,
                 now: Callable[[], datetime.datetime] = _utcnow) -> None:
        self.kube = kube
        self.host = host or socket.gethostname() or COMPONENT
        self.limit = limit
        self._now = now
        self._seen: set[tuple[str, str, str]] = set()
        self._failures_in_a_row = 0
        self._off = kube is None
        self.sent = self.skipped = self.failed = 0

    def normal(self, job: Mapping[str, Any], reason: str, message: str) -> bool:
        return self.emit(job, "Normal", reason, message)

    def warning(self, job: Mapping[str, Any], reason: str, message: str) -> bool:
        return self.emit(job, "Warning", reason, message)

    def emit(self, job: Mapping[str, Any], type_: str, reason: str, message: str) -> bool:
        """Send one Event about `job`; False when it was not sent (a repeat, over the
        bound, events off after failures, or the create failed)."""
        meta = job.get("metadata") or {}
        name, namespace = meta.get("name"), meta.get("namespace")
        kube = self.kube
        if kube is None or self._off or not name or not namespace:
            return False
        text = event_message(message)
        key = (str(meta.get("uid") or name), reason, text)
        if key in self._seen:
            return False
        if len(self._seen) >= self.limit:
            if not self.skipped:
                log.info("job events: %d sent, the bound of a run: later ones are not sent "
                         "(the log has them)", self.limit)
            self.skipped += 1
            return False
        self._seen.add(key)
        body = build_event(job, type_=type_, reason=reason, message=text, host=self.host,
                           when=self._now(), serial=len(self._seen))
        started = time.monotonic()
        try:
            kube.create_event(str(namespace), body)
        except Exception as e:  # best effort: whatever went wrong, the run goes on
            self._failed(e, reason, time.monotonic() - started)
            return False
        self._failures_in_a_row = 0
        self.sent += 1
        return True

    def _failed(self, error: Exception, reason: str, took_s: float) -> None:
        self.failed += 1
        self._failures_in_a_row += 1
        denied = isinstance(error, KubeError) and error.status in (401, 403)
        if denied or self._failures_in_a_row >= FAILURES_BEFORE_GIVING_UP:
            self._off = True
        line = echo(f"{type(error).__name__}: {error}", limit=500)
        if self.failed == 1:
            log.warning("job events: cannot record a %s event on the sweep's Jobs (the run "
                        "goes on without them%s): %s", reason,
                        "; grant create on events" if denied else "", line)
        else:
            log.debug("job events: %s event not recorded after %.1f s: %s", reason, took_s,
                      line)
