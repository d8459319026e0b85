"""A Kubernetes API for tests: kmock's KubernetesEmulator over HTTP, plus a Job/Pod simulator.

No kube-apiserver can run on the development machines, so the controller's real
`kubernetes` client talks HTTP to `kmock.KubernetesEmulator` served by `kmock.Server` on an
asyncio loop in a background thread (`KubeSim`). kmock 0.8 stores objects, answers create
(409 on duplicates), get, list, watch, merge-patch and delete. `ClusterEmulator` adds what
the controller relies on and kmock leaves out:

- resourceVersion (one counter, like etcd's), uid, creationTimestamp, and the apiserver's
  Job defaulting (selector, controller-uid/job-name template labels);
- label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors on list and
  watch; list pages (limit/continue);
- watch from a resourceVersion with the server-side timeoutSeconds and a closing BOOKMARK;
  410 Gone (an ERROR event, as the apiserver sends it) for versions older than the event
  window or after `expire_watches()` / `compact()`;
- Background/Foreground deletion of a Job also deletes its pods (garbage collection);
- pods/log (text, tailLines) from logs set by the simulator;
- nodes (cluster-scoped) and SelfSubjectAccessReviews (allowed unless `forbid` denies the
  verb; never stored), for `esd-sweep doctor`;
- strict schema validation (kubernetes-validate, Kubernetes 1.31) of every created object
  and of every patched object: a bad object is a 422, as from a real apiserver;
- faults before any state change: a status for N requests (409, 410, 429, 500, 403, …),
  the API down for N seconds (connections dropped, or 503s);
- a `committed=True` fault uses kmock's own reaction DSL (`emulator[criteria] << payload`),
  for which kmock stores the write *before* answering with the error: "the create landed
  but the response was lost", after which a retry meets 409;
- GET /version reporting `server_version` (KubeSim(server_version="1.28.3")), and
  `per_index_backoff=False`: an apiserver with the JobBackoffLimitPerIndex gate off, which
  drops backoffLimitPerIndex, maxFailedIndexes and FailIndex rules from a created Job.

`JobSimulator` plays the Job controller and kubelet through the same HTTP API (bypassing
the faults): pods Pending (optionally unschedulable, with a FailedScheduling event) →
Running → Succeeded, or Failed with an exit code, OOMKilled, evicted/preempted
(DisruptionTarget), node lost, deadline exceeded; it applies the Job's podFailurePolicy and
backoffLimit the way the Job controller does, and can run on its own (`autopilot`).
Indexed Jobs (completionMode Indexed) are tests/support/indexed.py's IndexedJobSimulator's.

Use (one server per test: starting one takes ~10 ms):

    from tests.support.kubesim import JobSimulator, KubeSim

    @pytest.fixture
    def sim() -> Iterator[KubeSim]:
        with KubeSim() as server:            # or: pytest_plugins = ["tests.support.kubesim"] in the
            yield server                     # root conftest.py, then the `kube_sim` fixture

    def test_something(sim: KubeSim) -> None:
        kube = KubeClient(sim.configuration(), retry=RetryPolicy(base_s=0.001, max_s=0.01))
        cluster = JobSimulator(sim, namespace="esd")
        kube.create_job("esd", job)
        cluster.run(name); cluster.fail(name, 3, log="...")      # or cluster.step(name, "oom")
        with cluster.autopilot(lambda job: ["evict", "succeed"]):  # every Job, on its own
            ...run the controller...
        sim.fail("create", "jobs", status=500, times=3)            # faults, before any write
        sim.fail("create", "jobs", status=500, committed=True)     # the write lands, then 500
        sim.forbid("watch", "jobs")                                # RBAC-worded 403
        sim.api_down(2.0)                                          # connections dropped
        sim.compact(); sim.expire_watches()                        # 410 Gone
        sim.count("create", "jobs"); sim.objects("pods", "esd")    # what the client did / left

Benchmarks: `KubeSim(validate=False, keep_history=False, event_window=5000)` keeps memory
and time per request flat (about 1 ms per request either way).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import collections
import concurrent.futures
import contextlib
import copy
import datetime
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import jsonschema
import kmock
import pytest
import referencing
from kmock._internal import rendering
from kubernetes import client as k8s
from kubernetes_validate import utils as kv_utils

from controller.backends.kubernetes.common.jobs import min_kubernetes

# The oldest Kubernetes the Jobs are validated for (jobs.MIN_KUBERNETES: podFailurePolicy
# GA), and the newest whose strict schemas kubernetes-validate ships.
K8S_VERSION = f"{min_kubernetes()}.0"
NEWEST_K8S_VERSION = "1.37.0"
K8S_VERSIONS = (K8S_VERSION, NEWEST_K8S_VERSION)
BYPASS_HEADER = "X-Kubesim-Bypass"  # requests with it skip faults and downtime (the simulator)
MERGE_PATCH = "application/merge-patch+json"

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "batch/v1/jobs": kmock.ResourceInfo(
        kind="Job", singular="job", namespaced=True, subresources={"status"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod", singular="pod", namespaced=True, subresources={"status", "log"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    "v1/events": kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True,
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    # Kueue's CRD (served when Kueue is installed): a JobSimulator plays Kueue and writes them.
    "kueue.x-k8s.io/v1beta2/workloads": kmock.ResourceInfo(
        kind="Workload", singular="workload", namespaced=True, subresources={"status"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    # For `esd-sweep doctor` (the sweep itself reads no nodes and asks no reviews): nodes,
    # cluster-scoped, and SelfSubjectAccessReviews, answered from `forbid` and never stored.
    "v1/nodes": kmock.ResourceInfo(
        kind="Node", singular="node", namespaced=False, subresources={"status"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    # Secrets: the doctor reads the ones --hf-token-secret / --s3-secret name; the kubelet
    # (JobSimulator.start_container) resolves a pod's secretKeyRefs against them.
    "v1/secrets": kmock.ResourceInfo(
        kind="Secret", singular="secret", namespaced=True,
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    # The worker's PodTemplate (manifests/base/worker-image.yaml): --worker-template reads
    # the worker image from it.
    "v1/podtemplates": kmock.ResourceInfo(
        kind="PodTemplate", singular="podtemplate", namespaced=True,
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}),
    "authorization.k8s.io/v1/selfsubjectaccessreviews": kmock.ResourceInfo(
        kind="SelfSubjectAccessReview", singular="selfsubjectaccessreview", namespaced=False,
        verbs={"create"}),
}
_API_VERSION = {"jobs": "batch/v1", "pods": "v1", "events": "v1",
                "workloads": "kueue.x-k8s.io/v1beta2", "nodes": "v1",
                "selfsubjectaccessreviews": "authorization.k8s.io/v1", "secrets": "v1",
                "podtemplates": "v1"}
# Custom resources: kubernetes-validate has no schema for them (the CRD's own validation is
# Kueue's business), so the simulator stores them as written.
_UNVALIDATED_GROUPS = frozenset({"kueue.x-k8s.io"})


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- strict schema validation (kubernetes-validate's schemas, validators cached) -----------


class StrictValidator:
    """kubernetes_validate.validate(obj, version, strict=True), with the schemas loaded once.

    kubernetes-validate reads and parses the 1.3 MB definitions file on every call (~25 ms);
    the emulator validates every write, so it builds the same Draft 2020-12 validator from
    the same files once per kind.
    """

    def __init__(self, version: str = K8S_VERSION) -> None:
        self.version = version
        self._dir = f"kubernetes-json-schema/v{version}-local-strict"
        self._defs: Any = None
        self._validators: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def _validator(self, kind: str, api_version: str) -> Any:
        key = (kind, api_version)
        with self._lock:
            if key not in self._validators:
                if self._defs is None:
                    self._defs = kv_utils.schema_contents(
                        f"{self._dir}/_definitions.json", self.version)
                group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
                schema = kv_utils.schema_contents(
                    f"{self._dir}/{kind.lower()}-{group}.json", self.version)
                registry: Any = referencing.Registry()
                registry = referencing.Resource.from_contents(schema) @ registry
                registry = referencing.Resource.from_contents(self._defs) @ registry
                self._validators[key] = jsonschema.Draft202012Validator(
                    schema, registry=registry)
            return self._validators[key]

    def errors(self, obj: Mapping[str, Any]) -> list[str]:
        """Every schema violation of obj, as 'path: message' (empty: valid)."""
        validator = self._validator(str(obj.get("kind")), str(obj.get("apiVersion")))
        return [
            f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in validator.iter_errors(dict(obj))
        ]


# -- selectors -----------------------------------------------------------------------------

_SELECTOR_SPLIT = re.compile(r",(?![^()]*\))")
_SET_TERM = re.compile(r"\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*")


@dataclass(frozen=True)
class _Term:
    """One selector requirement: key, operator (in, notin, exists, !exists), values."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def holds(self, value: str | None) -> bool:
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op == "in":
            return value in self.values
        return value not in self.values


