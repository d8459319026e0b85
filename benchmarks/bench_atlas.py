"""Benchmark: the sharded Kubernetes mode at hub scale (issue 13): 2M models on 1,000 GPUs.

Targets: Kubernetes objects created by the controller ≤ 100; controller API requests ≤ 5/s
averaged over the run; controller peak RSS ≤ 1 GiB; planning and sharding ≤ 120 s on the
2-core development machine.

Phases (each in a fresh process, so that peak RSS is the phase's own):
- `plan`: write a synthetic list (not timed: --rows rows, a realistic size mix in a
  size_bytes column: lognormal bases from 10 MB to 140 GB, ~20% adapters right after their
  base), then time what `esd-sweep run` does before it creates a Job: ListPlan.scan (the
  list read as a stream, one marker listing of the store) and the shards cut and written
  to the store (controller.backends.kubernetes.sharded.sharding.write_shards), into a local
  directory store.
- `run`: the whole ShardedBackend.run against a simulated cluster in a CHILD process
  (tests.support.kubesim.KubeSim + tests.support.indexed.IndexedJobSimulator, validation
  off): --gpus GPUs (the pods' parallelism), every pod "analyses" its shard by writing each
  model's marker (with a summary, as a worker's) into the store (a directory on disk,
  --store-dir) and, as a worker does, their models rows as results-tables parts (every
  PART_MODELS models; no layer rows: the simulated models have none), so the controller's
  end is real: the backend's (one marker listing, an outcome per model), then the sweep's
  (controller_end: summary.csv from the results tables, the
  run report, the CLI's first rows of summary.csv). Reported: objects created (from the
  server's counts), the controller's API requests (KubeClient.requests) and their rate
  over the run (to the backend's return), peak RSS (after the plan, the run, the summary
  and at the end), wall and CPU time, each end step's time.
- `s3`: ListPlan.scan of a --s3-rows list against an S3 store (moto's server in a child
  process, over HTTP, real boto3) holding --s3-markers markers, seeded directly into moto's
  backend in the server process (uploading 10^5+ objects over HTTP would take longer than
  what is measured). moto lists every key of the bucket for every 1,000-key page, so its
  cost per page grows with the bucket: reported per page, with the page count.

Run: `.venv/bin/python benchmarks/bench_atlas.py [--rows 2000000 --gpus 1000] [--phase
plan|run|s3|all] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB, GB = 10**6, 10**9
NS = "bench"
RUN_ID = "20261123T070501Z-be4c11"
PART_MODELS = 256  # models a simulated pod writes into one results-tables part (its models row)


def write_list(path: Path, rows: int, seed: int = 13) -> int:
    """A model list of `rows` rows with sizes: bases lognormal (median ~1.5 GB, 10 MB to
    140 GB), each followed by 0-3 adapters (10-200 MB) 20% of the time. Returns the bytes."""
    rng = random.Random(seed)
    total = 0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model_id", "base_model_relation", "source_model", "size_bytes"])
        i = 0
        while i < rows:
            base = f"org{i % 997}/model-{i:07d}"
            size = int(min(max(rng.lognormvariate(math.log(1.5 * GB), 1.4), 10 * MB), 140 * GB))
            out.writerow([base, "", "", size])
            total += size
            i += 1
            if rng.random() < 0.2:
                for _ in range(min(rng.randint(1, 3), rows - i)):
                    adapter = int(rng.uniform(10 * MB, 200 * MB))
                    out.writerow([f"org{i % 997}/adapter-{i:07d}", "lora", base, adapter])
                    total += adapter
                    i += 1
    return total


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "node": platform.node()}


def sizes(row: Any) -> int:
    return int(row.metadata["size_bytes"])


# -- phase plan ----------------------------------------------------------------------------


def phase_plan(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    from controller.backends.base import Task
    from controller.backends.kubernetes.sharded.plan import default_classes
    from controller.backends.kubernetes.sharded.sharding import write_shards
    from controller.run.plan import ListPlan
    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.models.modellist import ListFile
    from esd_worker.core.store.opener import open_store

    listing = work_dir / "models.csv"
    total_bytes = write_list(listing, args.rows)
    store = open_store(str(work_dir / "store"))
    rss0 = peak_rss_mib()
    started = time.perf_counter()
    cpu0 = time.process_time()
    source = ListFile(listing)
    plan = ListPlan(source.items, store, AnalysisSettings().as_dict()).scan()
    scanned = time.perf_counter()

    class Work:
        def __len__(self) -> int:
            return plan.counts.todo

        def __iter__(self) -> Any:
            return (Task.for_model(row) for row in plan.todo())

    classes = default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB)
    shards = write_shards(Work(), store=store, run_id=RUN_ID, classes=classes, size=sizes,
                          budget=args.gpus, max_models=1000)
    ended = time.perf_counter()
    return {
        "rows": args.rows, "list_bytes": listing.stat().st_size, "model_bytes": total_bytes,
        "todo": plan.counts.todo, "scan_s": round(scanned - started, 2),
        "shard_s": round(ended - scanned, 2), "plan_and_shard_s": round(ended - started, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
        "classes": [{"class": c.cls.name, "models": c.models, "shards": c.shards,
                     "parallelism": c.parallelism, "gb": round(c.bytes / GB)} for c in shards],
        "peak_rss_mib": round(peak_rss_mib()), "rss_before_mib": round(rss0),
    }


# -- phase run -----------------------------------------------------------------------------


def done_marker(row: Any, params: dict[str, Any]) -> Any:
    """The marker a worker writes for a done model, with a summary of a model of ~300 layers
    (statistics as full-precision floats, as summary.csv writes them): the controller's end
    reads these into summary.csv as it would a real sweep's."""
    from esd_worker.core.store.marker import Marker
    from esd_worker.core.store.results import SUMMARY_FIELDS

    rng = random.Random(row.key)
    summary: dict[str, Any] = {"layers": 291, "layers_ok": 288}
    summary.update({col: rng.uniform(0.1, 9.0) for col in SUMMARY_FIELDS if col not in summary})
    return Marker(model=row.ref, model_key=row.key, model_id=row.model_id,
                  revision=row.revision, relation=row.relation, parameters=params,
                  layer_count=291, status_counts={"ok": 288, "fit_failed": 3},
                  summary=summary, timings={"total_s": round(rng.uniform(20, 900), 3)},
                  device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
                  finished_at="2026-11-23T07:05:01+00:00")


