"""Where the next Job goes: GPU telemetry polled from the exporters, and nodes with room.

Owns the telemetry state machine of a run: finding the exporters (fixed URLs, or pods by
label selector), polling them every poll_interval_s, switching placement on when readings
arrive and off (plain placement: the scheduler decides) when there are none, when every
node went stale or when Kueue admits the Jobs, and handing out nodes with room in order,
with reservations held until the pod runs. Telemetry only ever adds a preference (a soft
node affinity) and paces submissions: the GPU request is the hard constraint, and the
scheduler (and Kueue) decide where a Job runs. The per-GPU rule is
telemetry.NodeGpuTracker's; this module does not create Jobs or read Job state
(the per_model mode's backend does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.errors import KubePermissionError
from controller.backends.kubernetes.common.settings import ClusterSettings
from controller.backends.kubernetes.common.telemetry import (
    NodeGpu,
    NodeGpuTracker,
    TelemetryError,
    node_affinity,
    scrape,
)

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)

ScrapeFn = Callable[..., list[NodeGpu]]


class Placement:
    """GPU-telemetry placement for one run: "telemetry" (Jobs prefer nodes whose GPUs have
    room, and are submitted as room appears) or "plain" (only request nvidia.com/gpu and
    let the scheduler place them).

    Starts "unknown"; `poll` turns it "on" once exporters give readings and "off" when
    telemetry is disabled, Kueue admits the Jobs (its quota and the scheduler decide, and a
    preference of ours would fight its flavor assignment), there are no exporters, or none
    gives a reading. Once on, a failed poll keeps the tracker's view while some node is
    still fresh; when every node went stale it falls back to plain placement (waiting for
    room on no node would stall the sweep).
    GPUs count as free only after `max_checks` polls under `threshold_mib` (MiB).
    scrape_fn, clock: for tests.
    """

    def __init__(
        self, settings: ClusterSettings, kube: KubeClient | None, *, gpus_per_job: int,
        threshold_mib: float = 500.0, max_checks: int = 10, poll_interval_s: float = 1.0,
        scrape_fn: ScrapeFn = scrape, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.gpus_per_job = gpus_per_job
        self.poll_interval_s = poll_interval_s
        self.tracker = NodeGpuTracker(
            threshold_mib=threshold_mib, max_checks=max_checks,
            stale_after_s=max(60.0, 10 * poll_interval_s), clock=clock)
        self._scrape = scrape_fn
        self._state = "unknown"  # unknown | on | off
        self._said_off = False
        self.polls = 0  # polls that gave readings
        self._next_poll = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._candidates: dict[int, list[str]] = {}  # GPUs a Job wants -> nodes with room
        self._index: dict[int, int] = {}

    @property
    def mode(self) -> str:
        """How Jobs are placed now: "telemetry" or "plain"."""
        return "telemetry" if self._state == "on" else "plain"

    @property
    def pinning(self) -> bool:
        """Whether Jobs prefer nodes picked here (telemetry on, and Jobs that want GPUs)."""
        return self._state == "on" and self.gpus_per_job > 0

    @property
    def settled(self) -> bool:
        """Whether free GPUs can be trusted: telemetry off, or on for max_checks polls
        (--no-wait must not give up before GPUs had the chance to qualify)."""
        return self._state != "on" or self.polls >= self.tracker.max_checks

    def due(self, now: float) -> bool:
        return now >= self._next_poll

    def poll(self, now: float) -> None:
        """Scrape every exporter once (in parallel) and update the tracker and the mode."""
        self._next_poll = now + self.poll_interval_s
        if not self.settings.telemetry or self.gpus_per_job < 1:
            self._off("telemetry is off")
            return
        if self.settings.kueue_queue:
            self._off(f"Kueue admits the Jobs (queue {self.settings.kueue_queue})")
            return
        try:
            targets = self._targets()
        except KubePermissionError as e:
            self._off(f"cannot list the exporter pods ({e})")
            return
        if not targets:
            self._off(
                f"no GPU exporter pods ({self.settings.telemetry_selector} in namespace "
                f"{self.settings.telemetry_namespace or self.settings.namespace})")
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="telemetry")

        def one(target: tuple[str, str | None]) -> list[NodeGpu]:
            url, node = target
            try:
                return self._scrape(url, default_node=node)
            except TelemetryError as e:
                log.debug("telemetry %s: %s", url, e)
                return []

        samples = [s for batch in self._pool.map(one, targets) for s in batch]
        if not samples:
            # Exporters that stop answering (fixed --telemetry-url ones too) turn placement
            # off once every node is stale; before that, the fresh view is kept.
            self._off(f"{len(targets)} exporter(s) gave no GPU readings")
            return
        self.tracker.observe(samples)
        self.polls += 1
        if self._state != "on":
            log.info("GPU telemetry from %d exporter(s): Jobs go to nodes whose GPUs stayed "
                     "under %g MiB for %d polls", len(targets), self.tracker.threshold_mib,
                     self.tracker.max_checks)
        self._state = "on"

    def _targets(self) -> list[tuple[str, str | None]]:
        """(metrics URL, node or None) of every exporter to scrape."""
        if self.kube is None and not self.settings.telemetry_urls:
            return []
        return exporter_targets(self.kube, self.settings)

    def _off(self, why: str) -> None:
        if self._state == "on":
            if self.tracker.has_fresh_nodes():
                return  # keep the tracker's view while some node is still fresh
            # Every node went stale: pinning to nothing would stall the sweep for good.
            log.warning("GPU telemetry lost (%s): Jobs now only request nvidia.com/gpu and "
                        "the scheduler places them", why)
            self._said_off = True
        self._state = "off"
        if not self._said_off:
            log.info("no GPU telemetry (%s): Jobs only request nvidia.com/gpu and the "
                     "scheduler places them", why)
            self._said_off = True

    # -- handing out nodes ------------------------------------------------------------------

    def start_pass(self) -> None:
        """Begin a submission pass: nodes with room are ranked once per pass (per GPU count).

        Ranking again for every Job would cost O(nodes) each; filling the ranked nodes in
        order (most free GPUs first, each until its free GPUs are reserved) packs a node
        before the next, keeping whole nodes free for other work and for the autoscaler.
        """
        self._candidates = {}
        self._index = {}

    def next_node(self, gpus: int | None = None) -> str | None:
        """The node the next Job of `gpus` GPUs (default gpus_per_job) should go to, or None
        when no node has room for it."""
        n = self.gpus_per_job if gpus is None else gpus
        candidates = self._candidates.get(n)
        if candidates is None:
            candidates = self._candidates[n] = self.tracker.nodes_with_room(n)
        index = self._index.get(n, 0)
        while index < len(candidates) and self.tracker.free_gpus(candidates[index]) < n:
            index += 1
        self._index[n] = index
        return candidates[index] if index < len(candidates) else None

    @staticmethod
    def affinity(node: str) -> dict[str, Any]:
        # A preference for the exact node name (matchFields), which the exporter reports from
        # spec.nodeName (the kubernetes.io/hostname label differs under --hostname-override).
        # Never a requirement: see telemetry.node_affinity.
        return node_affinity([node], key="metadata.name")

    def reserve(self, node: str, gpus: int | None = None) -> None:
        """Hold a Job's GPUs (default gpus_per_job) on `node` until its pod runs (telemetry
        lags behind)."""
        self.tracker.reserve(node, self.gpus_per_job if gpus is None else gpus)

    def release(self, node: str, gpus: int | None = None) -> None:
        self.tracker.release(node, self.gpus_per_job if gpus is None else gpus)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def exporter_targets(
    kube: KubeClient | None, settings: ClusterSettings
) -> list[tuple[str, str | None]]:
    """(metrics URL, node) of every exporter a sweep scrapes (placement, and `doctor`'s check):
    --telemetry-url, else the running pods of --telemetry-selector at their IP and
    --telemetry-port."""
    if settings.telemetry_urls or kube is None:
        return [(url, None) for url in settings.telemetry_urls]
    namespace = settings.telemetry_namespace or settings.namespace
    out = []
    for pod in kube.list_pods(namespace, settings.telemetry_selector):
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") == "Running" and ip:
            host = f"[{ip}]" if ":" in str(ip) else str(ip)  # an IPv6 pod IP
            out.append((f"http://{host}:{settings.telemetry_port}/metrics",
                        (pod.get("spec") or {}).get("nodeName")))
    return out