def _parse_selector(selector: str | None, *, fields: bool) -> list[_Term]:
    """Kubernetes label selector (=, ==, !=, in, notin, key, !key) or field selector
    (=, ==, != on dotted paths) terms; all must hold."""
    terms: list[_Term] = []
    for raw in _SELECTOR_SPLIT.split(selector or ""):
        term = raw.strip()
        if not term:
            continue
        set_match = None if fields else _SET_TERM.fullmatch(term)
        if set_match:
            values = frozenset(v.strip() for v in set_match[3].split(",") if v.strip())
            terms.append(_Term(set_match[1], set_match[2], values))
        elif "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(_Term(key.strip(), "notin", frozenset({value.strip()})))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append(_Term(key.strip(), "in", frozenset({value.strip()})))
        elif term.startswith("!"):
            terms.append(_Term(term[1:].strip(), "!exists"))
        else:
            terms.append(_Term(term, "exists"))
    return terms


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Selector:
    """Label and field selectors of a list or watch request."""

    labels: tuple[_Term, ...] = ()
    fields: tuple[_Term, ...] = ()

    @classmethod
    def parse(cls, labels: str | None, fields: str | None) -> Selector:
        return cls(tuple(_parse_selector(labels, fields=False)),
                   tuple(_parse_selector(fields, fields=True)))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(t.holds(labels.get(t.key)) for t in self.labels) and \
            all(t.holds(_field_value(obj, t.key)) for t in self.fields)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what kmock applies too): None deletes, dicts merge."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# -- faults --------------------------------------------------------------------------------


@dataclass
class Fault:
    """Answer `status` to the next `times` requests that match (None: until cleared)."""

    matches: Callable[[rendering.Request], bool]
    status: int
    reason: str
    message: str
    times: int | None
    retry_after_s: float | None = None
    hits: int = 0

    def error(self, request: rendering.Request) -> kmock.KubernetesError:
        details: dict[str, Any] = {}
        if request.resource is not None:
            details = {"kind": request.resource.plural, "group": request.resource.group or ""}
            if request.name:
                details["name"] = request.name
        if self.retry_after_s is not None:
            details["retryAfterSeconds"] = int(self.retry_after_s)
        return kmock.KubernetesError(status=self.status, reason=self.reason,
                                     message=self.message, details=details)


_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    409: "AlreadyExists", 410: "Expired", 422: "Invalid", 429: "TooManyRequests",
    500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "Timeout",
}


def _true(value: str | None) -> bool:
    return (value or "").lower() in ("1", "t", "true")


def _verb(request: rendering.Request) -> str:
    action = request.action
    names = {
        kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
        kmock.action.CREATE: "create", kmock.action.UPDATE: "patch",
        kmock.action.DELETE: "delete",
    }
    return names.get(action, str(request.method).lower()) if action is not None else ""


def request_matcher(
    verb: str | None = None, resource: str | None = None, *, name: str | None = None,
    namespace: str | None = None, subresource: str | None = None,
) -> Callable[[rendering.Request], bool]:
    """Match requests by verb (create/get/list/watch/patch/delete), resource plural
    (jobs, pods, events) or subresource ("pods/log", "jobs/status": like RBAC, "pods" does
    not cover "pods/log"), name and namespace."""
    if resource and "/" in resource:
        resource, subresource = resource.split("/", 1)

    def matches(request: rendering.Request) -> bool:
        if verb is not None and _verb(request) != verb:
            return False
        if resource is not None and (request.resource is None
                                     or request.resource.plural != resource
                                     or request.subresource != subresource):
            return False
        if name is not None and request.name != name:
            return False
        return namespace is None or request.namespace == namespace

    return matches


# -- the emulator --------------------------------------------------------------------------


