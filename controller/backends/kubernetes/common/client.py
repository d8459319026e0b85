"""Adapter around the official `kubernetes` client: the few calls the sweep makes, as dicts.

Owns talking to the API server: retries (429, 5xx, connection errors: bounded exponential
backoff with full jitter, in `_call` and nowhere else), the mapping of API errors to this
backend's exception family (401/403 name the missing RBAC verb), 409-on-create as "exists",
410 Gone as ResourceVersionExpired (the family lives in common.errors, importable without
`kubernetes`). The only module that imports `kubernetes`. Does not build Jobs (common.jobs)
or decide anything. Objects go in and come out as plain dicts (JSON as the API sends it),
never client models.
"""

from __future__ import annotations

import copy
import functools
import http.client
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

from controller.backends.kubernetes.common.errors import (
    KubeConfigError,
    KubeConflictError,
    KubeError,
    KubeInvalidError,
    KubeNotFoundError,
    KubePermissionError,
    KubeQuotaError,
    KubeUnavailableError,
    ResourceVersionExpired,
)
from controller.backends.kubernetes.common.names import KUEUE_GROUP, KUEUE_VERSION

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_USER = re.compile(r'User "([^"]+)"')


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 429, 5xx and connection errors (never of 401/403/404/409/422).

    attempts: tries in all, the first included (default 6). base_s: the first wait's upper
    bound in seconds (default 0.5), doubling each retry up to max_s (default 30): each wait
    is uniform in [0, bound] ("full jitter"), but at least a 429's Retry-After (capped at
    max_s). deadline_s: stop retrying once this many seconds have passed since the first
    try (default 120; None = attempts only).
    """

    attempts: int = 6
    base_s: float = 0.5
    max_s: float = 30.0
    deadline_s: float | None = 120.0

    def delay(self, retry: int, retry_after_s: float | None = None,
              rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        bound = min(self.max_s, self.base_s * 2 ** (retry - 1))
        wait = (rng or random).uniform(0.0, bound)
        if retry_after_s is not None:
            wait = max(wait, min(retry_after_s, self.max_s))
        return wait


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: type ADDED, MODIFIED, DELETED or BOOKMARK, the object as a dict, and
    its resourceVersion (watch again from the last one seen)."""

    type: str
    object: dict[str, Any]
    resource_version: str | None


