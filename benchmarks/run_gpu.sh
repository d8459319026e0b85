#!/usr/bin/env bash
# The GPU part of the worker's benchmark and checks, for one machine with one or more CUDA GPUs.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; results go to $OUT (default .bench/out)
#   STEPS="2 7" bash benchmarks/run_gpu.sh   # only the steps named (default: 1 8, ~8 minutes)
#   STEPS=all bash benchmarks/run_gpu.sh     # every step, 1 to 8 (two 10-minute calls: 1-6, 7 8)
#   SMOKE=1 bash benchmarks/run_gpu.sh       # step 8 on the CPU, a small checkpoint (no GPU)
#
# Needs python3 with torch (CUDA), transformers, accelerate, safetensors, numpy, pytest and
# nvidia-ml-py; no network and no install: the repo is put on PYTHONPATH and the worker is
# started as `python3 -m esd_worker.cli` (no console script needed). Steps 1-6 take ~6-7
# minutes on an H100 box (16 cores), under 9 minutes; step 7 alone fits one 10-minute call
# (STEPS=7). Steps 5 and 6 use the checkpoint step 4 writes to $CKPT (written if missing).
#   1. versions and the GPU;
#   2. correctness on the GPU: float32 Gram + eigvalsh on CUDA vs float64 SVD (4096×4096 and
#      11008×4096; Gaussian and heavy-tailed spectra): max relative error of the top 500
#      eigenvalues (docs/metrics.md: < 1e-6) and the α differences; plus kernel timings;
#   3. tests/esd_worker/test_spectra.py, if present, with pytest (CUDA visible);
#   4. bench_worker.py on the Llama-2-7B shape (checkpoint written to $CKPT on local disk):
#      the worker end to end vs the whole-model svdvals baseline (its SVD loop capped at
#      $BASELINE_MAX_S seconds, the rest extrapolated per shape, as the JSON says);
#   5. the worker once more after dropping the page cache (cold reads), when allowed;
#   6. bench_sweep_gpu.py: ten 7B-shaped models through `esd-sweep run` (long-lived workers,
#      models/hour, the workers' peak resident memory) and --precision float64 vs float32;
#   7. bench_multi_gpu.py: an 8192-hidden Llama-shaped checkpoint (written to $MULTI_CKPT)
#      analysed on one GPU and on every visible GPU (identical outputs, scaling t1/(tN×N),
#      target ≥ 0.85, peak memory per GPU), eigvalsh/Gram timings at 8192² and 16384², and
#      the peak memory of one 16384-wide layer against the worker's estimate.
#   8. bench_feed.py (issue 31): a long-lived worker over three links to the 7B checkpoint
#      with host eigensolvers on (auto) and off (0): seconds a model in the steady state,
#      models/hour, layers the host solved, peak host and GPU memory; a cold --model; and
#      |Δα|/α of every layer against float64 (the old float32 eigensolver, the worker's
#      float64 solve on the device and on the host). ~6 minutes on an H100 with the
#      checkpoint written, ~7 without.
#   9. bench_watch_gpu.py (issue 33): one shard pod (`esd-worker --shards`, supervisor and
#      child) over four 8-block Llama-shaped models with its progress document polled as
#      the controller reads it, NVML's utilisation sampled beside it (the document's
#      device-busy share against the GPU's own), and `esd-sweep run --metrics-port` scraped
#      over HTTP while it runs. ~1-2 minutes. SMOKE9=1: the same on the CPU, tiny models.
# Every result lands in $OUT: gpu_checks.json, pytest_spectra.txt, bench_worker.json,
# bench_worker_cold.json, bench_sweep_gpu.json, bench_multi_gpu.json, bench_feed.json and
# the logs.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.bench/out}
CKPT=${CKPT:-/tmp/esd-bench/llama7b}
BASELINE_MAX_S=${BASELINE_MAX_S:-180}
MULTI_CKPT=${MULTI_CKPT:-/tmp/esd-bench/llama8192}
STEPS=${STEPS:-1 8}
[ "$STEPS" = all ] && STEPS="1 2 3 4 5 6 7 8"
if [ -n "${SMOKE:-}" ]; then  # the CPU: step 8's code paths on a small checkpoint
  STEPS=8 CKPT=${SMOKE_CKPT:-/tmp/esd-bench/tiny}
fi
if [ -n "${SMOKE9:-}" ]; then STEPS=9; fi  # the CPU: step 9 on tiny models
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
START=$SECONDS
step() { echo; echo "== [$((SECONDS - START))s] $*"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }  # is step $1 among those asked for?

