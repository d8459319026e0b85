"""Benchmark: the Kubernetes backend on a simulated cluster (default 200 nodes x 8 GPUs,
20,000 models).

Target (issue 5): controller CPU time <= 5 ms per model, API requests per model a small
constant, peak memory reported.

How it is measured:
- The simulated cluster runs in a CHILD PROCESS: KubeSim (kmock's emulator over HTTP,
  validation off, history trimmed, as its docstring advises for benchmarks), a driver that
  plays Job controller + kubelet + worker (on each new Job: mark it running, write the
  model's result.json marker into the store directory, mark it Complete; every
  --fail-every-th model instead fails with exit 3 through tests.support.kubesim.JobSimulator, with
  a pod, so the controller's failure path — pod list, log read — is included), and the GPU
  telemetry: one static dcgm-exporter-format /metrics page listing every node's GPUs.
- This process runs only the controller: KubernetesBackend with the sweep's real Recorder
  (it confirms every marker in the store and writes failure records), i.e. everything
  `esd-sweep run` does per model after planning. Controller CPU = this process's CPU time
  (time.process_time: the controller thread, its watch thread and the telemetry scrape
  threads) during backend.run; the per-thread split uses time.thread_time in each thread.
  The mock server's and the driver's CPU is in the other process and not counted.
- Peak memory: this process's peak RSS (ru_maxrss) after the run minus before it (the
  interpreter and imports, the kubernetes client included), and the absolute peak.
- API requests: KubeClient.requests (every HTTP request the controller sent, retries
  included), cross-checked with the emulator's per-verb counts from the child.

Run: `.venv/bin/python benchmarks/bench_cluster.py [--nodes 200 --gpus 8 --models 20000]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NS = "bench"


def telemetry_page(nodes: int, gpus: int) -> bytes:
    lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
             "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for n in range(nodes):
        for g in range(gpus):
            labels = (f'gpu="{g}",UUID="GPU-{n:04d}-{g}",modelName="NVIDIA H100 80GB HBM3",'
                      f'Hostname="node-{n:04d}"')
            lines.append(f"DCGM_FI_DEV_FB_USED{{{labels}}} 3")
            lines.append(f"DCGM_FI_DEV_FB_FREE{{{labels}}} 81000")
    return ("\n".join(lines) + "\n").encode()


def cluster_process(conn: Any, store_dir: str, nodes: int, gpus: int, fail_every: int) -> None:
    """The simulated cluster (child process): API server, Job driver, telemetry page."""
    from kubernetes import client as k8s
    from kubernetes.watch.watch import iter_resp_lines

    from tests.support.kubesim import MERGE_PATCH, JobSimulator, KubeSim, now_rfc3339

    logging.basicConfig(level=logging.WARNING)
    page = telemetry_page(nodes, gpus)

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:
            pass

    metrics = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    sim = KubeSim(validate=False, keep_history=False, event_window=20000).start()
    simulator = JobSimulator(sim, namespace=NS)
    batch = k8s.BatchV1Api(sim.api_client(bypass=True))
    stop = threading.Event()
    handled: set[str] = set()

    def drive() -> None:
        rv = None
        while not stop.is_set():
            kwargs: dict[str, Any] = {"watch": True, "timeout_seconds": 5,
                                      "_preload_content": False}
            if rv:
                kwargs["resource_version"] = rv
            resp = batch.list_namespaced_job(NS, **kwargs)
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                obj = event["object"]
                rv = obj["metadata"].get("resourceVersion") or rv
                name = obj["metadata"].get("name")
                if event["type"] != "ADDED" or name in handled:
                    continue
                handled.add(name)
                annotations = obj["metadata"]["annotations"]
                key = annotations["esd-sweep/model-key"]
                index = int(annotations["esd-sweep/model-ref"].rsplit("-", 1)[1])
                if fail_every and index % fail_every == 0:
                    simulator.fail(name, 3, log="PermanentModelError: not found\n")
                    continue
                now = now_rfc3339()
                batch.patch_namespaced_job_status(
                    name, NS, {"status": {"active": 1, "ready": 1, "startTime": now}},
                    _content_type=MERGE_PATCH)
                marker = {"model": annotations["esd-sweep/model-ref"], "model_key": key,
                          "parameters": {}, "summary": {}}
                path = Path(store_dir) / key
                path.mkdir(parents=True, exist_ok=True)
                (path / "result.json").write_text(json.dumps(marker))
                cond = {"type": "Complete", "status": "True", "reason": "CompletionsReached",
                        "message": "", "lastProbeTime": now, "lastTransitionTime": now}
                batch.patch_namespaced_job_status(
                    name, NS, {"status": {"active": 0, "ready": 0, "succeeded": 1,
                                          "completionTime": now_rfc3339(),
                                          "conditions": [cond]}},
                    _content_type=MERGE_PATCH)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    conn.send({"url": sim.url,
               "metrics": f"http://127.0.0.1:{metrics.server_address[1]}/metrics"})
    conn.recv()  # the controller is done
    counts = {f"{verb} {res}": n for (verb, res), n in sim.emulator.counts.items()}
    stop.set()
    conn.send(counts)
    sim.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--models", type=int, default=20000)
    parser.add_argument("--fail-every", type=int, default=500,
                        help="every Nth model fails with exit 3 (0: none)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile", type=Path,
                        help="cProfile the controller thread into this file (slows it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from kubernetes import client as k8s  # imported before the baseline: not per model

    from controller.backends.base import Task
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
    from controller.backends.kubernetes.per_model.backend import KubernetesBackend
    from controller.run.recorder import Recorder
    from esd_worker.core.models.modellist import ModelRow
    from esd_worker.core.store.opener import open_store

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        store = open_store(tmp)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=cluster_process,
                           args=(child, tmp, args.nodes, args.gpus, args.fail_every))
        proc.start()
        info = parent.recv()
        cfg = k8s.Configuration()
        cfg.host = info["url"]
        kube = KubeClient(cfg)
        rows = [ModelRow(f"org{i % 97}/model-{i}", None, "", None)
                for i in range(args.models)]
        settings = ClusterSettings(
            namespace=NS, image="ghcr.io/example/esd-sweep:0.1.0",
            telemetry_urls=(info["metrics"],), max_active_jobs=args.nodes * args.gpus,
            watch_timeout_s=30)
        job_settings = settings.job_settings(
            run_id="bench", instance=sweep_instance(store.url), gpus_per_job=1,
            worker_args=("--fix-fingers", "xmin_mid"))
        recorder = Recorder(store, "bench")
        backend = KubernetesBackend(
            settings, kube, job_settings=job_settings, output_url=store.url,
            gpus_per_job=1, max_retries=2, max_checks=1, poll_interval_s=1.0)
        tasks = [Task.for_model(row) for row in rows]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            outcomes = profiler.runcall(backend.run, tasks, recorder)
            profiler.dump_stats(args.profile)
        else:
            outcomes = backend.run(tasks, recorder)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        parent.send("done")
        server_counts = parent.recv()
        proc.join(30)
        kube.close()

    n = args.models
    figures = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"Python {platform.python_version()}",
        "nodes": args.nodes, "gpus_per_node": args.gpus, "models": n,
        "done": len(recorder.done), "failed": len(recorder.failed),
        "outcomes": len(outcomes),
        "wall_s": round(wall, 2),
        "controller_cpu_s": round(cpu, 2),
        "controller_cpu_ms_per_model": round(1000 * cpu / n, 3),
        "main_thread_cpu_ms_per_model": round(1000 * backend.cpu_s / n, 3),
        "watch_thread_cpu_ms_per_model": round(1000 * backend.watch_cpu_s / n, 3),
        "peak_rss_mib": round(rss1 / 1024, 1),
        "peak_rss_growth_mib": round((rss1 - rss0) / 1024, 1),
        "api_requests": kube.requests,
        "api_requests_per_model": round(kube.requests / n, 3),
        "server_counts": server_counts,
        "jobs_created": backend.created,
        "placement": backend.placement,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = figures["controller_cpu_ms_per_model"] <= 5.0 and len(outcomes) == n
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
