"""The watch of a sweep's Jobs, on its own thread, handing what it sees to the controller.

Owns keeping one watch open (from the last resourceVersion seen) and relisting on 410 Gone.
Touches nothing of the backend's: it gets a client, a namespace, a selector and a queue,
and puts ("event", WatchEvent), ("relist", [Job, ...]) or ("error", exception) on it. The
controller thread decides what each means (the per_model mode's backend).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from controller.backends.kubernetes.common.errors import ResourceVersionExpired

if TYPE_CHECKING:
    from controller.backends.kubernetes.common.client import KubeClient

log = logging.getLogger(__name__)

WatchQueue = queue.Queue[tuple[str, Any]]

_RELIST_TRIES = 5


class JobWatcher(threading.Thread):
    """Lists and watches the sweep's Jobs, handing events to the controller thread.

    Watches from `resource_version`; on 410 Gone lists again and hands the whole list over
    ("relist"). An API error that survived the client's retries ends the watch ("error");
    the controller raises it. timeout_s: the server-side timeout of each watch request
    (the watch is then reopened from the last resourceVersion).
    """

    def __init__(self, kube: KubeClient, *, namespace: str, selector: str,
                 resource_version: str, timeout_s: int, out: WatchQueue) -> None:
        super().__init__(name="esd-sweep-watch", daemon=True)
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.rv = resource_version
        self.timeout_s = timeout_s
        self.out = out
        self._stopping = threading.Event()
        self.cpu_s = 0.0
        self.relists = 0

    def stop(self) -> None:
        """Ask the thread to end. It may sit in an open watch until the next event or the
        watch's timeout; it is a daemon, touches nothing of the controller's but the queue,
        and ends quietly then."""
        self._stopping.set()
        self.join(timeout=0.02)

    def run(self) -> None:
        cpu0 = time.thread_time()
        try:
            while not self._stopping.is_set():
                try:
                    for event in self.kube.watch_jobs(self.namespace, self.selector, self.rv,
                                                      timeout_s=self.timeout_s):
                        if event.resource_version:
                            self.rv = event.resource_version
                        if event.type != "BOOKMARK":
                            self.out.put(("event", event))
                        self.cpu_s = time.thread_time() - cpu0
                        if self._stopping.is_set():
                            return
                except ResourceVersionExpired:
                    log.info("watch of Jobs expired (410 Gone): listing again")
                    self.relists += 1
                    self.out.put(("relist", self._relist()))
        except Exception as e:  # handed to the controller thread, which raises it
            if not self._stopping.is_set():
                self.out.put(("error", e))
        finally:
            self.cpu_s = time.thread_time() - cpu0

    def _relist(self) -> list[dict[str, Any]]:
        for tries in range(1, _RELIST_TRIES + 1):
            try:  # a long paged list can expire too (410 on its continue token)
                items, self.rv = self.kube.list_jobs(self.namespace, self.selector)
                return items
            except ResourceVersionExpired:
                if tries == _RELIST_TRIES:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises
