"""Benchmark: list 10,000 result.json markers under an s3:// prefix through S3Store.list_keys.

Target (issue 4): <= 5 s against a local server (moto's ThreadedMotoServer on 127.0.0.1, real
HTTP, real boto3 through AWS_ENDPOINT_URL) on the 2-core development machine. The server runs
in a process of its own (`python -m tests.support.s3server`), as a store does: in this process its
10,000 objects would burden this process's garbage collector and double the time. The markers
are uploaded through the same store, concurrently; that is not timed. Listing is ListObjectsV2
with 1000 keys a page: 10 requests for 10,000 markers, never one per model; about 0.4 s of
each page is moto rendering XML. Run: `.venv/bin/python benchmarks/bench_s3_list.py`
(`--markers N`, `--with-layers` for a layers.csv beside each marker).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from esd_worker.core.store.layout import MARKER_NAME
from esd_worker.core.store.marker import LAYERS_NAME
from esd_worker.core.store.s3 import S3Store

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "esd-bench"

MARKER = b'{"schema": 1, "model": "org/model", "parameters": {"fix_fingers": "xmin_mid"}}\n'
LAYERS = b"model_id,revision,layer,alpha\n" + b"m,,layer,3.5\n" * 20


def model_key(i: int) -> str:
    return f"org{i % 97}--model-{i:05d}-{i * 2654435761 % 2**40:010x}"


@dataclass
class Server:
    env: dict[str, str]
    pid: int


@contextmanager
def s3_server_process() -> Iterator[Server]:
    """`python -m tests.support.s3server` in a child process: its AWS_* environment and pid."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.s3server", "--bucket", BUCKET], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        env: dict[str, str] = {}
        for line in server.stdout:  # `export NAME=value` lines, then `# serving ...`
            if line.startswith("#"):
                break
            name, _, value = line.removeprefix("export ").strip().partition("=")
            env[name] = value
        yield Server(env, server.pid)
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--markers", type=int, default=10_000)
    parser.add_argument("--with-layers", action="store_true",
                        help="also a layers.csv per model, as a real store holds (2x objects)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32, help="concurrent uploads (setup)")
    parser.add_argument("--target-s", type=float, default=5.0)
    args = parser.parse_args(argv)

    with s3_server_process() as server:
        os.environ.update(server.env)  # the standard AWS chain reads these
        store = S3Store(BUCKET, "sweeps/atlas")
        names = [f"{model_key(i)}/{MARKER_NAME}" for i in range(args.markers)]
        blobs = [MARKER] * len(names)
        if args.with_layers:
            names += [f"{model_key(i)}/{LAYERS_NAME}" for i in range(args.markers)]
            blobs += [LAYERS] * args.markers
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(store.put_bytes, names, blobs))
        setup_s = time.perf_counter() - t0

        requests: list[str] = []
        store._client.meta.events.register(  # count what goes over the wire
            "before-send.s3.ListObjectsV2", lambda request, **_: requests.append(request.url)
        )
        timings: list[float] = []
        cpu: list[tuple[float, float]] = []  # (this process, the server) CPU seconds
        for _ in range(args.repeat):
            requests.clear()
            c0, s0, t0 = time.process_time(), cpu_seconds(server.pid), time.perf_counter()
            markers = [k for k in store.list_keys() if k.endswith("/" + MARKER_NAME)]
            timings.append(time.perf_counter() - t0)
            cpu.append((time.process_time() - c0, cpu_seconds(server.pid) - s0))
        assert len(markers) == args.markers, (len(markers), args.markers)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"load average {load} (other work on the machine slows both sides)")
    print(f"versions: boto3 {version('boto3')}, botocore {version('botocore')}, "
          f"moto {version('moto')}")
    print(f"store: {store.url}, {len(names)} objects ({args.markers} markers"
          f"{' + layers.csv' if args.with_layers else ''}); uploaded in {setup_s:.1f} s with "
          f"{args.threads} threads (not timed)")
    print(f"list markers: {args.repeat} runs, {len(requests)} ListObjectsV2 requests each")
    print(f"  first {timings[0]:.3f} s  median {statistics.median(timings):.3f} s  "
          f"max {max(timings):.3f} s  ({args.markers / statistics.median(timings):,.0f} "
          f"markers/s; target <= {args.target_s:.1f} s)")
    client_s = statistics.median(c for c, _ in cpu)
    server_s = statistics.median(s for _, s in cpu)
    # Client and server take turns (each page needs the last one's token), so on an idle
    # machine the wall time is about their CPU time added up; on a busy one it is longer.
    print(f"  CPU per listing (median): client {client_s:.3f} s + server (moto) {server_s:.3f} s"
          f" = {client_s + server_s:.3f} s")
    ok = statistics.median(timings) <= args.target_s
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