def controller_end(store: Any, plan: Any, backend: Any, recorder: Any,
                   started: float) -> dict[str, Any]:
    """What `esd-sweep run` does once the backend returns (controller.run.sweep): summary.csv
    from every listed model's marker, the run report, and the CLI's first rows of the
    summary; each timed, with the peak RSS after the summary."""
    from controller.results.summary import KnownMarkers, format_summary_table, write_summary
    from controller.run.runs import run_report, write_run_report
    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.store.tables import MODELS_TABLE, table_prefix

    params = AnalysisSettings().as_dict()
    t0 = time.perf_counter()
    # known: the done markers the plan read; none here (the store was empty at the plan).
    rows = write_summary(store, plan.rows(), parameters=params, known=KnownMarkers())
    t1 = time.perf_counter()
    peak_summary = peak_rss_mib()
    counts = plan.counts
    report = run_report(
        run_id=RUN_ID, started_at="", finished_at="", output=store.url, mode="esd",
        backend=backend.name, backend_report=backend.report(), parameters=params,
        counts={"models": counts.models, "bad_rows": counts.bad_rows,
                "already_done": counts.done, "skipped_failed": counts.skipped_failed},
        tally=recorder, summary_rows=rows, runtime_s=time.perf_counter() - started,
        interrupted=False)
    write_run_report(store, RUN_ID, report)
    t2 = time.perf_counter()
    table = format_summary_table(store)
    t3 = time.perf_counter()
    parts = sum(1 for _ in store.list_keys(table_prefix(MODELS_TABLE)))
    return {"summary_rows": rows, "table_parts": parts,
            "summary_mib": round(store.root.joinpath("summary.csv").stat().st_size / 2**20),
            "summary_s": round(t1 - t0, 1), "report_s": round(t2 - t1, 1),
            "table_s": round(t3 - t2, 1), "peak_rss_after_summary_mib": round(peak_summary),
            "table_last_line": table.splitlines()[-1]}

