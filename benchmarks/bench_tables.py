"""Benchmark: the results commands on a synthetic atlas-scale store (issue 30).

For 10k and 100k models (100 layers each) in a local store and 20k models in moto S3 over
HTTP (a server process of its own, `python -m tests.support.s3server`), times and peak RSS of
`esd-sweep compact`, `esd-sweep report`, `esd-sweep status` and summary.csv
(controller.results.summary.write_summary from a tiny driver: the model list read, then
write_summary(store, rows)). Each command runs in a subprocess of its own; its peak RSS is
that child's ru_maxrss (os.wait4). A command this tree does not have yet prints "not
available". The stores are written by tests/support/synthstore.py (parts only; per-model
files for 1 model in 100, for the fallback). Targets: report and summary <= 2 min at 100k,
peak RSS <= 1 GiB. Owns only the measuring, not the generator.

Run: `.venv/bin/python benchmarks/bench_tables.py [--sizes 10000,100000] [--s3 20000]
[--out bench_tables.md] [--work DIR]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.synthstore import SynthSpec, models_csv  # noqa: E402

PY = sys.executable
ESD = str(Path(PY).with_name("esd-sweep"))
BUCKET = "esd-bench"
SUMMARY_DRIVER = """
import sys
from esd_worker.core.models.modellist import read_model_list
from esd_worker.core.store.opener import open_store
from controller.results.summary import write_summary
store = open_store(sys.argv[1])
print(write_summary(store, read_model_list(sys.argv[2]).rows))
"""


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    return f"{os.cpu_count()} CPUs (nproc), {cpu}, {mem / 2**20:.0f} GiB RAM"


def timed(argv: list[str], env: dict[str, str] | None = None, timeout: float = 900
          ) -> tuple[int, float, float, str]:
    """(exit code, seconds, peak RSS MiB of the child, output tail)."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        out.seek(0)
        tail = out.read().decode(errors="replace")[-400:]
    return proc.returncode, seconds, usage.ru_maxrss / 1024, tail


def available(command: str) -> bool:
    return subprocess.run([ESD, command, "--help"], capture_output=True).returncode == 0


def commands(url: str, models: Path, report_out: str) -> list[tuple[str, list[str]]]:
    return [
        ("compact", [ESD, "compact", "--output-dir", url]),
        ("summary", [PY, "-c", SUMMARY_DRIVER, url, str(models)]),
        ("report", [ESD, "report", "--output-dir", url, "--out", report_out,
                    "--max-model-plots", "50"]),
        ("status", [ESD, "status", "--output-dir", url, "--model-list", str(models)]),
    ]


def bench_store(url: str, n: int, work: Path, env: dict[str, str] | None, where: str
                ) -> list[str]:
    spec = SynthSpec(models=n, layers=100)
    models = work / f"models-{where}-{n}.csv"
    models.write_bytes(models_csv(spec))
    rc, secs, rss, tail = timed([PY, "benchmarks/synth_store.py", url, "--models", str(n),
                                 "--untabled-every", "100", "--failures", "200"], env)
    rows = [f"| synth_store (write) | {where} | {n:,} | {secs:.1f} | {rss:.0f} | |"]
    if rc:
        raise SystemExit(f"synth_store failed: {tail}")
    print(rows[-1], flush=True)
    report_out = str(work / f"report-{where}-{n}")
    for name, argv in commands(url, models, report_out):
        if name != "summary" and not available(name):
            rows.append(f"| {name} | {where} | {n:,} | not available | | |")
        else:
            rc, secs, rss, tail = timed(argv, env)
            note = "" if rc == 0 else f"exit {rc}: {tail.strip().splitlines()[-1][:80]}"
            rows.append(f"| {name} | {where} | {n:,} | {secs:.1f} | {rss:.0f} | {note} |")
        print(rows[-1], flush=True)
    return rows


def s3_env(work: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    server = subprocess.Popen([PY, "-m", "tests.support.s3server", "--bucket", BUCKET],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    env = dict(os.environ)
    for line in server.stdout:
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            env[name] = value
        elif line.startswith("#"):
            break
    return server, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--s3", type=int, default=20000, help="models in moto S3 (0: skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_tables.md")
    parser.add_argument("--work", type=Path)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-tables-"))
    rows = ["| command | store | models | seconds | peak RSS MiB | note |",
            "|---|---|---:|---:|---:|---|"]
    print("\n".join(rows), flush=True)
    try:
        for n in [int(s) for s in args.sizes.split(",") if s]:
            store = work / f"store-{n}"
            shutil.rmtree(store, ignore_errors=True)
            rows += bench_store(str(store), n, work, None, "local")
            shutil.rmtree(store, ignore_errors=True)
        if args.s3:
            server, env = s3_env(work)
            try:
                rows += bench_store(f"s3://{BUCKET}/atlas", args.s3, work, env, "moto S3")
            finally:
                server.kill()
                server.wait()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(rows) + f"\n\nMachine: {machine()}\n"
    args.out.write_text(text)
    print(f"\nMachine: {machine()}\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
