"""Kueue's admission of a suspended Job, simulated: does a ClusterQueue admit it, with how
many pods, and if not, the message Kueue puts on its Workload.

Owns the decision (ClusterQueueSim.decide / admit) as Kueue v0.19.2 makes it for a batch/v1
Job (pkg/controller/jobs/job: one pod set "main" of `parallelism` pods, capped by
`completions`, its minimum the `kueue.x-k8s.io/job-min-parallelism` annotation; pkg/scheduler:
ClusterQueue inactive, then namespaceSelector, then flavor assignment in
pkg/scheduler/flavorassigner, then partial admission's search for the most pods that fit),
and a Kueue for the test API server (KueueSim.reconcile: admits the Jobs that fit, gives
the others a Workload whose QuotaReserved condition is False with that message, as
controller.backends.kubernetes.common.kueue reads it).

Messages are Kueue's own format strings:
- "couldn't assign flavors to pod set main: resource X unavailable in ClusterQueue"
- "... insufficient unused quota for X in flavor F, N more needed" (the queue's other
  Workloads hold the quota),
- "... insufficient quota for X in flavor F, previously considered podsets requests (0) +
  current podset request (R) > maximum capacity (C)" (more than the queue has at all),
- "workload namespace doesn't match ClusterQueue selector", "ClusterQueue Q is inactive".

Not simulated: cohorts and borrowing, preemption (the default withinClusterQueue: Never
finds no victim), flavor taints and node labels, TAS, admission checks, LimitRanges,
resource transformations. Kueue walks a Workload's requests in Go map order, so with two
problems its message names either; this walks them sorted (one problem each in the tests).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tests.support.kubesim import JobSimulator, condition, job_finished

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MIN_PARALLELISM = "kueue.x-k8s.io/job-min-parallelism"
POD_SET = "main"

_SUFFIXES = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
             "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
             "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
             "E": Fraction(10**18), "Ki": Fraction(2**10), "Mi": Fraction(2**20),
             "Gi": Fraction(2**30), "Ti": Fraction(2**40), "Pi": Fraction(2**50),
             "Ei": Fraction(2**60)}
_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = {-3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


def amount(resource: str, quantity: object) -> int:
    """A quantity in Kueue's integer units: milli-CPU for cpu, else the unit itself (bytes),
    rounded up as resource.Quantity's MilliValue / Value do."""
    text = str(quantity).strip()
    number, suffix = text, ""
    for s in sorted(_SUFFIXES, key=len, reverse=True):
        if s and text.endswith(s):
            number, suffix = text[: -len(s)], s
            break
    if "e" in number.lower():
        mantissa, _, exp = number.lower().partition("e")
        value = Fraction(mantissa) * Fraction(10) ** int(exp)
    else:
        value = Fraction(number) * _SUFFIXES[suffix]
    if resource == "cpu":
        value *= 1000
    return -((-value.numerator) // value.denominator)


def show(resource: str, value: int) -> str:
    """Kueue's ResourceFormatter: cpu as a milli-quantity, memory and ephemeral-storage in
    canonical binary SI, anything else as a decimal count, each as Quantity.String() writes
    it (64000m → 64, 2**31 → 2Gi, 1000 → 1k)."""
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        if -1024 < value < 1024:
            return str(value)
        exp = 0
        while value % 1024 == 0 and exp < len(_BINARY) - 1:
            value, exp = value // 1024, exp + 1
        return f"{value}{_BINARY[exp]}"
    exp = -3 if resource == "cpu" else 0
    while value != 0 and value % 1000 == 0 and exp < 18:
        value, exp = value // 1000, exp + 3
    return f"{value}{_DECIMAL[exp]}"


def pod_requests(template_spec: Mapping[str, Any]) -> dict[str, int]:
    """One pod's requests as Kueue counts them: each container's requests (a limit stands
    for a missing request), summed, raised to any init container's, plus the pod's
    overhead."""
    def of(container: Mapping[str, Any]) -> dict[str, int]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {name: amount(name, q) for name, q in merged.items()}

    total: dict[str, int] = {}
    for c in template_spec.get("containers") or []:
        for name, v in of(c).items():
            total[name] = total.get(name, 0) + v
    for c in template_spec.get("initContainers") or []:
        for name, v in of(c).items():
            total[name] = max(total.get(name, 0), v)
    for name, q in (template_spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + amount(name, q)
    return total


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics as Kueue applies namespaceSelector: null selects
    nothing, {} everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Decision:
    """What Kueue does with a Workload: admitted with `count` pods, each resource on its
    flavor; or not, `message` saying why (its QuotaReserved condition's)."""

    admitted: bool
    count: int = 0
    flavors: Mapping[str, str] = field(default_factory=dict)
    message: str = ""
    usage: Mapping[tuple[str, str], int] = field(default_factory=dict)


class ClusterQueueSim:
    """One ClusterQueue (kueue.x-k8s.io/v1beta2, as a dict) and the ResourceFlavors that
    exist, with the quota its admitted Workloads hold. exclude_resource_prefixes: Kueue's
    Configuration resources.excludeResourcePrefixes."""

    def __init__(self, cluster_queue: Mapping[str, Any],
                 flavors: Iterable[Mapping[str, Any]] = (), *,
                 exclude_resource_prefixes: Sequence[str] = ()) -> None:
        self.name = str(cluster_queue["metadata"]["name"])
        spec = cluster_queue.get("spec") or {}
        self.selector: Mapping[str, Any] | None = spec.get("namespaceSelector")
        self.groups: list[tuple[list[str], list[str]]] = []  # (resources, flavor names)
        self.nominal: dict[tuple[str, str], int] = {}  # (flavor, resource) → amount
        for group in spec.get("resourceGroups") or []:
            covered = [str(r) for r in group["coveredResources"]]
            names = []
            for flavor in group["flavors"]:
                listed = [r["name"] for r in flavor["resources"]]
                if listed != covered:  # Kueue's webhook and CEL rule refuse such a queue
                    raise ValueError(f"flavor {flavor['name']} lists {listed}, not {covered}")
                names.append(flavor["name"])
                for r in flavor["resources"]:
                    self.nominal[(flavor["name"], r["name"])] = amount(
                        r["name"], r.get("nominalQuota", 0))
            self.groups.append((covered, names))
        self.existing = {str(f["metadata"]["name"]) for f in flavors}
        self.exclude = tuple(exclude_resource_prefixes)
        self.used: dict[tuple[str, str], int] = {}
        self.holders: dict[str, Mapping[tuple[str, str], int]] = {}  # Workload key → usage

    def _group(self, resource: str) -> tuple[list[str], list[str]] | None:
        return next((g for g in self.groups if resource in g[0]), None)

    def _assign(self, per_pod: Mapping[str, int], count: int
                ) -> tuple[dict[str, str], list[str], bool]:
        """flavorassigner.Assign for `count` pods: (flavors, reasons, unavailable)."""
        requests = {r: v * count for r, v in per_pod.items()}
        flavors: dict[str, str] = {}
        for resource in sorted(requests):
            group = self._group(resource)
            if group is None:
                if requests[resource] == 0:
                    continue
                return {}, [f"resource {resource} unavailable in ClusterQueue"], True
            if resource in flavors:
                continue
            covered, names = group
            asked = {r: v for r, v in requests.items() if r in covered}
            reasons: list[str] = []
            for name in names:
                if name not in self.existing:
                    reasons.append(f"flavor {name} not found")
                    continue
                misses = [self._miss(name, r, v) for r, v in sorted(asked.items())]
                misses = [m for m in misses if m]
                if not misses:
                    flavors.update({r: name for r in asked})
                    break
                reasons += misses
            else:
                return {}, sorted(reasons), False
        return flavors, [], False

    def _miss(self, flavor: str, resource: str, val: int) -> str:
        """fitsResourceQuota with no cohort: maximum capacity is the nominal quota, what is
        available that less what admitted Workloads hold."""
        nominal = self.nominal[(flavor, resource)]
        available = nominal - self.used.get((flavor, resource), 0)
        if val > nominal:
            return (f"insufficient quota for {resource} in flavor {flavor}, previously "
                    f"considered podsets requests (0) + current podset request "
                    f"({show(resource, val)}) > maximum capacity ({show(resource, nominal)})")
        if val > available:
            return (f"insufficient unused quota for {resource} in flavor {flavor}, "
                    f"{show(resource, val - available)} more needed")
        return ""

    def decide(self, job: Mapping[str, Any],
               namespace_labels: Mapping[str, str] | None = None) -> Decision:
        """What Kueue's scheduler does with the Workload of `job` (a batch/v1 Job dict) now.
        namespace_labels: the Job's namespace's labels (by default just the
        kubernetes.io/metadata.name label the API server sets)."""
        if any(name not in self.existing for _, names in self.groups for name in names):
            return Decision(False, message=f"ClusterQueue {self.name} is inactive")
        namespace = str((job.get("metadata") or {}).get("namespace") or "default")
        labels = namespace_labels or {"kubernetes.io/metadata.name": namespace}
        if not _selects(self.selector, labels):
            return Decision(False, message="workload namespace doesn't match ClusterQueue "
                                           "selector")
        spec = job.get("spec") or {}
        count = int(spec.get("parallelism", 1))
        if spec.get("completions") is not None:
            count = min(count, int(spec["completions"]))
        minimum = ((job.get("metadata") or {}).get("annotations") or {}).get(MIN_PARALLELISM)
        per_pod = {r: v for r, v in pod_requests(spec["template"]["spec"]).items()
                   if not (self.exclude and r.startswith(self.exclude))}
        flavors, reasons, unavailable = self._assign(per_pod, count)
        message = f"couldn't assign flavors to pod set {POD_SET}: " + ", ".join(reasons)
        if not reasons:
            return self._admitted(per_pod, count, flavors)
        low = int(minimum) if minimum is not None and minimum.isdigit() else count
        if not unavailable and low < count:
            # PodSetReducer.Search: the fewest pods taken away that make it fit.
            for n in range(count - 1, max(low, 1) - 1, -1):
                flavors, again, _ = self._assign(per_pod, n)
                if not again:
                    return self._admitted(per_pod, n, flavors)
        return Decision(False, message=message)

    @staticmethod
    def _admitted(per_pod: Mapping[str, int], count: int,
                  flavors: Mapping[str, str]) -> Decision:
        usage = {(flavors[r], r): v * count for r, v in per_pod.items() if r in flavors}
        return Decision(True, count=count, flavors=dict(flavors), usage=usage)

    def admit(self, key: str, job: Mapping[str, Any],
              namespace_labels: Mapping[str, str] | None = None) -> Decision:
        """decide, and an admitted Workload (`key`) holds its quota until release(key)."""
        decision = self.decide(job, namespace_labels)
        if decision.admitted:
            self.holders[key] = decision.usage
            for fr, v in decision.usage.items():
                self.used[fr] = self.used.get(fr, 0) + v
        return decision

    def release(self, key: str) -> None:
        """The Workload finished: its quota is free again."""
        for fr, v in self.holders.pop(key, {}).items():
            self.used[fr] -= v


class KueueSim:
    """Kueue over the test API server, for Jobs labelled kueue.x-k8s.io/queue-name:
    reconcile() admits each suspended one that fits (its parallelism cut to what was
    admitted, then unsuspended) and makes a Workload with Kueue's reason for each that does
    not; a finished Job's quota is released. Call it from a thread, or use run()."""

    def __init__(self, api: JobSimulator, queue: ClusterQueueSim) -> None:
        self.api = api
        self.queue = queue
        self.decisions: dict[str, Decision] = {}  # by Job name, the latest
        self._waiting: set[str] = set()  # Job uids given a Workload
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reconcile(self) -> None:
        for job in self.api.jobs():
            meta = job["metadata"]
            uid, name = meta["uid"], meta["name"]
            if QUEUE_LABEL not in (meta.get("labels") or {}):
                continue
            if job_finished(job):
                self.queue.release(uid)
                continue
            if not job["spec"].get("suspend") or uid in self.queue.holders:
                continue
            decision = self.queue.admit(uid, job)
            self.decisions[name] = decision
            if decision.admitted:
                self.api.admit(name, parallelism=decision.count)
            elif uid not in self._waiting:
                self._waiting.add(uid)
                self.api.queue_workload(name, [condition(
                    "QuotaReserved", "Pending", decision.message, status="False")],
                    queue=meta["labels"][QUEUE_LABEL])

    def start(self, interval_s: float = 0.01) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.reconcile()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
