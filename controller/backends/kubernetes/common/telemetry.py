"""GPU telemetry for the Kubernetes backend: read dcgm-exporter metrics, decide where Jobs fit.

Sources: our own exporter (`esd-sweep gpu-exporter`, controller.gpu.exporter) or NVIDIA's
dcgm-exporter, both scraped over HTTP in the Prometheus text exposition format. Only GPU
memory is read, per GPU:

- DCGM_FI_DEV_FB_USED (required), DCGM_FI_DEV_FB_FREE (optional; when it is missing, free
  memory is worked out from DCGM_FI_DEV_FB_TOTAL minus used minus DCGM_FI_DEV_FB_RESERVED if
  those are there, else left unknown), all in MiB;
- labels gpu, UUID (or `uuid`, dcgm-exporter's --use-old-namespace), modelName, and the node:
  `Hostname` (dcgm-exporter 3.x/4.x, our exporter) or `hostname` (dcgm-exporter after
  NVIDIA/dcgm-exporter#655). Other labels (pci_bus_id, device, DCGM_FI_DRIVER_VERSION,
  pod/namespace/container on Kubernetes) and every other metric are ignored.

The node label must be the Kubernetes node name, since Jobs prefer nodes by it: our exporter
and dcgm-exporter both take it from the NODE_NAME environment variable, which their
DaemonSets set from the downward API (spec.nodeName); without it they fall back to the
container's hostname, i.e. the pod name. An exporter run without the label
(dcgm-exporter --no-hostname) can be read with `default_node` (the scraped pod's node).

Series of one GPU that repeat (dcgm-exporter writes one per pod when a GPU is time-sliced
between pods) are merged, keeping the most used and the least free memory. MIG instances
(labels GPU_I_ID/GPU_I_PROFILE) are read as GPUs of their own, named "<gpu>/<GPU_I_ID>",
in place of their parent GPU. Values of 2**31 - 16 MiB and more are DCGM's "blank" markers
(no data) and are read as missing.

Placement (NodeGpuTracker) applies the local backend's rule (controller.gpu.gpus.GpuTracker):
a GPU is free when its used memory stayed under `threshold_mib` for `max_checks`
consecutive polls.
"""

from __future__ import annotations

import http.client
import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from controller.gpu.dcgm import FB_FREE, FB_RESERVED, FB_TOTAL, FB_USED

log = logging.getLogger(__name__)

# The metric names: dcgm-exporter's, and the one owner of them for our exporter too
# (controller.gpu.exporter serves them under these names).
_WANTED = frozenset({FB_USED, FB_FREE, FB_TOTAL, FB_RESERVED})
_PREFIX = "DCGM_FI_DEV_FB_"

# DCGM marks "no value" with numbers from DCGM_INT32_BLANK (0x7ffffff0) up; no GPU has
# that many MiB.
DCGM_BLANK_MIB = float(0x7FFFFFF0)

HOSTNAME_KUBERNETES_LABEL = "kubernetes.io/hostname"

_MAX_BODY = 32 * 2**20
_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class TelemetryError(Exception):
    """Telemetry could not be read: scrape failed, or the text is not the expected format."""


@dataclass(frozen=True)
class NodeGpu:
    """One GPU of one node as last scraped; memory in MiB (free None when not reported)."""

    node: str
    gpu: str
    uuid: str
    model_name: str
    used_mib: float
    free_mib: float | None


# --- parsing ----------------------------------------------------------------------------------


def _parse_sample(line: str) -> tuple[str, dict[str, str], float]:
    """name{labels} value [timestamp] -> (name, labels, value); ValueError when malformed."""
    m = _NAME_RE.match(line)
    if m is None:
        raise ValueError("no metric name")
    name = m.group()
    i, n = m.end(), len(line)
    labels: dict[str, str] = {}
    while i < n and line[i] in " \t":
        i += 1
    if i < n and line[i] == "{":
        i += 1
        while True:
            while i < n and line[i] in " \t":
                i += 1
            if i >= n:
                raise ValueError("unterminated label set")
            if line[i] == "}":
                i += 1
                break
            lm = _LABEL_RE.match(line, i)
            if lm is None:
                raise ValueError(f"bad label name at column {i + 1}")
            i = lm.end()
            while i < n and line[i] in " \t":
                i += 1
            if i >= n or line[i] != "=":
                raise ValueError(f"expected '=' after label {lm.group()!r}")
            i += 1
            while i < n and line[i] in " \t":
                i += 1
            if i >= n or line[i] != '"':
                raise ValueError(f"expected '\"' to open the value of label {lm.group()!r}")
            i += 1
            chars: list[str] = []
            while True:
                if i >= n:
                    raise ValueError(f"unterminated value of label {lm.group()!r}")
                c = line[i]
                if c == "\\":
                    if i + 1 >= n:
                        raise ValueError(f"unterminated value of label {lm.group()!r}")
                    nxt = line[i + 1]
                    chars.append(_ESCAPES.get(nxt, "\\" + nxt))
                    i += 2
                    continue
                if c == '"':
                    i += 1
                    break
                chars.append(c)
                i += 1
            labels[lm.group()] = "".join(chars)
            while i < n and line[i] in " \t":
                i += 1
            if i >= n:
                raise ValueError("unterminated label set")
            if line[i] == ",":
                i += 1
            elif line[i] == "}":
                i += 1
                break
            else:
                raise ValueError(f"expected ',' or '}}' after label {lm.group()!r}")
    rest = line[i:].split()
    if not rest or len(rest) > 2:
        raise ValueError("expected a value and at most a timestamp after the labels")
    value = float(rest[0])  # NaN, +Inf, -Inf included
    if len(rest) == 2:
        float(rest[1])  # a timestamp (ms; seconds in OpenMetrics); its value is not used
    return name, labels, value