def _cluster(url_file: str, store_dir: str, stop_file: str) -> None:
    """The child: KubeSim + IndexedJobSimulator whose pods write their shard's markers."""
    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.models.modellist import read_model_list
    from esd_worker.core.store.layout import marker_key
    from esd_worker.core.store.marker import canonical_parameters
    from esd_worker.core.store.opener import open_store
    from esd_worker.core.store.tables import DoneModel, write_parts
    from tests.support.indexed import IndexedJobSimulator
    from tests.support.kubesim import KubeSim
    from tests.support.shardworker import shard_url

    params = canonical_parameters(AnalysisSettings().as_dict())
    store = open_store(store_dir)

    def worker(job: dict[str, Any], index: int, attempt: int) -> str:
        done = []
        for row in read_model_list(f"{shard_url(job)}/{index}.csv").rows:
            marker = done_marker(row, params)
            store.put_bytes(marker_key(row.key), marker.to_json())
            done.append(DoneModel(marker, []))
            if len(done) >= PART_MODELS:  # as a worker's TableWriter: a part every so many
                write_parts(store, done)
                done = []
        if done:
            write_parts(store, done)
        return "succeed"

    with KubeSim(validate=False, keep_history=False, event_window=5000) as sim:
        Path(url_file).write_text(sim.url)
        indexed = IndexedJobSimulator(sim, namespace=NS)
        indexed.start_autopilot(worker, interval_s=0.05)
        try:
            while not Path(stop_file).exists() and indexed._error is None:
                time.sleep(0.2)
        finally:
            try:
                indexed.stop_autopilot()
            except RuntimeError as e:  # the parent sees the file and stops waiting
                Path(stop_file + ".error").write_text(repr(e.__cause__))
                raise
        counts = {f"{verb} {resource}": n for (verb, resource), n in sim.emulator.counts.items()}
        Path(stop_file + ".counts").write_text(json.dumps(counts))


def _watch(child: Any, stop_file: str, backend: Any) -> None:
    """Stop the controller when the simulated cluster dies (its error goes to stderr)."""
    import threading

    def watch() -> None:
        while child.is_alive():
            time.sleep(1)
        if not Path(stop_file).exists():
            print("the simulated cluster died", file=sys.stderr)
            backend.request_stop()

    threading.Thread(target=watch, daemon=True).start()


def phase_run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    import multiprocessing as mp

    from kubernetes import client as k8s

    from controller.backends.base import Task, WorkerSpec
    from controller.backends.kubernetes.common.client import KubeClient
    from controller.backends.kubernetes.common.settings import ClusterSettings, sweep_instance
    from controller.backends.kubernetes.sharded.backend import ShardedBackend
    from controller.backends.kubernetes.sharded.plan import default_classes
    from controller.results import summary  # noqa: F401 (loaded now: the end's code is
    from controller.run import runs  # noqa: F401     the code as this run started)
    from controller.run.plan import ListPlan
    from controller.run.recorder import Recorder
    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.models.modellist import ListFile
    from esd_worker.core.store.opener import open_store

    listing = work_dir / "models.csv"
    write_list(listing, args.rows)
    # On disk: 2M markers are 4M inodes (a folder and a file each), more than a tmpfs has.
    store_dir = Path(tempfile.mkdtemp(prefix="esd-atlas-", dir=args.store_dir))
    url_file, stop_file = str(work_dir / "url"), str(work_dir / "stop")
    child = mp.get_context("spawn").Process(target=_cluster,
                                            args=(url_file, str(store_dir), stop_file))
    child.start()
    try:
        while not Path(url_file).exists():
            time.sleep(0.1)
        config = k8s.Configuration()
        config.host = Path(url_file).read_text()
        store = open_store(str(store_dir))
        settings = ClusterSettings(namespace=NS, image="ghcr.io/example/esd-sweep:0.1.0",
                                   telemetry=False, max_parallel=args.gpus,
                                   poll_interval_s=args.poll, allow_local_output=True)
        spec = WorkerSpec(run_id=RUN_ID, store_url=store.url)
        rss0 = peak_rss_mib()
        started, cpu0 = time.perf_counter(), time.process_time()
        with KubeClient(config) as kube:
            source = ListFile(listing)
            plan = ListPlan(source.items, store, AnalysisSettings().as_dict()).scan()

            class Work:
                def __len__(self) -> int:
                    return plan.counts.todo

                def __iter__(self) -> Any:
                    return (Task.for_model(row) for row in plan.todo())

            backend = ShardedBackend(
                settings, kube, spec=spec, store=store, size=sizes, poll_s=args.poll,
                job_settings=settings.job_settings(
                    run_id=RUN_ID, instance=sweep_instance(store.url), gpus_per_job=1,
                    worker=spec.invocation()),
                classes=default_classes(device="cuda", gpus_per_job=1, large_bytes=30 * GB))
            planned = time.perf_counter()
            peak_planned = peak_rss_mib()
            recorder = Recorder(store, RUN_ID)
            _watch(child, stop_file, backend)
            outcomes = backend.run(Work(), recorder)
            requests = kube.requests
            ran = time.perf_counter()
            peak_ran = peak_rss_mib()
            end = controller_end(store, plan, backend, recorder, started)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        peak = peak_rss_mib()  # before the clean-up below, which is not the controller's
    finally:
        Path(stop_file).touch()
        child.join(60)
        # Not shutil.rmtree: it lists a folder's entries into memory, 2M of them at the
        # store's root, and would be the biggest thing this process ever held.
        subprocess.run(["rm", "-rf", "--", str(store_dir)], check=False)
    counts = json.loads(Path(stop_file + ".counts").read_text())
    created = sum(n for k, n in counts.items() if k.startswith("create ") and k != "create pods"
                  and k != "create events")
    return {
        "rows": args.rows, "gpus": args.gpus, "poll_s": args.poll,
        "done": recorder.done_count, "failed": len(recorder.failed),
        "failed_outcomes_returned": len(outcomes),
        "objects_created_by_controller": created, "server_counts": counts,
        "controller_requests": requests,
        "requests_per_s": round(requests / (ran - started), 3),
        "polls": counts.get("list jobs", 0),
        "wall_s": round(wall, 1), "plan_s": round(planned - started, 1),
        "run_s": round(ran - planned, 1), "end": end,
        "cpu_s": round(cpu, 1), "peak_rss_mib": round(peak),
        "peak_rss_after_plan_mib": round(peak_planned),
        "peak_rss_after_run_mib": round(peak_ran), "rss_before_mib": round(rss0),
        "jobs": backend.report()["kubernetes"]["jobs"],
    }


