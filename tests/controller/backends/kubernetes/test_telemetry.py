"""Tests of controller.backends.kubernetes.common.telemetry: dcgm-exporter text to GPUs, scraping,
and the per-node GPU rule (NodeGpuTracker).

The fixtures in tests/fixtures/dcgm/ are dcgm-exporter /metrics bodies reconstructed from its
documented format, one with the `Hostname` label (3.x/4.x) and one with `hostname` (after
NVIDIA/dcgm-exporter#655); see the comments at their top.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from controller.backends.kubernetes.common.telemetry import (
    NodeGpu,
    NodeGpuTracker,
    NodeStatus,
    TelemetryError,
    node_affinity,
    parse_metrics,
    scrape,
)
from tests.support import FIXTURES as SUPPORT_FIXTURES

FIXTURES = SUPPORT_FIXTURES / "dcgm"
H100_A = "GPU-8b2281de-6d3c-22ed-0ec8-d3b864870b8b"
H100_B = "GPU-15338f3e-5fd9-962d-921a-979b820520f0"


# --- parsing dcgm-exporter's output -----------------------------------------------------------


def test_dcgm_exporter_with_hostname_label() -> None:
    text = (FIXTURES / "dcgm-exporter-4.x-Hostname.txt").read_text()
    assert parse_metrics(text) == [
        NodeGpu("gpu-node-a", "0", H100_A, "NVIDIA H100 80GB HBM3", 40955.0, 40035.0),
        NodeGpu("gpu-node-a", "1", H100_B, "NVIDIA H100 80GB HBM3", 0.0, 80990.0),
    ]


def test_dcgm_exporter_with_lowercase_hostname_no_fb_free_time_slicing_and_mig() -> None:
    text = (FIXTURES / "dcgm-exporter-hostname-lowercase.txt").read_text()
    a100 = "NVIDIA A100-SXM4-80GB"
    mig = "GPU-838de0dd-3f65-636a-83e8-fcb0f9e03cd0"
    assert parse_metrics(text) == [
        # free = total - used - reserved (FB_FREE is not exported)
        NodeGpu("gpu-node-b", "0", "GPU-4c226d4d-8129-a7cf-fecd-daa9018b4b48", a100,
                20480.0, 81920.0 - 20480 - 567),  # two pods' series, merged
        NodeGpu("gpu-node-b", "1", "GPU-a6158b59-2c1e-1e63-0068-9178c4298abd", a100,
                0.0, 81920.0 - 567),
        NodeGpu("gpu-node-b", "2", "GPU-bd94f0f5-8c2f-bc95-74ad-5f99fdc33d01", a100,
                30012.0, 81920.0 - 30012 - 567),
        NodeGpu("gpu-node-b", "3/1", mig, a100, 13.0, 40192.0 - 13),
        NodeGpu("gpu-node-b", "3/2", mig, a100, 20013.0, 40192.0 - 20013),
    ]


def test_two_exporters_concatenated_sort_by_node() -> None:
    text = ((FIXTURES / "dcgm-exporter-hostname-lowercase.txt").read_text()
            + (FIXTURES / "dcgm-exporter-4.x-Hostname.txt").read_text())
    assert [(g.node, g.gpu) for g in parse_metrics(text)] == [
        ("gpu-node-a", "0"), ("gpu-node-a", "1"), ("gpu-node-b", "0"), ("gpu-node-b", "1"),
        ("gpu-node-b", "2"), ("gpu-node-b", "3/1"), ("gpu-node-b", "3/2")]


L = 'gpu="0",UUID="GPU-x",modelName="M",Hostname="n"'

PARSE_CASES = [
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 10\n", [NodeGpu("n", "0", "GPU-x", "M", 10.0, None)],
        id="no-fb-free-no-total: free unknown"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 10 1718000000000\n"
        f"DCGM_FI_DEV_FB_FREE{{{L}}} 20 1718000000000\n",
        [NodeGpu("n", "0", "GPU-x", "M", 10.0, 20.0)], id="timestamps after values"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 10 1718000000.125\n",
        [NodeGpu("n", "0", "GPU-x", "M", 10.0, None)], id="OpenMetrics timestamp in seconds"),
    pytest.param(
        'DCGM_FI_DEV_FB_USED{ gpu = "0" , modelName="A \\"quoted\\" \\\\ name\\nline2", '
        'Hostname="n",UUID="GPU-x", } 1.5e3\n',
        [NodeGpu("n", "0", "GPU-x", 'A "quoted" \\ name\nline2', 1500.0, None)],
        id="escapes, spaces, trailing comma, exponent"),
    pytest.param(
        '# HELP DCGM_FI_DEV_FB_USED x\n# TYPE DCGM_FI_DEV_FB_USED gauge\n\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",uuid="GPU-old",modelName="M",Hostname="n"} 3\n'
        '# EOF\n',
        [NodeGpu("n", "0", "GPU-old", "M", 3.0, None)], id="lowercase uuid (old namespace)"),
    pytest.param(
        f'DCGM_FI_DEV_FB_USED{{{L},hostname="lower"}} 3\n',
        [NodeGpu("lower", "0", "GPU-x", "M", 3.0, None)], id="both spellings: hostname wins"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} NaN\nDCGM_FI_DEV_FB_FREE{{{L}}} 5\n", [],
        id="NaN used: left out"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 9223372036854775792\n", [], id="DCGM int64 blank"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 2147483632\n", [], id="DCGM int32 blank"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 1\nDCGM_FI_DEV_FB_FREE{{{L}}} +Inf\n",
        [NodeGpu("n", "0", "GPU-x", "M", 1.0, None)], id="+Inf free: unknown"),
    pytest.param(
        f"DCGM_FI_DEV_FB_FREE{{{L}}} 5\n", [], id="free without used: left out"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED_PERCENT{{{L}}} 0.5\nDCGM_FI_DEV_FB_USED{{{L}}} 7\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0" broken\nsomething_else 1\nDCGM_FI_DEV_FB_TOTAL{'
        f"{L}}} 100\n",
        [NodeGpu("n", "0", "GPU-x", "M", 7.0, 93.0)],
        id="other metrics ignored, even malformed; free from total"),
    pytest.param(
        'DCGM_FI_DEV_FB_USED{nvswitch="0",Hostname="n"} 1\n', [], id="not a GPU entity"),
    pytest.param(
        f"DCGM_FI_DEV_FB_USED{{{L}}} 10\nDCGM_FI_DEV_FB_USED{{{L},pod=\"p2\"}} 30\n"
        f"DCGM_FI_DEV_FB_FREE{{{L}}} 70\nDCGM_FI_DEV_FB_FREE{{{L},pod=\"p2\"}} 50\n",
        [NodeGpu("n", "0", "GPU-x", "M", 30.0, 50.0)], id="repeated series: busiest wins"),
    pytest.param("", [], id="empty"),
]


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES)
def test_parse_metrics(text: str, expected: list[NodeGpu]) -> None:
    assert parse_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [('DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"', "line 1: unterminated label set"),
     ('DCGM_FI_DEV_FB_USED{gpu="0,Hostname="n"} 1', "line 1: expected ','"),
     ('\nDCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} many', "line 2: could not convert"),
     ('DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"}', "line 1: expected a value"),
     ('DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} 1 2 3', "line 1: expected a value"),
     ('DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} 1 soon', "line 1: could not convert"),
     ('DCGM_FI_DEV_FB_USED{gpu=0} 1', "line 1: expected '\"'"),
     ('DCGM_FI_DEV_FB_USED{gpu="0"} 1', "no Hostname/hostname label")],
)
def test_malformed_memory_samples_raise(text: str, message: str) -> None:
    with pytest.raises(TelemetryError, match=message):
        parse_metrics(text)


def test_default_node_for_exporters_without_the_label() -> None:
    text = 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="U",device="nvidia0",modelName="M"} 1\n'
    assert parse_metrics(text, default_node="pod-node") == [
        NodeGpu("pod-node", "0", "U", "M", 1.0, None)]


# --- scraping ---------------------------------------------------------------------------------


class _Canned(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, str]]] = {}

    def do_GET(self) -> None:
        status, body = self.routes[self.path]
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def canned() -> Iterator[str]:
    _Canned.routes = {
        "/metrics": (200, (FIXTURES / "dcgm-exporter-4.x-Hostname.txt").read_text()),
        "/nolabel": (200, 'DCGM_FI_DEV_FB_USED{gpu="0"} 1\n'),
        "/broken": (503, "exporter is starting\nsecond line\n"),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_scrape_reads_a_dcgm_exporter(canned: str) -> None:
    assert [(g.node, g.gpu, g.used_mib) for g in scrape(canned + "/metrics")] == [
        ("gpu-node-a", "0", 40955.0), ("gpu-node-a", "1", 0.0)]
    assert scrape(canned + "/nolabel", default_node="k8s-node")[0].node == "k8s-node"


@pytest.mark.parametrize(
    ("path", "message"),
    [("/broken", r"/broken: HTTP 503: exporter is starting$"),
     ("/nolabel", "/nolabel: line 1: .*no Hostname/hostname label")],
)
def test_scrape_errors(canned: str, path: str, message: str) -> None:
    with pytest.raises(TelemetryError, match=message):
        scrape(canned + path)


def test_scrape_connection_refused_and_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TelemetryError, match=f"127.0.0.1:{port}/metrics: .*refused"):
        scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=2)
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(TelemetryError, match="timed out"):
            scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=0.2)
    with pytest.raises(TelemetryError, match="unknown url type"):
        scrape("nota-url")


# --- placement --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def gpu(
    node: str, index: int, used: float, free: float | None = 80000.0, uuid: str = ""
) -> NodeGpu:
    return NodeGpu(node, str(index), uuid or f"GPU-{node}-{index}", "H100", used, free)


def make_tracker(clock: Clock | None = None) -> NodeGpuTracker:
    return NodeGpuTracker(threshold_mib=500, max_checks=3, stale_after_s=60,
                          clock=clock or Clock())


@pytest.mark.parametrize(
    ("polls", "free"),
    [([[0, 0, 0]], 1),  # one node, one GPU, three free polls
     ([[0, 0]], 0),  # not yet max_checks
     ([[0, 0, 499.9]], 1),  # just under the threshold
     ([[0, 0, 500]], 0),  # at the threshold: busy
     ([[0, 0, 9000, 0, 0]], 0),  # one busy poll resets the count
     ([[0, 0, 9000, 0, 0, 0]], 1),
     ([[0, 0, 0], [9000, 9000, 0]], 1),  # two GPUs
     ([[0, 0, 0], [0, 0, 0]], 2)],
)
def test_threshold_and_consecutive_checks(polls: list[list[float]], free: int) -> None:
    tracker = make_tracker()
    for step in range(len(polls[0])):
        tracker.observe(gpu("n1", i, series[step]) for i, series in enumerate(polls))
    assert tracker.free_gpus("n1") == free
    assert tracker.nodes_with_room(1) == (["n1"] if free else [])


def test_gpus_missing_from_a_nodes_poll_reset() -> None:
    tracker = make_tracker()
    for _ in range(3):
        tracker.observe([gpu("n1", 0, 0), gpu("n1", 1, 0)])
    assert tracker.free_gpus("n1") == 2
    tracker.observe([gpu("n1", 0, 0)])  # GPU 1's series vanished (GPU lost, exporter restart)
    assert tracker.free_gpus("n1") == 1
    tracker.observe([gpu("n1", 0, 0), gpu("n1", 1, 0)])
    assert tracker.free_gpus("n1") == 1  # GPU 1 starts again at 1 check
    tracker.observe([gpu("n1", 0, 0), gpu("n1", 1, 0)])
    tracker.observe([gpu("n1", 0, 0), gpu("n1", 1, 0)])
    assert tracker.free_gpus("n1") == 2


def test_a_new_uuid_at_the_same_index_starts_again() -> None:
    tracker = make_tracker()
    for _ in range(3):
        tracker.observe([gpu("n1", 0, 0, uuid="GPU-old")])
    tracker.observe([gpu("n1", 0, 0, uuid="GPU-new")])
    assert tracker.free_gpus("n1") == 0


def test_staleness() -> None:
    clock = Clock()
    tracker = make_tracker(clock)
    for _ in range(3):
        tracker.observe([gpu("n1", 0, 0), gpu("n2", 0, 0)])
        clock.t += 1
    # n2's scrape fails for a while: it keeps its counts while fresh ...
    clock.t += 50
    tracker.observe([gpu("n1", 0, 0)])
    assert tracker.nodes_with_room(1) == ["n1", "n2"]
    assert tracker.free_gpus("n2") == 1
    # ... and is not offered once not seen for more than stale_after_s, polls or not
    clock.t += 10
    assert tracker.free_gpus("n2") == 0
    assert tracker.free_gpus("n1") == 1
    assert tracker.nodes_with_room(1) == ["n1"]
    assert [(s.node, s.stale) for s in tracker.status()] == [("n1", False), ("n2", True)]
    # no poll at all for a while: nothing is offered
    clock.t += 61
    assert tracker.nodes_with_room(1) == []
    assert tracker.free_gpus("n1") == 0
    # back: stale counts are not reused, it must be free for max_checks polls again
    tracker.observe([gpu("n1", 0, 0), gpu("n2", 0, 0)])
    assert tracker.nodes_with_room(1) == []
    tracker.observe([gpu("n1", 0, 0), gpu("n2", 0, 0)])
    tracker.observe([gpu("n1", 0, 0), gpu("n2", 0, 0)])
    assert tracker.nodes_with_room(1) == ["n1", "n2"]


def test_reservations() -> None:
    tracker = make_tracker()
    for _ in range(3):
        tracker.observe([gpu("n1", i, 0) for i in range(4)])
    tracker.reserve("n1", 3)
    assert tracker.free_gpus("n1") == 1
    assert tracker.nodes_with_room(2) == []
    assert tracker.nodes_with_room(1) == ["n1"]
    tracker.reserve("n1", 2)  # more than free: allowed, free stays at 0
    assert tracker.free_gpus("n1") == 0
    assert tracker.reserved("n1") == 5
    tracker.release("n1", 4)
    assert tracker.free_gpus("n1") == 3
    with pytest.raises(ValueError, match="node n1 has 1 reserved GPU"):
        tracker.release("n1", 2)
    tracker.release("n1", 1)
    assert tracker.reserved("n1") == 0
    with pytest.raises(ValueError, match="release: node n2 has 0"):
        tracker.release("n2", 1)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=">= 1"):
            tracker.reserve("n1", bad)
        with pytest.raises(ValueError, match=">= 1"):
            tracker.release("n1", bad)
        with pytest.raises(ValueError, match=">= 1"):
            tracker.nodes_with_room(bad)


def test_ordering_most_free_gpus_then_most_free_memory_then_name() -> None:
    tracker = make_tracker()
    poll = [
        *(gpu("small", i, 0, free=10000) for i in range(2)),
        *(gpu("big", i, 0, free=80000) for i in range(2)),
        *(gpu("wide", i, 0, free=20000) for i in range(4)),
        *(gpu("b-twin", i, 0, free=80000) for i in range(2)),
        gpu("unknown-free", 0, 0, free=None), gpu("unknown-free", 1, 0, free=None),
        gpu("busy", 0, 9000), gpu("busy", 1, 0),
    ]
    for _ in range(3):
        tracker.observe(poll)
    assert tracker.nodes_with_room(1) == [
        "wide", "b-twin", "big", "small", "unknown-free", "busy"]
    assert tracker.nodes_with_room(2) == ["wide", "b-twin", "big", "small", "unknown-free"]
    assert tracker.nodes_with_room(3) == ["wide"]
    tracker.reserve("wide", 3)
    assert tracker.nodes_with_room(2) == ["b-twin", "big", "small", "unknown-free"]
    # wide: 1 unreserved GPU of 20000 MiB (the mean), busy: 1 of 80000 MiB
    assert tracker.nodes_with_room(1) == [
        "b-twin", "big", "small", "unknown-free", "busy", "wide"]


def test_status_and_unknown_nodes() -> None:
    tracker = make_tracker()
    assert tracker.free_gpus("nowhere") == 0
    for _ in range(3):
        tracker.observe([gpu("n1", 0, 0), gpu("n1", 1, 9000)])
    tracker.reserve("n1", 1)
    assert tracker.status() == [
        NodeStatus(node="n1", gpus=2, ready=1, reserved=1, free=0, age_s=0.0, stale=False)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"threshold_mib": 0}, "threshold_mib"), ({"threshold_mib": float("nan")}, "threshold_mib"),
     ({"max_checks": 0}, "max_checks"), ({"stale_after_s": 0}, "stale_after_s"),
     ({"stale_after_s": float("inf")}, "stale_after_s")],
)
def test_invalid_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodeGpuTracker(**kwargs)  # type: ignore[arg-type]


def test_defaults_mirror_the_local_backend() -> None:
    tracker = NodeGpuTracker()
    assert (tracker.threshold_mib, tracker.max_checks, tracker.stale_after_s) == (500, 10, 60)


def test_a_poll_of_many_nodes_is_cheap() -> None:
    tracker = NodeGpuTracker(max_checks=1)
    poll = [gpu(f"node-{n:03d}", i, 0) for n in range(200) for i in range(8)]
    tracker.observe(poll)
    assert len(tracker.nodes_with_room(8)) == 200
    assert tracker.nodes_with_room(1)[:2] == ["node-000", "node-001"]


# --- affinity ---------------------------------------------------------------------------------


def test_node_affinity_is_a_preference_never_a_requirement() -> None:
    assert node_affinity(["n2", "n1", "n2"]) == {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "preference": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2", "n1"]}
                    ]
                }
            }]
        }
    }
    by_name = node_affinity(("n1",), key="metadata.name", weight=50)
    (term,) = by_name["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"weight": 50, "preference": {
        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}}
    with pytest.raises(ValueError, match="weight"):
        node_affinity(["n1"], weight=0)
    with pytest.raises(ValueError, match="at least one node"):
        node_affinity([])