@dataclass
class _Gpu:
    node: str
    gpu: str
    uuid: str = ""
    model_name: str = ""
    used: float | None = None
    free: float | None = None
    total: float | None = None
    reserved: float | None = None


def _merge(old: float | None, new: float, keep: Callable[[float, float], float]) -> float:
    return new if old is None else keep(old, new)


def parse_metrics(text: str, *, default_node: str | None = None) -> list[NodeGpu]:
    """The GPUs in a scrape of our exporter or of dcgm-exporter, sorted by node and GPU.

    `default_node` names the node for samples that carry neither `Hostname` nor `hostname`;
    without it such samples are an error. GPUs without DCGM_FI_DEV_FB_USED are left out.
    Raises TelemetryError on a malformed memory sample (other lines are not looked at).
    """
    gpus: dict[tuple[str, str, str], _Gpu] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line.startswith(_PREFIX):
            continue  # comments, blank lines, other metrics
        try:
            name, labels, value = _parse_sample(line)
        except ValueError as e:
            raise TelemetryError(f"line {lineno}: {e}: {line[:200]!r}") from None
        if name not in _WANTED:
            continue
        node = labels.get("hostname") or labels.get("Hostname") or default_node
        if not node:
            raise TelemetryError(
                f"line {lineno}: {name} has no Hostname/hostname label (exporter run without "
                f"one, e.g. dcgm-exporter --no-hostname?) and no default node was given"
            )
        gpu = labels.get("gpu")
        if gpu is None:
            continue  # not a GPU series (dcgm-exporter's switch/CPU entities)
        instance = labels.get("GPU_I_ID", "")
        entry = gpus.get((node, gpu, instance))
        if entry is None:
            name_ = f"{gpu}/{instance}" if instance else gpu
            entry = gpus[(node, gpu, instance)] = _Gpu(node, name_)
        entry.uuid = entry.uuid or labels.get("UUID") or labels.get("uuid") or ""
        entry.model_name = entry.model_name or labels.get("modelName", "")
        if math.isnan(value) or value >= DCGM_BLANK_MIB:
            continue
        if name == FB_USED:
            entry.used = _merge(entry.used, value, max)
        elif name == FB_FREE:
            entry.free = _merge(entry.free, value, min)
        elif name == FB_TOTAL:
            entry.total = _merge(entry.total, value, min)
        else:
            entry.reserved = _merge(entry.reserved, value, max)
    # A GPU split into MIG instances is offered as its instances, not as a whole.
    split = {(node, gpu) for (node, gpu, instance) in gpus if instance}
    out: list[NodeGpu] = []
    for (node, gpu, instance), g in gpus.items():
        if g.used is None or (not instance and (node, gpu) in split):
            continue
        free = g.free
        if free is None and g.total is not None:
            free = max(0.0, g.total - g.used - (g.reserved or 0.0))
        out.append(NodeGpu(node=g.node, gpu=g.gpu, uuid=g.uuid, model_name=g.model_name,
                           used_mib=g.used, free_mib=free))
    out.sort(key=lambda s: (s.node, _gpu_sort_key(s.gpu)))
    return out


def _gpu_sort_key(gpu: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in gpu.split("/"))


# --- scraping ---------------------------------------------------------------------------------