# -- phase s3 ------------------------------------------------------------------------------


def phase_s3(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    from controller.run.plan import ListPlan
    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.models.modellist import ListFile, ModelRow, iter_model_list
    from esd_worker.core.store.opener import open_store

    listing = work_dir / "models.csv"
    write_list(listing, args.s3_rows)
    keys = work_dir / "keys.txt"
    with open(keys, "w") as f:  # the first --s3-markers models are done
        rows = (item for item in iter_model_list(listing) if isinstance(item, ModelRow))
        for row in itertools.islice(rows, args.s3_markers):
            f.write(row.key + "\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.s3server", "--bucket", "atlas",
         "--seed-markers", str(keys), "--seed-prefix", "out"],
        cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    env: dict[str, str] = {}
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            env[name] = value.strip("'\"")
        if line.startswith("# serving"):
            break
    os.environ.update(env)
    try:
        store = open_store("s3://atlas/out")
        rss0 = peak_rss_mib()
        started = time.perf_counter()
        plan = ListPlan(ListFile(listing).items, store, AnalysisSettings().as_dict(),
                        verify_limit=0).scan()
        elapsed = time.perf_counter() - started
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    pages = math.ceil(args.s3_markers / 1000)
    return {"rows": args.s3_rows, "markers": args.s3_markers, "verify_limit": 0,
            "rss_before_mib": round(rss0), "done": plan.counts.done,
            "todo": plan.counts.todo, "scan_s": round(elapsed, 1), "list_pages": pages,
            "s_per_page": round(elapsed / max(pages, 1), 3),
            "peak_rss_mib": round(peak_rss_mib())}


PHASES = {"plan": phase_plan, "run": phase_run, "s3": phase_s3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--poll", type=float, default=2.0, help="controller poll interval, s")
    parser.add_argument("--store-dir", default=None,
                        help="where the run's store goes (default: the temp dir; 2M markers "
                        "need 4M inodes)")
    parser.add_argument("--s3-rows", type=int, default=1_000_000)
    parser.add_argument("--s3-markers", type=int, default=100_000)
    parser.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.phase == "all":  # each phase in its own process: its own peak RSS
        results = {}
        for phase in PHASES:
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--phase", phase,
                                   "--json", "/dev/stdout"], capture_output=True, text=True,
                                  cwd=ROOT, check=False)
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                return done.returncode
            results[phase] = json.loads(done.stdout)
    else:
        with tempfile.TemporaryDirectory(prefix="esd-atlas-") as tmp:
            results = PHASES[args.phase](args, Path(tmp))
    doc = {"machine": machine(), "results": results}
    text = json.dumps(doc, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if str(args.json) != "/dev/stdout":
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