if want 1; then
step "1. versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import importlib.metadata as md, os, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
print("cpus", os.cpu_count())
for d in ("transformers", "accelerate", "safetensors", "numpy", "huggingface_hub", "peft",
          "nvidia-ml-py", "pytest"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
import esd_worker.analysis.analyze  # noqa: F401  (fails here, not in the benchmark, if an import is missing)
print("esd_worker importable from", esd_worker.analysis.analyze.__file__)
EOF
fi

if want 2; then
step "2. float32 Gram on CUDA vs float64 SVD"
"$PY" - "$OUT/gpu_checks.json" <<'EOF' 2>&1 | tee "$OUT/gpu_checks.log"
"""Top-500 relative error of the worker's float32 path on CUDA against float64 SVD, and timings."""
import json, sys, time
import numpy as np
import torch
from esd_worker.core.powerlaw import layer_metrics
from esd_worker.analysis.spectra import compute_spectrum

torch.backends.cuda.matmul.allow_tf32 = False  # as the worker sets it
dev = torch.device("cuda:0")
gen = torch.Generator(device=dev).manual_seed(0)

def gaussian(m, n):
    return (torch.randn(m, n, generator=gen, device=dev, dtype=torch.float64) * 0.02)

def heavy_tailed(m, n):
    """U diag(s) Vᵀ with Pareto(α=2.5)-like singular values: a trained layer's kind of tail."""
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, device=dev, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, device=dev, dtype=torch.float64))
    r = torch.rand(k, generator=gen, device=dev, dtype=torch.float64)
    lam = 0.05 * (1 - r) ** (-1 / 1.5)  # eigenvalues λ = s² with density ∝ λ^-2.5
    return (u * lam.sqrt()) @ v.T