# Exporters are reached at pod or node addresses inside the cluster: never through a proxy
# from the environment (HTTP_PROXY), whose NO_PROXY rarely lists pod networks.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(url: str, *, timeout_s: float = 3.0, default_node: str | None = None) -> list[NodeGpu]:
    """GET `url` (an exporter's /metrics) and parse it. Raises TelemetryError on any failure."""
    try:
        request = urllib.request.Request(
            url, headers={"Accept": _ACCEPT, "User-Agent": "esd-sweep"}
        )
        with _OPENER.open(request, timeout=timeout_s) as response:
            body = response.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as e:
        try:
            detail = e.read(500).decode("utf-8", errors="replace").strip().splitlines()
        except (OSError, http.client.HTTPException):
            detail = []
        first = detail[0] if detail else e.reason
        raise TelemetryError(f"{url}: HTTP {e.code}: {first}") from None
    except urllib.error.URLError as e:
        raise TelemetryError(f"{url}: {e.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        # timeouts (socket.timeout is an OSError), resets, bad status lines, bad URLs
        raise TelemetryError(f"{url}: {type(e).__name__}: {e}") from None
    if len(body) > _MAX_BODY:
        raise TelemetryError(f"{url}: response larger than {_MAX_BODY // 2**20} MiB")
    text = body.decode("utf-8", errors="replace")
    try:
        return parse_metrics(text, default_node=default_node)
    except TelemetryError as e:
        raise TelemetryError(f"{url}: {e}") from None


# --- placement --------------------------------------------------------------------------------


@dataclass
class _GpuState:
    uuid: str
    used_mib: float
    free_mib: float | None
    checks: int


@dataclass
class _NodeState:
    gpus: dict[str, _GpuState]
    seen_at: float
    ready: int  # GPUs free for max_checks polls
    ready_free_mib: float  # their free memory together (unknown counts 0)

    def room(self, reserved: int) -> tuple[int, float]:
        """Unreserved free GPUs, and their free memory (reserved ones taken at the mean)."""
        free = self.ready - reserved
        if free <= 0:
            return 0, 0.0
        return free, self.ready_free_mib * free / self.ready


@dataclass(frozen=True)
class NodeStatus:
    """One node as the tracker sees it, for progress output and reports."""

    node: str
    gpus: int
    ready: int
    reserved: int
    free: int
    age_s: float
    stale: bool


class NodeGpuTracker:
    """Which nodes have GPUs free long enough, from telemetry polls; the local rule per node.

    - `observe(samples)` is one poll. For each node in it: a GPU under `threshold_mib` gets
      one more consecutive free check, one at or over it (or with no reading) goes back to
      0, and the node's GPUs missing from the poll are forgotten (they start at 0 when they
      come back); a GPU whose UUID changed starts at 0.
    - A node missing from a poll (its scrape failed) keeps its counts but gets no newer
      ones. A node not seen for more than `stale_after_s` is stale: it is not offered, and
      when it is seen again its GPUs start at 0. So a passing scrape failure costs nothing,
      and stale telemetry is never trusted, including when polls stop altogether.
    - `free_gpus(node)`: GPUs free for at least `max_checks` polls, minus the node's
      reservations. `reserve` when a Job is sent to prefer the node; `release` when its pod is
      running there (its GPU then counts in the node's Kubernetes allocation and soon in
      its memory) or when the Job ends without running. Reservations survive staleness.
    - `nodes_with_room(n)`: fresh nodes with at least n free GPUs, most free GPUs first,
      then most free memory on those GPUs (reserved GPUs taken out at the node's mean),
      then by name.
    """

    def __init__(
        self,
        *,
        threshold_mib: float = 500,
        max_checks: int = 10,
        stale_after_s: float = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        problems = []
        if not (threshold_mib > 0 and math.isfinite(threshold_mib)):
            problems.append(f"threshold_mib: must be > 0 MiB, got {threshold_mib}")
        if max_checks < 1:
            problems.append(f"max_checks: must be >= 1, got {max_checks}")
        if not (stale_after_s > 0 and math.isfinite(stale_after_s)):
            problems.append(f"stale_after_s: must be > 0 s, got {stale_after_s}")
        if problems:
            raise ValueError("invalid telemetry settings: " + "; ".join(problems))
        self.threshold_mib = float(threshold_mib)
        self.max_checks = max_checks
        self.stale_after_s = float(stale_after_s)
        self._clock = clock
        self._nodes: dict[str, _NodeState] = {}
        self._reserved: dict[str, int] = {}

    def _fresh(self, state: _NodeState, now: float) -> bool:
        return now - state.seen_at <= self.stale_after_s

    def observe(self, samples: Iterable[NodeGpu]) -> None:
        """One poll of every node's exporter (see the class docstring)."""
        now = self._clock()
        polled: dict[str, dict[str, NodeGpu]] = {}
        for s in samples:
            gpus = polled.setdefault(s.node, {})
            seen = gpus.get(s.gpu)
            if seen is None or not (seen.used_mib >= s.used_mib):  # keep the busier reading
                gpus[s.gpu] = s
        threshold, max_checks = self.threshold_mib, self.max_checks
        for node, gpus in polled.items():
            before = self._nodes.get(node)
            old = before.gpus if before is not None and self._fresh(before, now) else {}
            new: dict[str, _GpuState] = {}
            ready, ready_free = 0, 0.0
            for gpu, s in gpus.items():
                was = old.get(gpu)
                checks = 0
                if s.used_mib < threshold:  # False for NaN
                    checks = 1 + (was.checks if was is not None and was.uuid == s.uuid else 0)
                    checks = min(checks, max_checks)
                new[gpu] = _GpuState(s.uuid, s.used_mib, s.free_mib, checks)
                if checks >= max_checks:
                    ready += 1
                    ready_free += s.free_mib if s.free_mib is not None else 0.0
            self._nodes[node] = _NodeState(new, now, ready, ready_free)
        for node in [n for n, st in self._nodes.items() if not self._fresh(st, now)]:
            log.info("node %s: no GPU telemetry for %.0f s, not offered until seen again",
                     node, now - self._nodes[node].seen_at)
            del self._nodes[node]

    def free_gpus(self, node: str) -> int:
        """GPUs of `node` free for max_checks polls, minus its reservations (0 if stale)."""
        state = self._nodes.get(node)
        if state is None or not self._fresh(state, self._clock()):
            return 0
        return max(0, state.ready - self._reserved.get(node, 0))

    def reserve(self, node: str, n: int) -> None:
        """Count `n` GPUs of `node` as taken by a Job placed there."""
        if n < 1:
            raise ValueError(f"reserve: n must be >= 1, got {n}")
        self._reserved[node] = self._reserved.get(node, 0) + n

    def release(self, node: str, n: int) -> None:
        """Give back `n` reserved GPUs of `node`."""
        if n < 1:
            raise ValueError(f"release: n must be >= 1, got {n}")
        held = self._reserved.get(node, 0)
        if n > held:
            raise ValueError(f"release: node {node} has {held} reserved GPU(s), not {n}")
        if held == n:
            del self._reserved[node]
        else:
            self._reserved[node] = held - n

    def reserved(self, node: str) -> int:
        return self._reserved.get(node, 0)

    def nodes_with_room(self, n: int) -> list[str]:
        """Fresh nodes with >= n free GPUs: most free GPUs, then most free memory, first."""
        if n < 1:
            raise ValueError(f"nodes_with_room: n must be >= 1, got {n}")
        now = self._clock()
        ranked: list[tuple[int, float, str]] = []
        for node, state in self._nodes.items():
            if not self._fresh(state, now):
                continue
            free, memory = state.room(self._reserved.get(node, 0))
            if free >= n:
                ranked.append((-free, -memory, node))
        ranked.sort()
        return [node for _, _, node in ranked]

    def has_fresh_nodes(self) -> bool:
        """Whether any node was seen within stale_after_s (telemetry is still working)."""
        now = self._clock()
        return any(self._fresh(state, now) for state in self._nodes.values())

    def status(self) -> list[NodeStatus]:
        """Every node with telemetry, by name."""
        now = self._clock()
        out = []
        for node in sorted(self._nodes):
            state = self._nodes[node]
            fresh = self._fresh(state, now)
            reserved = self._reserved.get(node, 0)
            out.append(NodeStatus(
                node=node, gpus=len(state.gpus), ready=state.ready if fresh else 0,
                reserved=reserved, free=max(0, state.ready - reserved) if fresh else 0,
                age_s=now - state.seen_at, stale=not fresh,
            ))
        return out


def node_affinity(nodes: Sequence[str], *, key: str = HOSTNAME_KUBERNETES_LABEL,
                  weight: int = 100) -> dict[str, Any]:
    """A pod `affinity` that prefers `nodes` (the Job builder puts it in the pod spec).

    Preferred, never required: telemetry sees GPU memory, not which GPUs the scheduler has
    given to pods, and a worker still importing or downloading holds its GPU with no memory
    in use. The scheduler filters nodes by their free nvidia.com/gpu first and only then
    scores the preference, so a Job never waits on a node whose GPUs are all allocated.
    By default on the `kubernetes.io/hostname` node label, which the kubelet sets to the
    node name unless it runs with --hostname-override; key="metadata.name" matches the node
    name itself (a matchFields term), which is exact.
    """
    values = list(dict.fromkeys(nodes))
    if not values:
        raise ValueError("node_affinity: at least one node is needed")
    if not 1 <= weight <= 100:
        raise ValueError(f"node_affinity: weight must be 1..100, got {weight}")
    requirement = {"key": key, "operator": "In", "values": values}
    term = {"matchFields" if key == "metadata.name" else "matchExpressions": [requirement]}
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": weight, "preference": term}]
        }
    }