@dataclass
class _Logged:
    seq: int
    rv: int
    resource: str
    event: dict[str, Any]


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator plus resourceVersions, selectors, watch semantics, GC,
    pod logs, schema validation and faults (see the module docstring)."""

    validate: bool = True
    k8s_version: str = K8S_VERSION
    event_window: int | None = 10_000  # watch events kept (None: all); older → 410 Gone
    keep_history: bool = True  # kmock keeps every version of every object; off for benchmarks
    keep_requests: bool = False  # kmock's request log (its DSL assertions); slow when long
    server_version: str = K8S_VERSION  # what GET /version reports ("1.29.4-eks-036c24b" too)
    # False: the JobBackoffLimitPerIndex feature gate is off, as on apiservers before 1.29
    # (alpha in 1.28): create silently drops backoffLimitPerIndex, maxFailedIndexes and
    # FailIndex rules (the registry's PrepareForCreate), so only a read-back shows it.
    per_index_backoff: bool = True

    _rv: int = attrs.field(default=0, init=False)
    _seq: int = attrs.field(default=0, init=False)
    _log: list[_Logged] = attrs.field(factory=list, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watch_epoch: int = attrs.field(default=0, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _write_lock: asyncio.Lock | None = attrs.field(default=None, init=False)
    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _faults_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _down_until: float = attrs.field(default=0.0, init=False)
    _down_mode: str = attrs.field(default="reset", init=False)
    _pod_logs: dict[tuple[str, str], str] = attrs.field(factory=dict, init=False)
    # (verb, resource[/subresource], namespace) that `forbid` denies: what a
    # SelfSubjectAccessReview answers "not allowed" to.
    denied: set[tuple[str, str, str | None]] = attrs.field(factory=set, init=False)
    _pods_by_owner: dict[str, set[Any]] = attrs.field(factory=dict, init=False)
    _by_resource: dict[str, set[Any]] = attrs.field(factory=dict, init=False)
    _by_label: dict[tuple[str, str, str], set[Any]] = attrs.field(factory=dict, init=False)
    _indexed: dict[Any, tuple[tuple[str, str], ...]] = attrs.field(factory=dict, init=False)
    validator: StrictValidator = attrs.field(init=False)
    validated: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    counts: collections.Counter[tuple[str, str]] = attrs.field(
        factory=collections.Counter, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.validator = StrictValidator(self.k8s_version)
        for key, info in RESOURCES.items():
            self.resources[key] = copy.deepcopy(info)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        response = await super()._render_error(exc)
        details = exc.details if isinstance(exc, kmock.KubernetesError) else None
        if isinstance(details, dict) and "retryAfterSeconds" in details:
            response.headers["Retry-After"] = str(details["retryAfterSeconds"])
        return response

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        """GET /version as the apiserver answers (kmock's own says 1.26): managed clusters
        report a minor like "29+" and a gitVersion with their suffix (v1.29.4-eks-036c24b)."""
        match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(.*)", self.server_version)
        if match is None:
            raise ValueError(f"server_version {self.server_version!r} is not MAJOR.MINOR[.PATCH]")
        major, minor, patch, suffix = match.groups()
        return {
            "major": major, "minor": minor + ("+" if suffix else ""),
            "gitVersion": f"v{major}.{minor}.{patch or 0}{suffix}",
            "gitCommit": "9edcffcde5595e8a5b1a35f88c421764e575afce", "gitTreeState": "clean",
            "buildDate": "2024-08-13T07:28:49Z", "goVersion": "go1.22.5", "compiler": "gc",
            "platform": "linux/amd64",
        }

    async def close_watches(self) -> None:
        """End every open watch (the server is stopping; aiohttp waits for its handlers)."""
        self._closing = True
        async with self._cond():
            self._cond().notify_all()

    # -- state helpers (call in the loop) --

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _wlock(self) -> asyncio.Lock:
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        return self._write_lock

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _live(self, resource: kmock.resource, namespace: str | None, name: str) -> Any:
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    async def _append(self, resource: str, kind: str, obj: Mapping[str, Any]) -> None:
        rv = int((obj.get("metadata") or {}).get("resourceVersion") or self._rv)
        self._seq += 1
        self._log.append(_Logged(self._seq, rv, resource, {"type": kind, "object": dict(obj)}))
        if self.event_window is not None and len(self._log) > self.event_window:
            dropped = self._log[: len(self._log) - self.event_window]
            del self._log[: len(dropped)]
            self._compacted_rv = max(self._compacted_rv, dropped[-1].rv)
        async with self._cond():
            self._cond().notify_all()

    def _trim(self, key: Any) -> None:
        if self.keep_history or key not in self.objects:
            return
        obj = self.objects[key]
        if obj.deleted:
            del self.objects[key]
        else:
            del obj.history[:-1]

    # -- request entry --

    def _fault_for(self, request: rendering.Request) -> Fault | None:
        with self._faults_lock:
            for fault in self._faults:
                if fault.matches(request):
                    fault.hits += 1
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._faults.remove(fault)
                    return fault
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        try:
            return await self._handle_one(request)
        finally:
            # kmock keeps every request and checks each reaction's filter against all of
            # them on every request (quadratic: 25 ms per request after a few hundred).
            # Only requests still being served are kept; count with KubeSim.count().
            if not self.keep_requests:
                with contextlib.suppress(ValueError):
                    self._requests.remove(request)

    async def _handle_one(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # The Python client sends watch=True; the apiserver parses it like Go's ParseBool,
        # kmock 0.8 only recognises "true".
        if request.resource is not None and request.method == kmock.method.GET and \
                _true(request.params.get("watch")) and request.action != kmock.action.WATCH:
            object.__setattr__(request, "action", kmock.action.WATCH)
        bypass = any(k.lower() == BYPASS_HEADER.lower() for k in request.headers)
        if not bypass:
            plural = request.resource.plural if request.resource is not None else None
            sub = f"/{request.subresource}" if request.subresource else ""
            self.counts[(_verb(request), f"{plural}{sub}")] += 1
            if time.monotonic() < self._down_until:
                if self._down_mode == "503":
                    raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                                message="the API server is down (kubesim)")
                raw = request._raw_request
                if raw is not None and raw.transport is not None:
                    raw.transport.abort()
                return aiohttp.web.Response(status=503)
            fault = self._fault_for(request)
            if fault is not None:
                raise fault.error(request)
        if request.resource is None and request.method == kmock.method.GET and \
                request.url.path == "/version/":  # kubernetes.client.VersionApi's path
            return aiohttp.web.json_response(await self._serve_server_version(request))
        if request.resource is None:
            return await super()._handle(request)
        if request.resource.plural == "selfsubjectaccessreviews":
            return aiohttp.web.json_response(self._review(request), status=201)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
            async with self._wlock():
                return await self._mutate(request)
        if request.action == kmock.action.FETCH and request.subresource == "log":
            return self._serve_log(request)
        return await super()._handle(request)

    def _review(self, request: rendering.Request) -> dict[str, Any]:
        """A SelfSubjectAccessReview as the apiserver answers it: the request's spec and
        status.allowed, false for what `forbid` denies (not stored, like the real one)."""
        review = request.data if isinstance(request.data, dict) else {}
        spec = review.get("spec") or {}
        attrs_ = spec.get("resourceAttributes") or {}
        what = str(attrs_.get("resource") or "")
        if attrs_.get("subresource"):
            what += f"/{attrs_['subresource']}"
        key = (str(attrs_.get("verb") or ""), what, attrs_.get("namespace") or None)
        status: dict[str, Any] = {"allowed": key not in self.denied}
        if not status["allowed"]:
            status["reason"] = "kubesim: denied by forbid()"
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}

    async def _mutate(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """One write, serialised: stamp, validate, let kmock store it, log the watch event."""
        resource = request.resource
        assert resource is not None and resource.plural is not None
        plural = resource.plural
        data = request.data
        if request.action == kmock.action.CREATE:
            if not isinstance(data, dict):
                raise kmock.KubernetesError(status=400, reason="BadRequest",
                                            message="the body is not a JSON object")
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            name, namespace = meta.get("name"), request.namespace or meta.get("namespace")
            if not name:
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message="metadata.name: Required value")
            if self._live(resource, namespace, name) is not None:
                qualified = f"{plural}.{resource.group}" if resource.group else plural
                raise kmock.KubernetesError(
                    status=409, reason="AlreadyExists",
                    message=f'{qualified} "{name}" already exists',
                    details={"name": name, "group": resource.group, "kind": plural})
            self._check_schema(data, verb="create")
            rv = self._next_rv()
            meta.update({
                "namespace": namespace, "uid": str(uuid.uuid4()),
                "resourceVersion": str(rv), "creationTimestamp": now_rfc3339(),
                "generation": 1,
            })
            self._default(plural, data)
            key = (resource, namespace, name)
            kind = "ADDED"
        else:
            key = (resource, request.namespace, request.name)
            current = self._live(resource, request.namespace, str(request.name))
            if current is None:
                qualified = f"{plural}.{resource.group}" if resource.group else plural
                raise kmock.KubernetesError(status=404, reason="NotFound",
                                            message=f'{qualified} "{request.name}" not found')
            rv = self._next_rv()
            if request.action == kmock.action.UPDATE:
                if not isinstance(data, dict):
                    raise kmock.KubernetesError(
                        status=415, reason="UnsupportedMediaType",
                        message="kubesim takes merge patches (a JSON object) only")
                merged = merge_patch(current.raw, data)
                self._check_schema(merged, verb="patch")
                data.setdefault("metadata", {})["resourceVersion"] = str(rv)
                kind = "MODIFIED"
            else:
                current.patch({"metadata": {"resourceVersion": str(rv)}})
                kind = "DELETED"
        try:
            return await super()._handle(request)
        finally:
            await self._after_write(request, key, kind, rv)

    async def _after_write(self, request: rendering.Request, key: Any, kind: str,
                           rv: int) -> None:
        resource = key[0]
        if key not in self.objects:
            return
        obj = self.objects[key]
        if obj.empty:
            return
        last = obj.last.raw
        if str((last.get("metadata") or {}).get("resourceVersion")) != str(rv):
            return  # kmock did not store it (an error before the write)
        if kind == "DELETED" and not obj.deleted:
            kind = "MODIFIED"  # finalizers: only marked for deletion
        await self._append(resource.plural, kind, last)
        self._index(key, None if kind == "DELETED" else last)
        self._trim(key)
        if kind == "ADDED" and resource.plural == "pods":
            for owner in (last.get("metadata") or {}).get("ownerReferences") or []:
                self._pods_by_owner.setdefault(str(owner.get("uid")), set()).add(key)
        if kind == "DELETED" and resource.plural == "jobs":
            # batch/v1 Jobs orphan their pods unless the delete asks otherwise (API default).
            policy = (request.data or {}).get("propagationPolicy") if isinstance(
                request.data, dict) else None
            if policy in ("Background", "Foreground"):
                await self._collect_pods(last)

    async def _collect_pods(self, job: Mapping[str, Any]) -> None:
        """Garbage collection: a Job deleted with Background/Foreground propagation takes
        its pods along."""
        uid = str((job.get("metadata") or {}).get("uid"))
        for key in sorted(self._pods_by_owner.pop(uid, set()), key=lambda k: k[2]):
            if key not in self.objects or self.objects[key].deleted:
                continue
            obj = self.objects[key]
            obj.patch({"metadata": {"resourceVersion": str(self._next_rv())}})
            raw = obj.last.raw
            obj.delete()
            await self._append("pods", "DELETED", raw)
            self._index(key, None)
            self._trim(key)

    def _check_schema(self, obj: Mapping[str, Any], *, verb: str) -> None:
        if not self.validate or str(obj.get("apiVersion")).split("/")[0] in _UNVALIDATED_GROUPS:
            return
        errors = self.validator.errors(obj)
        kind = str(obj.get("kind"))
        if errors:
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f"{kind} fails the strict Kubernetes {self.k8s_version} schema on "
                        f"{verb}: " + "; ".join(errors[:10]))
        self.validated[kind] += 1

    def _default(self, plural: str, data: dict[str, Any]) -> None:
        """What the apiserver adds to a new Job or Pod (the parts the controller reads)."""
        meta = data["metadata"]
        if plural == "jobs":
            spec = data.setdefault("spec", {})
            for k, v in (("completions", 1), ("parallelism", 1),
                         ("completionMode", "NonIndexed"), ("suspend", False)):
                spec.setdefault(k, v)
            if not self.per_index_backoff:
                spec.pop("backoffLimitPerIndex", None)
                spec.pop("maxFailedIndexes", None)
                policy = spec.get("podFailurePolicy") or {}
                if "rules" in policy:
                    policy["rules"] = [r for r in policy["rules"] if r.get("action") != "FailIndex"]
            spec.setdefault("backoffLimit",
                            2**31 - 1 if spec.get("backoffLimitPerIndex") is not None else 6)
            spec.setdefault("podReplacementPolicy",
                            "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
            uid, name = meta["uid"], meta["name"]
            spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            template_meta = spec.setdefault("template", {}).setdefault("metadata", {})
            template_meta.setdefault("labels", {}).update({
                "batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": name,
                "controller-uid": uid, "job-name": name,
            })
            data["status"] = {}
        elif plural == "pods":
            data["status"] = {"phase": "Pending"}

    # -- reads --

    def reindex(self) -> None:
        """Rebuild the list index from `objects` (after writing objects there directly)."""
        self._by_resource.clear()
        self._by_label.clear()
        self._indexed.clear()
        for key, obj in list(self.objects.items()):
            self._index(key, None if obj.deleted else obj.last.raw)

    def _index(self, key: Any, raw: Mapping[str, Any] | None) -> None:
        """Keep the list index (resource → keys, (resource, label, value) → keys) current."""
        plural = str(key[0].plural)
        for label in self._indexed.pop(key, ()):
            self._by_label.get((plural, *label), set()).discard(key)
        self._by_resource.setdefault(plural, set()).discard(key)
        if raw is None:
            return
        labels = tuple(((raw.get("metadata") or {}).get("labels") or {}).items())
        self._indexed[key] = labels
        self._by_resource[plural].add(key)
        for label in labels:
            self._by_label.setdefault((plural, *label), set()).add(key)

    def _matching(self, request: rendering.Request) -> list[dict[str, Any]]:
        selector = Selector.parse(request.params.get("labelSelector"),
                                  request.params.get("fieldSelector"))
        plural = str(request.resource.plural if request.resource is not None else "")
        candidates = self._by_resource.get(plural, set())
        for term in selector.labels:  # narrow by the label index (exact matches)
            if term.op == "in" and len(term.values) == 1:
                (value,) = term.values
                candidates = candidates & self._by_label.get((plural, term.key, value), set())
        out = []
        for key in candidates:
            resource, namespace, name = key
            if key not in self.objects:
                continue
            obj = self.objects[key]
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            raw = obj.last.raw
            if selector.matches(raw):
                out.append(raw)
        out.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return out

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource is None or request.resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        info = self.resources[request.resource]
        items = self._matching(request)
        version = self._rv
        offset = 0
        token = request.params.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                version, offset = int(state["rv"]), int(state["offset"])
            except (ValueError, KeyError, TypeError) as e:
                raise kmock.KubernetesError(status=400, reason="BadRequest",
                                            message=f"invalid continue token: {e}") from e
            if version < self._compacted_rv:
                raise kmock.KubernetesError(
                    status=410, reason="Expired",
                    message="The provided continue parameter is too old to display a "
                            "consistent list result. You can start a new list without the "
                            "continue parameter.")
        limit = int(request.params.get("limit") or 0)
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        page = items[offset:]
        if limit and len(page) > limit:
            page = page[:limit]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"rv": version, "offset": offset + limit}).encode()).decode()
            meta["remainingItemCount"] = len(items) - offset - limit
        api_version = _API_VERSION.get(str(request.resource.plural), "v1")
        return {"apiVersion": api_version, "kind": f"{info.kind}List", "metadata": meta,
                "items": page}

    # kmock's own fetch/create/update/delete answers scan every stored object (linear per
    # request); these look the object up by its key.

    def _stored(self, request: rendering.Request) -> Any:
        data = request.data if isinstance(request.data, dict) else {}
        meta = data.get("metadata") or {}
        assert request.resource is not None
        key = (request.resource, request.namespace or meta.get("namespace"),
               str(request.name or meta.get("name")))
        if key not in self.objects or self.objects[key].empty:
            raise kmock.KubernetesObjectNotFoundError()
        return self.objects[key]

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        obj = self._stored(request)
        if obj.deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f'"{request.name}" not found')
        raw: dict[str, Any] = obj.raw
        return raw

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        raw: dict[str, Any] = self._stored(request).last.raw
        return raw

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        raw: dict[str, Any] = self._stored(request).last.raw
        return raw

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        raw: dict[str, Any] = self._stored(request).last.raw
        return raw

    def _serve_log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        pod = self._live(request.resource, request.namespace, str(request.name))
        if pod is None:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f'pods "{request.name}" not found')
        statuses = (pod.last.raw.get("status") or {}).get("containerStatuses") or []
        if not any({"running", "terminated"} & set(cs.get("state") or {}) for cs in statuses):
            raise kmock.KubernetesError(
                status=400, reason="BadRequest",
                message=f'container "worker" in pod "{request.name}" is waiting to start: '
                        "ContainerCreating")
        text = self._pod_logs.get((str(request.namespace), str(request.name)), "")
        tail = request.params.get("tailLines")
        if tail:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail):]) if int(tail) > 0 else ""
        return aiohttp.web.Response(body=text.encode("utf-8"), content_type="text/plain")

    async def _serve_watch(self, request: rendering.Request) -> Any:
        yield b""  # send the headers now: the client waits for them
        params = request.params
        selector = Selector.parse(params.get("labelSelector"), params.get("fieldSelector"))
        plural = request.resource.plural if request.resource is not None else None
        timeout = float(params.get("timeoutSeconds") or 1800)
        deadline = asyncio.get_running_loop().time() + timeout
        epoch = self._watch_epoch
        since = params.get("resourceVersion") or "0"

        def wanted(entry: _Logged) -> bool:
            obj = entry.event["object"]
            meta = obj.get("metadata") or {}
            if entry.resource != plural:
                return False
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                return False
            if request.name is not None and meta.get("name") != request.name:
                return False
            return selector.matches(obj)

        def gone(rv: int | str) -> dict[str, Any]:
            return {"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": 410, "reason": "Expired",
                "message": f"too old resource version: {rv} ({self._compacted_rv + 1})"}}

        if since == "0":
            for obj in self._matching(request):
                yield {"type": "ADDED", "object": obj}
            cursor = self._seq + 1
        else:
            try:
                start_rv = int(since)
            except ValueError:
                yield gone(since)
                return
            if start_rv < self._compacted_rv:
                yield gone(start_rv)
                return
            index = bisect.bisect_right([e.rv for e in self._log], start_rv)
            cursor = self._log[index].seq if index < len(self._log) else self._seq + 1
        last_rv = self._rv
        while True:
            if self._closing:
                return
            if self._watch_epoch != epoch:
                yield gone(last_rv)
                return
            if time.monotonic() < self._down_until and not any(
                    k.lower() == BYPASS_HEADER.lower() for k in request.headers):
                raw = request._raw_request
                if raw is not None and raw.transport is not None:
                    raw.transport.abort()
                return
            first = self._log[0].seq if self._log else self._seq + 1
            if cursor < first:
                yield gone(last_rv)  # the watcher fell out of the event window
                return
            pending = self._log[cursor - first:] if self._log else []
            for entry in pending:
                cursor = entry.seq + 1
                if wanted(entry):
                    last_rv = entry.rv
                    yield entry.event
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                if _true(params.get("allowWatchBookmarks")) and request.resource:
                    # Lets a watcher whose selector saw nothing move past compactions.
                    yield {"type": "BOOKMARK", "object": {
                        "apiVersion": _API_VERSION.get(str(plural), "v1"),
                        "kind": self.resources[request.resource].kind,
                        "metadata": {"resourceVersion": str(self._rv)}}}
                return
            async with self._cond():
                if self._log and self._log[-1].seq >= cursor:
                    continue
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._cond().wait(), timeout=min(remaining, 0.2))


# -- the harness ---------------------------------------------------------------------------


class KubeSim:
    """A ClusterEmulator served over HTTP from a background thread, for synchronous tests.

    `configuration()` gives a kubernetes.client.Configuration pointing at it. Faults,
    downtime and logs are set from the test thread; `call()` runs a function on the
    emulator's loop (for consistent reads of `emulator.objects`).
    """

    def __init__(self, **emulator_options: Any) -> None:
        self._options = emulator_options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kubesim", daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: ClusterEmulator
        self.url = ""

    # -- lifecycle --

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced in start()
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with ClusterEmulator(**self._options) as emulator, kmock.Server(emulator) as srv:
            self.emulator = emulator
            self.url = str(srv.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()
            await emulator.close_watches()

    def start(self) -> KubeSim:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self.url:
            raise RuntimeError(f"kubesim did not start: {self._error!r}")
        return self

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self) -> KubeSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the emulator's loop; its result (awaited if it is a coroutine)."""
        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            run(), self._loop)
        return future.result(10)

    # -- clients --

    def configuration(self) -> k8s.Configuration:
        """A fresh client Configuration for this server (plain HTTP, no auth)."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return cfg

    def api_client(self, *, bypass: bool = False) -> k8s.ApiClient:
        """A kubernetes ApiClient for this server; bypass=True skips faults and downtime."""
        api = k8s.ApiClient(self.configuration())
        if bypass:
            api.set_default_header(BYPASS_HEADER, "1")
        return api

    # -- faults --

    def fail(
        self, verb: str | None = None, resource: str | None = None, *, status: int = 500,
        times: int | None = 1, name: str | None = None, namespace: str | None = None,
        message: str | None = None, reason: str | None = None,
        retry_after_s: float | None = None, committed: bool = False,
        match: Callable[[rendering.Request], bool] | None = None,
    ) -> Fault:
        """Answer `status` to the next `times` matching requests (times=None: until clear).

        verb: create/get/list/watch/patch/delete; resource: jobs, pods, events, pods/log.
        By default nothing is stored. committed=True (writes): kmock stores the write, then
        the client gets the error (lost response; a retry meets 409).
        """
        matches = match or request_matcher(verb, resource, name=name, namespace=namespace)
        fault = Fault(matches=matches, status=status,
                      reason=reason or _REASONS.get(status, "InternalError"),
                      message=message or f"kubesim: injected {status}", times=times,
                      retry_after_s=retry_after_s)
        if committed:
            self.call(lambda: self._react(fault))
        else:
            with self.emulator._faults_lock:
                self.emulator._faults.append(fault)
        return fault

    def _react(self, fault: Fault) -> None:
        """The fault as a kmock reaction: kmock has already stored a write when it runs."""
        lock = threading.Lock()

        def respond(request: rendering.Request) -> Any:
            with lock:
                if fault.times is not None and fault.hits >= fault.times:
                    return NotImplemented  # kmock disables the reaction: served normally
                fault.hits += 1
            raise fault.error(request)

        def bypassed(request: rendering.Request) -> bool:
            return any(k.lower() == BYPASS_HEADER.lower() for k in request.headers)

        view = self.emulator[lambda request: fault.matches(request) and not bypassed(request)]
        view << respond

    def forbid(self, verb: str, resource: str, *, namespace: str = "esd",
               subject: str = "system:serviceaccount:esd:esd-sweep") -> Fault:
        """403 for verb on resource, worded like the apiserver's RBAC denial."""
        plural, _, sub = resource.partition("/")
        group = _API_VERSION.get(plural, "v1").rpartition("/")[0]
        what = f'{plural}/{sub}' if sub else plural
        message = (f'{plural}{"." + group if group else ""} is forbidden: User "{subject}" '
                   f'cannot {verb} resource "{what}" in API group "{group}" in the '
                   f'namespace "{namespace}"')
        self.emulator.denied.add((verb, what, namespace))
        return self.fail(verb, resource, status=403, times=None, message=message,
                         namespace=namespace)

    def clear_faults(self) -> None:
        """Drop the pending faults (not committed=True ones: they run out by `times`)."""
        with self.emulator._faults_lock:
            self.emulator._faults.clear()
            self.emulator.denied.clear()

    def api_down(self, seconds: float, *, mode: str = "reset") -> None:
        """The API is unreachable for `seconds`: connections dropped without an answer
        (mode "reset", also ending open watches) or 503 Service Unavailable (mode "503")."""
        self.emulator._down_mode = mode
        self.emulator._down_until = time.monotonic() + seconds

    def expire_watches(self) -> None:
        """Open watches get 410 Gone now (as when the apiserver's watch cache moves on)."""
        async def bump() -> None:
            self.emulator._watch_epoch += 1
            async with self.emulator._cond():
                self.emulator._cond().notify_all()
        self.call(bump)

    def compact(self) -> None:
        """Forget every watch event so far (etcd compaction): older versions → 410 Gone."""
        def run() -> None:
            em = self.emulator
            em._compacted_rv = em._rv
            em._log.clear()
        self.call(run)

    # -- state --

    def set_log(self, namespace: str, pod: str, text: str) -> None:
        self.emulator._pod_logs[(namespace, pod)] = text

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Live objects of a resource (jobs, pods, events), as stored, sorted by name."""
        def snapshot() -> list[dict[str, Any]]:
            out = []
            for (res, ns, _name), obj in self.emulator.objects.items():
                if res.plural == resource and not obj.deleted and namespace in (None, ns):
                    out.append(copy.deepcopy(obj.last.raw))
            return sorted(out, key=lambda o: o["metadata"]["name"])
        result: list[dict[str, Any]] = self.call(snapshot)
        return result

    def count(self, verb: str, resource: str) -> int:
        """Requests the clients under test sent (not the simulator's) for verb on resource,
        e.g. count("create", "jobs"), count("get", "pods/log")."""
        return int(self.emulator.counts[(verb, resource)])


@pytest.fixture()
def kube_sim() -> Iterator[KubeSim]:
    """A running KubeSim (validating every write against Kubernetes 1.31's strict schemas)."""
    with KubeSim() as sim:
        yield sim


# -- the Job controller and kubelet, played through the API ---------------------------------

_TERMINAL = ("Complete", "Failed")


def _condition(kind: str, reason: str, message: str = "", status: str = "True") -> dict[str, Any]:
    now = now_rfc3339()
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastProbeTime": now, "lastTransitionTime": now}


condition = _condition


def pod_running_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The kubelet's status of a pod whose (first) container started and is ready."""
    now = now_rfc3339()
    container = pod["spec"]["containers"][0]
    return {
        "phase": "Running", "startTime": now, "hostIP": "10.0.0.7", "podIP": "10.1.0.7",
        "conditions": [_condition("PodScheduled", ""), _condition("Ready", "")],
        "containerStatuses": [{
            "name": container["name"], "ready": True, "restartCount": 0, "started": True,
            "image": container["image"], "imageID": "", "state": {"running": {"startedAt": now}}}],
    }


def pod_terminated_status(
    pod: Mapping[str, Any], *, exit_code: int, reason: str, message: str, phase: str,
    conditions: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The kubelet's status of a pod whose container exited (phase Succeeded or Failed);
    message: the termination message (FallbackToLogsOnError: the log's last lines)."""
    now = now_rfc3339()
    container = pod["spec"]["containers"][0]
    terminated: dict[str, Any] = {"exitCode": exit_code, "reason": reason,
                                  "startedAt": now, "finishedAt": now}
    if message:
        terminated["message"] = message
    return {
        "phase": phase,
        "conditions": [_condition("PodScheduled", ""),
                       _condition("Ready", "PodCompleted", status="False"),
                       *[dict(c) for c in conditions]],
        "containerStatuses": [{
            "name": container["name"], "ready": False, "restartCount": 0, "started": False,
            "image": container["image"], "imageID": "", "state": {"terminated": terminated}}],
    }


# A pod's fault: (exit code, container termination reason, pod conditions (type, reason,
# message, status)) as the kubelet, the eviction API, the scheduler and PodGC leave them.
POD_FAULTS: dict[str, tuple[int, str, tuple[tuple[str, str, str, str], ...]]] = {
    # the container hits its memory limit (counted against backoffLimit)
    "oom": (137, "OOMKilled", ()),
    # eviction / drain / spot reclaim: DisruptionTarget, then SIGTERM
    "evict": (143, "Error", (
        ("DisruptionTarget", "EvictionByEvictionAPI", "Eviction API: evicting", "True"),)),
    "preempt": (143, "Error", (
        ("DisruptionTarget", "PreemptionByScheduler", "Preempted by a higher priority pod",
         "True"),)),
    # the node stops reporting: the taint manager evicts, PodGC fails the pod
    "node_lost": (137, "ContainerStatusUnknown", (
        ("DisruptionTarget", "DeletionByTaintManager",
         "Taint manager: deleting due to NoExecute taint", "True"),
        ("Ready", "NodeLost", "", "Unknown"))),
}


def fault_conditions(fault: str) -> list[dict[str, Any]]:
    """The pod conditions of a POD_FAULTS entry, timestamped now."""
    return [_condition(kind, reason, message, status=status)
            for kind, reason, message, status in POD_FAULTS[fault][2]]


def job_finished(job: Mapping[str, Any]) -> str | None:
    """"Complete" or "Failed" when the Job has that condition True, else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in _TERMINAL and cond.get("status") == "True":
            return str(cond["type"])
    return None


def failure_policy_action(job: Mapping[str, Any], pod: Mapping[str, Any]) -> tuple[str, int | None]:
    """(action, rule index) the Job's podFailurePolicy takes for a failed pod, as the Job
    controller evaluates it: rules in order, first match; no match → ("Count", None)."""
    rules = ((job.get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []
    status = pod.get("status") or {}
    for index, rule in enumerate(rules):
        on_codes = rule.get("onExitCodes")
        if on_codes:
            name = on_codes.get("containerName")
            codes = [
                ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")
                for cs in status.get("containerStatuses") or []
                if name in (None, cs.get("name"))
            ]
            codes = [c for c in codes if c not in (None, 0)]
            values = set(on_codes.get("values") or [])
            hit = any((c in values) if on_codes.get("operator") == "In" else (c not in values)
                      for c in codes)
            if hit:
                return str(rule["action"]), index
        for pattern in rule.get("onPodConditions") or []:
            for cond in status.get("conditions") or []:
                if cond.get("type") == pattern.get("type") and \
                        cond.get("status") == pattern.get("status", "True"):
                    return str(rule["action"]), index
    return "Count", None


def fail_job_message(job: Mapping[str, Any], pod: Mapping[str, Any], rule: int) -> str:
    """The Job controller's message for a pod that matched a FailJob rule."""
    pod_ref = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
    on_conditions = job["spec"]["podFailurePolicy"]["rules"][rule].get("onPodConditions")
    if on_conditions:
        kinds = {c["type"] for c in on_conditions}
        kind = next(c["type"] for c in pod["status"]["conditions"] if c["type"] in kinds)
        return f"Pod {pod_ref} has condition {kind} matching FailJob rule at index {rule}"
    (status,) = pod["status"]["containerStatuses"]
    code = status["state"]["terminated"]["exitCode"]
    return (f"Container {status['name']} for pod {pod_ref} failed with exit code {code} "
            f"matching FailJob rule at index {rule}")


@dataclass
class _Auto:
    script: list[Any]
    step: int = 0


@dataclass
class JobSimulator:
    """Moves Jobs and their pods through phases by writing through the API (bypassing faults).

    Each call acts on the Job's current pod (creating it if there is none), patches pod and
    Job status the way the kubelet and the Job controller would, and returns the Job as it
    is afterwards. Outcomes of a failed pod follow the Job's podFailurePolicy and
    backoffLimit: a replacement pod (Pending) or a Failed Job.
    """

    sim: KubeSim
    namespace: str = "esd"
    node: str = "gpu-node-0"
    _api: k8s.ApiClient = field(init=False)
    _auto_stop: threading.Event | None = field(default=None, init=False)
    _auto_thread: threading.Thread | None = field(default=None, init=False)
    _auto_error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._api = self.sim.api_client(bypass=True)
        self._batch = k8s.BatchV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        self._custom = k8s.CustomObjectsApi(self._api)

    # -- API plumbing --

    @staticmethod
    def _doc(resp: Any) -> Any:
        try:
            return json.loads(resp.data or b"null")
        finally:
            resp.release_conn()

    def job(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = self._doc(self._batch.read_namespaced_job(
            name, self.namespace, _preload_content=False))
        return doc

    def jobs(self) -> list[dict[str, Any]]:
        doc = self._doc(self._batch.list_namespaced_job(self.namespace, _preload_content=False))
        items: list[dict[str, Any]] = doc["items"]
        return items

    def pods(self, job_name: str) -> list[dict[str, Any]]:
        doc = self._doc(self._core.list_namespaced_pod(
            self.namespace, label_selector=f"batch.kubernetes.io/job-name={job_name}",
            _preload_content=False))
        items: list[dict[str, Any]] = doc["items"]
        return sorted(items, key=lambda p: p["metadata"]["creationTimestamp"] + p["metadata"]
                      ["resourceVersion"].zfill(12))

    def _patch_job(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        doc: dict[str, Any] = self._doc(self._batch.patch_namespaced_job_status(
            name, self.namespace, {"status": dict(status)}, _preload_content=False,
            _content_type=MERGE_PATCH))
        return doc

    def _patch_pod(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        doc: dict[str, Any] = self._doc(self._core.patch_namespaced_pod_status(
            name, self.namespace, {"status": dict(status)}, _preload_content=False,
            _content_type=MERGE_PATCH))
        return doc

    # -- phases --

    def queue_workload(self, name: str, conditions: Sequence[Mapping[str, Any]] = (),
                       *, queue: str = "esd-sweep") -> dict[str, Any]:
        """Kueue makes the Workload of a suspended Job (owned by it, labelled with its uid)
        and reports on it: conditions such as _condition("QuotaReserved", "Pending",
        "couldn't assign flavors ...", status="False")."""
        job = self.job(name)
        uid = job["metadata"]["uid"]
        body = {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {
                "name": f"job-{name}"[:240] + f"-{uid[:5]}", "namespace": self.namespace,
                "labels": {"kueue.x-k8s.io/job-uid": uid},
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                     "uid": uid, "controller": True,
                                     "blockOwnerDeletion": True}]},
            "spec": {"queueName": queue, "podSets": [{"name": "main", "count": 1}]},
            "status": {"conditions": [dict(c) for c in conditions]},
        }
        doc: dict[str, Any] = self._doc(self._custom.create_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", self.namespace, "workloads", body,
            _preload_content=False))
        return doc

    def admit(self, name: str, *, parallelism: int | None = None) -> dict[str, Any]:
        """Kueue admits a suspended Job (spec.suspend → false); parallelism: the pods it
        admitted, when partial admission gave it fewer than it asked for."""
        spec: dict[str, Any] = {"suspend": False}
        if parallelism is not None:
            spec["parallelism"] = parallelism
        doc: dict[str, Any] = self._doc(self._batch.patch_namespaced_job(
            name, self.namespace, {"spec": spec}, _preload_content=False,
            _content_type=MERGE_PATCH))
        return doc

    def _active_pod(self, name: str) -> dict[str, Any] | None:
        for pod in reversed(self.pods(name)):
            if (pod.get("status") or {}).get("phase") in ("Pending", "Running"):
                return pod
        return None

    def start(self, name: str, *, unschedulable: str | None = None) -> dict[str, Any]:
        """The Job controller creates a pod (Pending). unschedulable: the scheduler's
        message (e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."): the pod
        gets PodScheduled=False/Unschedulable and a FailedScheduling event."""
        job = self.job(name)
        if job["spec"].get("suspend"):
            raise RuntimeError(f"job {name} is suspended (Kueue has not admitted it)")
        pod = self._active_pod(name)
        if pod is None:
            template = copy.deepcopy(job["spec"]["template"])
            pod_name = f"{name}-{secrets.token_hex(3)[:5]}"
            body = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": pod_name, "namespace": self.namespace,
                    "labels": template["metadata"].get("labels", {}),
                    "annotations": template["metadata"].get("annotations", {}),
                    "ownerReferences": [{
                        "apiVersion": "batch/v1", "kind": "Job", "name": name,
                        "uid": job["metadata"]["uid"], "controller": True,
                        "blockOwnerDeletion": True}],
                },
                "spec": template["spec"],
            }
            pod = self._doc(self._core.create_namespaced_pod(
                self.namespace, body, _preload_content=False))
            status = dict(job.get("status") or {})
            self._patch_job(name, {"active": 1, "startTime": status.get("startTime")
                                   or now_rfc3339()})
        assert pod is not None
        if unschedulable:
            self._patch_pod(pod["metadata"]["name"], {"phase": "Pending", "conditions": [
                _condition("PodScheduled", "Unschedulable", unschedulable, status="False")]})
            self._event(pod, "FailedScheduling", unschedulable, component="default-scheduler")
        return self.job(name)

    def _event(self, pod: Mapping[str, Any], reason: str, message: str, *,
               component: str) -> None:
        now = now_rfc3339()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{pod['metadata']['name']}.{secrets.token_hex(8)}",
                         "namespace": self.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod",
                               "name": pod["metadata"]["name"], "namespace": self.namespace,
                               "uid": pod["metadata"]["uid"]},
            "reason": reason, "message": message, "type": "Warning", "count": 1,
            "source": {"component": component}, "firstTimestamp": now, "lastTimestamp": now,
            "reportingComponent": component,
        }
        self._core.create_namespaced_event(self.namespace, body, _preload_content=False)

    def missing_secret(self, pod: Mapping[str, Any]) -> str | None:
        """The kubelet's message when a required (not optional) secretKeyRef of the pod's
        containers names a Secret or key the namespace lacks; None when all resolve."""
        for container in pod["spec"]["containers"]:
            for entry in container.get("env") or []:
                ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
                if not ref or ref.get("optional"):
                    continue
                try:
                    secret = self._doc(self._core.read_namespaced_secret(
                        ref["name"], self.namespace, _preload_content=False))
                except k8s.ApiException as e:
                    if e.status != 404:
                        raise
                    return f'secret "{ref["name"]}" not found'
                if ref["key"] not in (secret.get("data") or {}) | (
                        secret.get("stringData") or {}):
                    return (f"couldn't find key {ref['key']} in Secret "
                            f"{self.namespace}/{ref['name']}")
        return None

    def start_container(self, name: str) -> dict[str, Any]:
        """The kubelet starts the pod's worker container (as `run`), unless a required
        Secret or key its env names is missing: then the container waits in
        CreateContainerConfigError with the kubelet's message, the pod Pending, scheduled
        and never ready."""
        pod = self._active_pod(name)
        if pod is None:
            self.start(name)
            pod = self._active_pod(name)
        assert pod is not None
        message = self.missing_secret(pod)
        if message is None:
            return self.run(name)
        container = pod["spec"]["containers"][0]
        self._patch_pod(pod["metadata"]["name"], {
            "phase": "Pending",
            "conditions": [_condition("PodScheduled", ""), _condition("Ready", "", status="False")],
            "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "",
                "ready": False, "restartCount": 0, "started": False,
                "state": {"waiting": {"reason": "CreateContainerConfigError",
                                      "message": message}}}]})
        return self._patch_job(name, {"active": 1, "ready": 0})

    def run(self, name: str, *, node: str | None = None) -> dict[str, Any]:
        """The pod is scheduled on a node and its worker container runs."""
        pod = self._active_pod(name)
        if pod is None:
            self.start(name)
            pod = self._active_pod(name)
        assert pod is not None
        self._patch_pod(pod["metadata"]["name"], pod_running_status(pod))
        # nodeName is spec (the scheduler's binding); kmock patches any field.
        self._doc(self._core.patch_namespaced_pod(
            pod["metadata"]["name"], self.namespace, {"spec": {"nodeName": node or self.node}},
            _preload_content=False, _content_type=MERGE_PATCH))
        return self._patch_job(name, {"active": 1, "ready": 1})

    def _terminate(self, name: str, *, exit_code: int, reason: str, message: str,
                   log: str | None, conditions: Sequence[Mapping[str, Any]] = (),
                   phase: str) -> tuple[dict[str, Any], dict[str, Any]]:
        pod = self._active_pod(name)
        never_ran = pod is not None and not (pod.get("status") or {}).get("containerStatuses")
        if pod is None or never_ran:
            self.run(name)
            pod = self._active_pod(name)
        assert pod is not None
        pod_name = pod["metadata"]["name"]
        if log is not None:
            self.sim.set_log(self.namespace, pod_name, log)
        pod = self._patch_pod(pod_name, pod_terminated_status(
            pod, exit_code=exit_code, reason=reason, message=message, conditions=conditions,
            phase=phase))
        return self.job(name), pod

    def succeed(self, name: str, *, log: str = "done\n") -> dict[str, Any]:
        """The worker exits 0: the pod Succeeded, the Job Complete."""
        self._terminate(name, exit_code=0, reason="Completed", message="", log=log,
                        phase="Succeeded")
        now = now_rfc3339()
        return self._patch_job(name, {
            "active": 0, "ready": 0, "succeeded": 1, "completionTime": now,
            "conditions": [_condition("SuccessCriteriaMet", "CompletionsReached",
                                      "Reached expected number of succeeded pods"),
                           _condition("Complete", "CompletionsReached",
                                      "Reached expected number of succeeded pods")],
        })

    def fail(
        self, name: str, exit_code: int, *, reason: str = "Error", log: str | None = None,
        conditions: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """The worker exits with exit_code; the Job controller applies podFailurePolicy:
        FailJob → the Job Failed (reason PodFailurePolicy); Ignore → a new pod, nothing
        counted; Count → failed+1, a new pod, or the Job Failed (BackoffLimitExceeded)."""
        last_lines = "".join((log or "").splitlines(keepends=True)[-80:])
        job, pod = self._terminate(name, exit_code=exit_code, reason=reason,
                                   message=last_lines, log=log, conditions=conditions,
                                   phase="Failed")
        action, index = failure_policy_action(job, pod)
        status = dict(job.get("status") or {})
        failed = int(status.get("failed") or 0)
        pod_ref = f"{self.namespace}/{pod['metadata']['name']}"
        if action == "Ignore":
            self._patch_job(name, {"active": 0, "ready": 0})
            return self.start(name)
        if action == "FailJob":
            message = (f"Container worker for pod {pod_ref} failed with exit code {exit_code} "
                       f"matching FailJob rule at index {index}")
            return self._fail_job(name, failed + 1, "PodFailurePolicy", message)
        failed += 1
        if failed > int(job["spec"].get("backoffLimit", 6)):
            return self._fail_job(name, failed, "BackoffLimitExceeded",
                                  "Job has reached the specified backoff limit")
        self._patch_job(name, {"active": 0, "ready": 0, "failed": failed})
        return self.start(name)

    def _fail_job(self, name: str, failed: int, reason: str, message: str) -> dict[str, Any]:
        return self._patch_job(name, {
            "active": 0, "ready": 0, "failed": failed,
            "conditions": [_condition("FailureTarget", reason, message),
                           _condition("Failed", reason, message)],
        })

    def oom_kill(self, name: str, *, log: str | None = None) -> dict[str, Any]:
        """The container hits its memory limit: exit 137, reason OOMKilled (counted)."""
        code, reason, _ = POD_FAULTS["oom"]
        return self.fail(name, code, reason=reason, log=log)

    def evict(self, name: str, *, reason: str = "EvictionByEvictionAPI",
              message: str = "Eviction API: evicting") -> dict[str, Any]:
        """Preemption / eviction / drain / spot reclaim: DisruptionTarget, then SIGTERM
        (exit 143). The podFailurePolicy ignores it: a new pod, backoffLimit untouched.
        Reasons: EvictionByEvictionAPI, PreemptionByScheduler, TerminationByKubelet,
        DeletionByTaintManager."""
        return self.fail(name, 143, reason="Error", conditions=[
            _condition("DisruptionTarget", reason, message)])

    def lose_node(self, name: str) -> dict[str, Any]:
        """The node stops reporting: the taint manager evicts the pod (DisruptionTarget),
        PodGC fails it with its container status unknown (exit 137)."""
        code, reason, _ = POD_FAULTS["node_lost"]
        return self.fail(name, code, reason=reason, conditions=fault_conditions("node_lost"))

    def exceed_deadline(self, name: str) -> dict[str, Any]:
        """activeDeadlineSeconds passed: running pods are killed, the Job Failed."""
        pod = self._active_pod(name)
        if pod is not None:
            self._terminate(name, exit_code=143, reason="Error", message="", log=None,
                            phase="Failed")
        job = self.job(name)
        failed = int((job.get("status") or {}).get("failed") or 0) + (1 if pod else 0)
        return self._fail_job(name, failed, "DeadlineExceeded",
                              "Job was active longer than specified deadline")

    # -- on its own --

    def step(self, name: str, outcome: Any) -> dict[str, Any]:
        """Apply one scripted outcome to the Job's current pod: "succeed", an exit code
        (int), "oom", "evict", "preempt", "node_lost", "deadline", or "pending" (left
        unschedulable)."""
        if outcome == "succeed":
            return self.succeed(name)
        if outcome == "oom":
            return self.oom_kill(name)
        if outcome == "evict":
            return self.evict(name)
        if outcome == "preempt":
            return self.evict(name, reason="PreemptionByScheduler",
                              message="Preempted by a higher priority pod")
        if outcome == "node_lost":
            return self.lose_node(name)
        if outcome == "deadline":
            return self.exceed_deadline(name)
        if outcome == "pending":
            return self.start(name, unschedulable=(
                "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 "
                "nodes are available: 4 No preemption victims found for incoming pod."))
        if isinstance(outcome, int):
            return self.fail(name, outcome, log=f"worker exited with {outcome}\n")
        raise ValueError(f"unknown outcome {outcome!r}")

    @contextlib.contextmanager
    def autopilot(
        self, script: Callable[[Mapping[str, Any]], Sequence[Any]] | Sequence[Any] = ("succeed",),
        *, interval_s: float = 0.005, admit: bool = True,
    ) -> Iterator[JobSimulator]:
        """Drive every Job in the namespace on a background thread while the block runs.

        script: the outcomes of a Job's successive pods (see `step`), or a function of the
        Job returning them; when a script runs out, the next pod succeeds. Suspended Jobs
        are admitted (Kueue) when admit is True. Each tick moves a Job one phase:
        pod Pending → Running → the next outcome. Errors in the thread fail the block.
        """
        stop = threading.Event()
        states: dict[str, _Auto] = {}

        def tick() -> None:
            for job in self.jobs():
                name = job["metadata"]["name"]
                if job_finished(job) or job["spec"].get("completionMode") == "Indexed":
                    continue  # Indexed Jobs are IndexedJobSimulator's
                if job["spec"].get("suspend"):
                    if admit:
                        self.admit(name)
                    continue
                state = states.setdefault(job["metadata"]["uid"], _Auto(
                    list(script(job) if callable(script) else script)))
                pod = self._active_pod(name)
                phase = (pod or {}).get("status", {}).get("phase")
                scheduled = bool((pod or {}).get("spec", {}).get("nodeName"))
                outcome = state.script[state.step] if state.step < len(state.script) \
                    else "succeed"
                if outcome == "pending":
                    if pod is None or not (pod.get("status") or {}).get("conditions"):
                        self.step(name, "pending")
                    continue
                if pod is None:
                    self.start(name)
                elif phase == "Pending" and not scheduled:
                    self.run(name)
                else:
                    state.step += 1
                    self.step(name, outcome)

        def loop() -> None:
            try:
                while not stop.is_set():
                    tick()
                    stop.wait(interval_s)
            except BaseException as e:
                self._auto_error = e

        thread = threading.Thread(target=loop, name="kubesim-autopilot", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(10)
        if self._auto_error is not None:
            raise RuntimeError("kubesim autopilot failed") from self._auto_error