def timed(fn, reps=3):
    fn(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter(); fn(); torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best

report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cases": []}
for shape in [(4096, 4096), (11008, 4096)]:
    for kind, make in [("gaussian", gaussian), ("heavy_tailed", heavy_tailed)]:
        w = make(*shape).to(torch.bfloat16)  # the weights are bf16, as in the benchmark
        ref = np.sort(torch.linalg.svdvals(w.double()).square().cpu().numpy())
        got = compute_spectrum(w, "Linear", precision="float32").evals  # the worker's path
        # Candidate: the same float32 Gram, its eigenvalues in float64 (on the CPU the
        # float32 eigensolver, not the Gram, is what loses accuracy: ~5e-5 at n = 4096).
        w32 = w.float()
        gram = w32.T @ w32 if shape[0] >= shape[1] else w32 @ w32.T
        alt = np.sort(torch.linalg.eigvalsh(gram.double()).clamp_min(0).cpu().numpy())
        top = slice(-500, None)
        case = {"shape": list(shape), "kind": kind, "lambda_max": float(ref[-1]),
                "lambda_min": float(ref[0])}
        for label, lam in (("f32gram_f32eig", got), ("f32gram_f64eig", alt)):
            rel = np.abs(lam[top] - ref[top]) / ref[top]
            case[f"top500_max_rel_err_{label}"] = float(rel.max())
            case[f"max_abs_err_over_lmax_{label}"] = float(np.max(np.abs(lam - ref)) / ref[-1])
            for ff in ("xmin_mid", "DKS"):
                a = layer_metrics(lam, max_dim=max(shape), fix_fingers=ff)["alpha"]
                a64 = layer_metrics(ref, max_dim=max(shape), fix_fingers=ff)["alpha"]
                case[f"alpha_{ff}_float64"] = a64
                case[f"alpha_{ff}_rel_diff_{label}"] = abs(a - a64) / abs(a64)
        report["cases"].append(case)
        print(json.dumps(case))

# Kernel timings behind the worker's speed (best of 3, seconds).
timings = {}
for m, n in [(4096, 4096), (11008, 4096), (32000, 4096)]:
    w = gaussian(m, n).float()
    g = w.T @ w
    timings[f"gram_{m}x{n}"] = timed(lambda: w.T @ w)
    if f"eigvalsh_f32_{n}x{n}" not in timings:
        timings[f"eigvalsh_f32_{n}x{n}"] = timed(lambda: torch.linalg.eigvalsh(g), reps=2)
        g64 = g.double()
        timings[f"eigvalsh_f64_{n}x{n}"] = timed(lambda: torch.linalg.eigvalsh(g64), reps=2)
    timings[f"svdvals_f32_{m}x{n}"] = timed(lambda: torch.linalg.svdvals(w), reps=1)
for lib in ("cusolver", "magma"):
    try:
        torch.backends.cuda.preferred_linalg_library(lib)
        g = gaussian(4096, 4096).float(); g = g.T @ g
        timings[f"eigvalsh_4096_{lib}"] = timed(lambda: torch.linalg.eigvalsh(g))
    except Exception as e:  # magma may not be built in
        timings[f"eigvalsh_4096_{lib}"] = f"unavailable: {e}"
torch.backends.cuda.preferred_linalg_library("default")
report["timings_s"] = timings
report["spec_bound"] = 1e-6
for label in ("f32gram_f32eig", "f32gram_f64eig"):
    worst = max(c[f"top500_max_rel_err_{label}"] for c in report["cases"])
    report[f"top500_max_rel_err_{label}"] = worst
    print(f"top-500 max relative error, {label}: {worst:.3e} (spec < 1e-6): "
          f"{'OK' if worst < 1e-6 else 'ABOVE THE SPEC'}")
report["ok"] = report["top500_max_rel_err_f32gram_f32eig"] < 1e-6  # the worker's path
print(json.dumps(timings, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(report, f, indent=2)
EOF
fi

if want 3; then
step "3. tests/esd_worker/test_spectra.py on the GPU machine"
if [ -f tests/esd_worker/test_spectra.py ]; then
  set +e
  "$PY" -m pytest -q -p no:cacheprovider tests/esd_worker/test_spectra.py 2>&1 | tee "$OUT/pytest_spectra.txt"
  echo "pytest exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_spectra.txt"
  set -e
else
  echo "tests/esd_worker/test_spectra.py not present: skipped" | tee "$OUT/pytest_spectra.txt"
fi
fi

if want 4; then
step "4. bench_worker.py: Llama-2-7B shape, worker vs baseline"
"$PY" benchmarks/bench_worker.py --out "$CKPT" --device cuda \
  --worker-cmd "$PY -m esd_worker.cli" --baseline-max-s "$BASELINE_MAX_S" \
  --json "$OUT/bench_worker.json" 2>&1 | tee "$OUT/bench_worker.log"
fi

if want 5; then
step "5. the worker again with a cold page cache"
if sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
  "$PY" benchmarks/bench_worker.py --out "$CKPT" --device cuda --skip-baseline \
    --worker-cmd "$PY -m esd_worker.cli" \
    --json "$OUT/bench_worker_cold.json" 2>&1 | tee "$OUT/bench_worker_cold.log"
else
  echo "cannot drop the page cache here: cold run skipped"
fi
fi

if want 6; then
if [ ! -f "$CKPT/bench_spec.json" ]; then  # step 4's checkpoint, when step 4 did not run
  "$PY" - "$CKPT" <<'EOF'
import sys
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from checkpoint_7b import write_checkpoint
write_checkpoint(Path(sys.argv[1]), blocks=32, hidden=4096, intermediate=11008, vocab=32000,
                 seed=0, shard_mb=2000, device=torch.device("cuda:0"))
EOF
fi
step "6. bench_sweep_gpu.py: ten 7B-shaped models through esd-sweep run; float64 vs float32"
"$PY" benchmarks/bench_sweep_gpu.py --ckpt "$CKPT" --models "${SWEEP_MODELS:-10}" \
  --json "$OUT/bench_sweep_gpu.json" 2>&1 | tee "$OUT/bench_sweep_gpu.log"
fi

if want 7; then
step "7. bench_multi_gpu.py: one 8192-hidden model on 1 GPU and on all; kernels at 8192², 16384²"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
set +e  # exit 1 means the outputs differed: keep the JSON and the rest of the run
"$PY" benchmarks/bench_multi_gpu.py --out "$MULTI_CKPT" --device cuda \
  --json "$OUT/bench_multi_gpu.json" 2>&1 | tee "$OUT/bench_multi_gpu.log"
echo "bench_multi_gpu exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_multi_gpu.log"
set -e
fi

if want 8; then
step "8. bench_feed.py: host eigensolvers on and off, a cold --model, accuracy of every layer"
if [ -n "${SMOKE:-}" ]; then
  "$PY" benchmarks/bench_feed.py --ckpt "$CKPT" --device cpu --models 2 \
    --host-eigensolvers 1,0 --blocks 8 --hidden 256 --intermediate 688 --vocab 1000 \
    --json "$OUT/bench_feed.json" 2>&1 | tee "$OUT/bench_feed.log"
else
  "$PY" benchmarks/bench_feed.py --ckpt "$CKPT" --device cuda --models 3 \
    --json "$OUT/bench_feed.json" 2>&1 | tee "$OUT/bench_feed.log"
fi
fi


if want 9; then
step "9. bench_watch_gpu.py: a shard pod's progress document and the run's /metrics on the GPU"
if [ -n "${SMOKE9:-}" ]; then
  "$PY" benchmarks/bench_watch_gpu.py --device cpu --models 2 --blocks 2 --hidden 256 \
    --intermediate 688 --vocab 1000 --ckpt /tmp/esd-bench/watch-tiny \
    --json "$OUT/bench_watch_gpu.json" 2>&1 | tee "$OUT/bench_watch_gpu.log"
else
  "$PY" benchmarks/bench_watch_gpu.py --device cuda --json "$OUT/bench_watch_gpu.json" \
    2>&1 | tee "$OUT/bench_watch_gpu.log"
fi
fi

step "done; results in $OUT"
ls -l "$OUT"