@dataclass(frozen=True)
class _Op:
    """What a call does, for messages: verb, resource (plural), API group, namespace."""

    verb: str
    resource: str
    group: str
    namespace: str

    @property
    def qualified(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


def _status_message(e: ApiException) -> str:
    """The `message` of the Status the API server sent, else the HTTP reason."""
    body = e.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            doc = json.loads(body)
        except ValueError:
            return body.strip()[:500]
        if isinstance(doc, dict) and doc.get("message"):
            return str(doc["message"])
    return str(e.reason or "")


def _retry_after(e: ApiException) -> float | None:
    headers = e.headers or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _subject(server_message: str) -> str:
    match = _USER.search(server_message)
    if not match:
        return "the service account"
    user = match[1]
    if user.startswith("system:serviceaccount:"):
        ns, _, name = user.removeprefix("system:serviceaccount:").partition(":")
        return f"the service account {ns}/{name}"
    return f"user {user}"


def _permission_message(op: _Op, status: int, server_message: str) -> str:
    where = f"in namespace {op.namespace}" if op.namespace else "cluster-wide"
    if status == 401:
        return (f"the API server rejected the credentials (401 Unauthorized) when trying to "
                f"{op.verb} {op.qualified} {where}: log in again or refresh the kubeconfig "
                "context / service account token")
    group = op.group or ""
    base = op.resource.split("/")[0]
    rule = (f'add verb {op.verb} on {op.resource} (apiGroups: ["{group}"], resources: '
            f'["{op.resource}"]) to a Role bound to it')
    if "/" in op.resource:
        rule += f" (the subresource {op.resource}, not just {base})"
    return (f"RBAC: {_subject(server_message)} cannot {op.verb} {op.qualified} {where}: "
            f"{rule}. The API server said: {server_message}")


def _map_api_error(e: ApiException, op: _Op) -> KubeError:
    status = int(e.status or 0)
    message = _status_message(e)
    what = f"{op.verb} {op.qualified} in namespace {op.namespace}"
    if status in (401, 403):
        if status == 403 and "exceeded quota" in message:
            return KubeQuotaError(f"{what}: {message}", status=status)
        return KubePermissionError(_permission_message(op, status, message), status=status)
    if status == 404:
        return KubeNotFoundError(f"{what}: not found: {message}", status=status)
    if status == 409:
        return KubeConflictError(f"{what}: conflict: {message}", status=status)
    if status == 410:
        return ResourceVersionExpired(f"{what}: {message or 'resource version too old'}",
                                      status=status)
    if status in (400, 422):
        return KubeInvalidError(f"{what}: rejected: {message}", status=status)
    if status in _RETRYABLE_STATUS:
        return KubeUnavailableError(f"{what}: API server answered {status}: {message}",
                                    status=status)
    return KubeError(f"{what}: API error {status}: {message}", status=status)


def _is_connection_error(e: BaseException) -> bool:
    return isinstance(e, urllib3.exceptions.HTTPError | OSError | http.client.HTTPException)


def _json(resp: Any) -> Any:
    """Decode an unpreloaded urllib3 response and give the connection back to the pool."""
    try:
        return json.loads(resp.data or b"null")
    finally:
        resp.release_conn()


class KubeClient:
    """The sweep's calls to the Kubernetes API (jobs, pods, logs, events, the worker's
    PodTemplate) with retries.

    Build it from a `kubernetes.client.Configuration` (tests point `.host` at a mock
    server) or with `load_client()`. `request_timeout_s` bounds every non-watch call;
    `sleep` and `rng` are for tests. `requests` counts HTTP requests sent (retries included).
    """

    def __init__(
        self, configuration: k8s.Configuration, *, retry: RetryPolicy | None = None,
        request_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
        default_namespace: str | None = None, sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        cfg = copy.deepcopy(configuration)
        # urllib3 must not retry on its own: retries happen in _call only, with backoff.
        cfg.retries = 0
        self._api = k8s.ApiClient(cfg)
        self._batch = k8s.BatchV1Api(self._api)
        self._core = k8s.CoreV1Api(self._api)
        self._custom = k8s.CustomObjectsApi(self._api)
        self.retry = retry or RetryPolicy()
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.default_namespace = default_namespace
        self.requests = 0
        self._sleep = sleep
        self._rng = rng or random.Random()

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place that retries ------------------------------------------------------

    def _call(self, op: _Op, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), retried on 429/5xx/connection errors unless _once=True."""
        once = kwargs.pop("_once", False)
        kwargs.setdefault("_request_timeout", (self.connect_timeout_s, self.request_timeout_s))
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            self.requests += 1
            retry_after: float | None = None
            try:
                return fn(*args, **kwargs)
            except ApiException as e:
                error = _map_api_error(e, op)
                if not isinstance(error, KubeUnavailableError):
                    raise error from e
                retry_after = _retry_after(e)
                cause: BaseException = e
            except Exception as e:
                if not _is_connection_error(e):
                    raise
                error = KubeUnavailableError(
                    f"{op.verb} {op.qualified} in namespace {op.namespace}: cannot reach the "
                    f"API server: {type(e).__name__}: {e}")
                cause = e
            elapsed = time.monotonic() - started
            out_of_time = (self.retry.deadline_s is not None
                           and elapsed >= self.retry.deadline_s)
            if once or attempt >= self.retry.attempts or out_of_time:
                raise KubeUnavailableError(
                    f"{error} (gave up after {attempt} tries in {elapsed:.1f} s)",
                    status=error.status) from cause
            wait = self.retry.delay(attempt, retry_after, self._rng)
            log.warning("kube %s %s: %s; retry %d/%d in %.2f s", op.verb, op.qualified,
                        error, attempt, self.retry.attempts - 1, wait)
            self._sleep(wait)

    # -- jobs ----------------------------------------------------------------------------

    def create_job(self, namespace: str, body: Mapping[str, Any]) -> Literal["created", "exists"]:
        """Create a Job. "exists" when one of that name is there already (409): adopt it.

        Idempotent: a create whose response was lost and that is retried answers "exists".
        """
        op = _Op("create", "jobs", "batch", namespace)
        try:
            resp = self._call(op, self._batch.create_namespaced_job, namespace, dict(body),
                              _preload_content=False)
        except KubeConflictError:
            return "exists"
        _json(resp)
        return "created"

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Job as a dict, or None when there is none of that name."""
        return self._read(_Op("get", "jobs", "batch", namespace),
                          self._batch.read_namespaced_job, name)

    def read_pod_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The v1 PodTemplate as a dict (the worker image: --worker-template), or None."""
        return self._read(_Op("get", "podtemplates", "", namespace),
                          self._core.read_namespaced_pod_template, name)

    def _read(self, op: _Op, fn: Callable[..., Any], name: str) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = _json(self._call(op, fn, name, op.namespace,
                                                   _preload_content=False))
        except KubeNotFoundError:
            return None
        return doc

    def list_jobs(
        self, namespace: str, label_selector: str, *, page_size: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        """All Jobs matching the selector and the list's resourceVersion (watch from it).

        Pages of `page_size`; a continue token that expired (410) raises
        ResourceVersionExpired: list again from the start.
        """
        op = _Op("list", "jobs", "batch", namespace)
        return _pages(self._call, op, self._batch.list_namespaced_job, namespace,
                          label_selector=label_selector, page_size=page_size)

    def watch_jobs(
        self, namespace: str, label_selector: str, resource_version: str | None,
        timeout_s: int = 300,
    ) -> Iterator[WatchEvent]:
        """Job events after `resource_version` (None: every current Job as ADDED first),
        for up to `timeout_s` seconds.

        Ends quietly when the server closes the watch (its timeout) or the connection drops:
        watch again from the last event's resource_version. 410 Gone (the version is too old)
        raises ResourceVersionExpired: list again, then watch from the list's version.
        Opening the watch is retried like any call; BOOKMARK events carry only a version.
        """
        op = _Op("watch", "jobs", "batch", namespace)
        kwargs: dict[str, Any] = {
            "label_selector": label_selector,
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": int(timeout_s),
            "_preload_content": False,
            # The server ends the watch at timeout_s; the read timeout only catches a
            # server that went silent.
            "_request_timeout": (self.connect_timeout_s, timeout_s + 30.0),
        }
        if resource_version:
            kwargs["resource_version"] = resource_version
        resp = self._call(op, self._batch.list_namespaced_job, namespace, **kwargs)
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    message = str(obj.get("message") or obj.get("reason") or "")
                    if code == 410:
                        raise ResourceVersionExpired(
                            f"watch jobs.batch in namespace {namespace} from "
                            f"resourceVersion {resource_version}: {message}", status=410)
                    fake = ApiException(status=code, reason=obj.get("reason"))
                    fake.body = json.dumps(obj)
                    raise _map_api_error(fake, op)
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                yield WatchEvent(type=str(kind), object=obj, resource_version=rv)
        except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException) as e:
            log.info("watch jobs.batch in namespace %s ended: %s: %s", namespace,
                     type(e).__name__, e)
        finally:
            resp.close()
            resp.release_conn()

    def delete_job(self, namespace: str, name: str) -> bool:
        """Delete a Job and (in the background) its pods. False when it was already gone."""
        op = _Op("delete", "jobs", "batch", namespace)
        body = k8s.V1DeleteOptions(propagation_policy="Background")
        try:
            resp = self._call(op, self._batch.delete_namespaced_job, name, namespace,
                              body=body, _preload_content=False)
        except KubeNotFoundError:
            return False
        _json(resp)
        return True

    def server_version(self) -> str:
        """The API server's gitVersion (e.g. "v1.31.2-eks-7f9249a"); "" when it does not say."""
        op = _Op("get", "version", "", "-")
        resp = self._call(op, k8s.VersionApi(self._api).get_code, _preload_content=False)
        doc = _json(resp)
        return str((doc or {}).get("gitVersion") or "")

    # -- pods, logs, events --------------------------------------------------------------

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Pods matching the selector (e.g. `batch.kubernetes.io/job-name=NAME`)."""
        return self._list(_Op("list", "pods", "", namespace), self._core.list_namespaced_pod,
                          namespace, label_selector=label_selector)[0]

    def read_pod_log(self, namespace: str, name: str, tail_lines: int = 50) -> str:
        """The last `tail_lines` lines of the pod's worker log; "" when the pod is gone or
        its container never started (the API answers 400 then)."""
        op = _Op("get", "pods/log", "", namespace)
        try:
            resp = self._call(op, self._core.read_namespaced_pod_log, name, namespace,
                              tail_lines=tail_lines, _preload_content=False)
        except (KubeNotFoundError, KubeInvalidError):
            return ""
        try:
            data: bytes = resp.data or b""
        finally:
            resp.release_conn()
        return data.decode("utf-8", "replace")

    def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        """core/v1 Events matching the field selector (e.g. `involvedObject.name=POD`)."""
        return self._list(_Op("list", "events", "", namespace),
                          self._core.list_namespaced_event, namespace,
                          field_selector=field_selector)[0]

    def _list(self, op: _Op, fn: Callable[..., Any], namespace: str, *, page_size: int = 500,
              **selectors: str) -> tuple[list[dict[str, Any]], str]:
        """Every item of a list and its resourceVersion (the doctor lists nodes with it)."""
        return _pages(self._call, op, fn, namespace, page_size=page_size, **selectors)

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        """Create a core/v1 Event, tried once within 5 s (best effort: common.jobevents)."""
        _json(self._call(_Op("create", "events", "", namespace),
                         self._core.create_namespaced_event, namespace, dict(body),
                         _preload_content=False, _once=True,
                         _request_timeout=(min(self.connect_timeout_s, 5.0), 5.0)))

    def list_workloads(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Kueue Workloads (v1beta2) matching the selector; none without Kueue (404)."""
        op = _Op("list", "workloads", KUEUE_GROUP, namespace)
        pages = functools.partial(self._custom.list_namespaced_custom_object, KUEUE_GROUP,
                                  KUEUE_VERSION, plural="workloads")
        try:
            return _pages(self._call, op, pages, namespace, label_selector=label_selector)[0]
        except KubeNotFoundError:
            return []


def _pages(
    call: Callable[..., Any], op: _Op, fn: Callable[..., Any], namespace: str, *,
    page_size: int = 500, **selectors: str,
) -> tuple[list[dict[str, Any]], str]:
    """Every item of a list, page by page through `call` (KubeClient._call); its version."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    version = ""
    while True:
        kwargs: dict[str, Any] = dict(selectors, limit=page_size, _preload_content=False)
        if token:
            kwargs["_continue"] = token
        doc = _json(call(op, fn, namespace, **kwargs))
        items.extend(doc.get("items") or [])
        meta = doc.get("metadata") or {}
        version = version or str(meta.get("resourceVersion") or "")
        token = meta.get("continue") or None
        if not token:
            return items, version


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(_SA_NAMESPACE_FILE)


def load_client(
    context: str | None = None, *, kubeconfig: str | None = None,
    retry: RetryPolicy | None = None,
) -> KubeClient:
    """A KubeClient for a kubeconfig context (default: the current one), or for the pod's
    service account when running in a cluster and no context is named.

    `default_namespace` is the context's namespace, or the pod's own namespace in-cluster.
    Raises KubeConfigError when neither works.
    """
    cfg = k8s.Configuration()
    namespace: str | None = None
    if context is None and kubeconfig is None and _in_cluster():
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except ConfigException as e:
            raise KubeConfigError(f"in-cluster service account config is unusable: {e}") from e
        try:
            with open(_SA_NAMESPACE_FILE, encoding="utf-8") as f:
                namespace = f.read().strip() or None
        except OSError:
            namespace = None
        return KubeClient(cfg, retry=retry, default_namespace=namespace)
    # The client reads KUBECONFIG once, when it is imported; read it at call time instead.
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        k8s_config.load_kube_config(config_file=kubeconfig, context=context,
                                    client_configuration=cfg, persist_config=False)
        contexts, current = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError, TypeError, ValueError) as e:
        where = f"context {context!r}" if context else "the current context"
        source = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubeConfigError(f"cannot load {where} from {source}: {e}") from e
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    if chosen:
        namespace = (chosen.get("context") or {}).get("namespace")
    return KubeClient(cfg, retry=retry, default_namespace=namespace)
