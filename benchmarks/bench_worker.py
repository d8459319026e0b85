"""Benchmark: the worker end to end vs the old scripts' way, on a Llama-2-7B-shaped checkpoint.

Writes (or reuses) a random bf16 checkpoint shaped like Llama-2-7B (32 blocks: q,k,v,o
4096×4096; gate, up 11008×4096; down 4096×11008; embed_tokens and lm_head 32000×4096;
norms), sharded safetensors with model.safetensors.index.json and a Llama-2-7B
config.json, tensor by tensor so host memory stays at one shard. Then, in one run:

  (a) worker: `esd-worker --model DIR --output TMP --device D` as a subprocess, default
      settings (xmin_mid, float32 Gram path, eigs.npz on), wall time as users see it;
      its own timings and peak GPU memory come from its result.json;
  (b) baseline, the way the old scripts did it: load the whole model
      (AutoModelForCausalLM.from_pretrained, bf16, onto the device), then for every
      nn.Linear `torch.linalg.svdvals(W.float())²` and the same fit
      (esd_worker.powerlaw.layer_metrics), so only loading and linear algebra differ.

and checks the two agree: same layers, alphas within --alpha-rtol.

  python benchmarks/bench_worker.py --json bench.json                  # the 7B run (GPU)
  python benchmarks/bench_worker.py --blocks 2 --hidden 512 --intermediate 1376 \
      --vocab 4000 --device cpu                                        # CPU smoke run

Targets on one H100 (issue 2): worker ≤ 30 s end to end, peak GPU memory ≤ 2 GiB,
≥ 8× faster than the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPEC_FILE = "bench_spec.json"
INDEX_FILE = "model.safetensors.index.json"
SCALE = 0.02  # std of the random weights, as Llama's initializer_range
TARGET_WORKER_S = 30.0
TARGET_PEAK_GPU_MIB = 2048.0
TARGET_SPEEDUP = 8.0


# --- the checkpoint ------------------------------------------------------------------------


def tensor_plan(
    *, blocks: int, hidden: int, intermediate: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor of a LlamaForCausalLM, in the order HF writes them."""
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(blocks):
        p = f"model.layers.{i}."
        plan += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    plan += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return plan


def shard_plan(
    plan: list[tuple[str, tuple[int, ...]]], shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of about shard_bytes (bf16: 2 bytes a value)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for key, shape in plan:
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    return shards


def _heads(hidden: int) -> int:
    """32 heads as Llama-2-7B when they divide hidden_size, else the most that do."""
    return next(h for h in (32, 16, 8, 4, 2, 1) if hidden % h == 0)


def write_config(out: Path, *, blocks: int, hidden: int, intermediate: int, vocab: int) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=blocks,
        num_attention_heads=_heads(hidden),
        num_key_value_heads=_heads(hidden),
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = "bfloat16"  # what from_pretrained reads as the checkpoint's dtype
    config.save_pretrained(out)


def _random_bf16(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """N(0, SCALE²) in bf16 on `device`, reproducible per seed; norms get ones elsewhere."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        # randn straight into bf16 on the GPU: ~6.7e9 values in about a second.
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        return t.mul_(SCALE)
    t32 = torch.randn(shape, generator=gen, dtype=torch.float32)
    return t32.mul_(SCALE).to(torch.bfloat16)


def write_checkpoint(
    out: Path,
    *,
    blocks: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    seed: int,
    shard_mb: int,
    device: torch.device,
) -> dict[str, Any]:
    """Write (or reuse, when bench_spec.json matches) the random checkpoint; returns its facts."""
    from safetensors.torch import save_file

    spec = {
        "blocks": blocks,
        "hidden": hidden,
        "intermediate": intermediate,
        "vocab": vocab,
        "seed": seed,
        "shard_mb": shard_mb,
        "scale": SCALE,
        "dtype": "bfloat16",
    }
    plan = tensor_plan(blocks=blocks, hidden=hidden, intermediate=intermediate, vocab=vocab)
    shards = shard_plan(plan, shard_mb * 2**20)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(2 * int(np.prod(shape)) for _, shape in plan)
    facts = {
        "dir": str(out),
        "tensors": len(plan),
        "shards": len(shards),
        "bytes": total,
        "params": total // 2,
    }
    spec_path = out / SPEC_FILE
    if (
        spec_path.is_file()
        and json.loads(spec_path.read_text()) == spec
        and all((out / n).is_file() for n in [*names, INDEX_FILE, "config.json"])
    ):
        return facts | {"reused": True, "write_s": 0.0}

    out.mkdir(parents=True, exist_ok=True)
    spec_path.unlink(missing_ok=True)  # marks the directory incomplete until the end
    t0 = time.perf_counter()
    write_config(out, blocks=blocks, hidden=hidden, intermediate=intermediate, vocab=vocab)
    weight_map: dict[str, str] = {}
    index = 0
    # One thread writes shard k while the main thread generates shard k+1: the disk and the
    # generator overlap, and at most two shards live in host memory.
    writer: threading.Thread | None = None
    errors: list[BaseException] = []

    def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
        try:
            save_file(tensors, str(path), metadata={"format": "pt"})
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    for name, shard in zip(names, shards, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for key, shape in shard:
            if len(shape) == 1:
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = _random_bf16(shape, seed + index, device).cpu()
            weight_map[key] = name
            index += 1
        if writer is not None:
            writer.join()
        if errors:
            raise errors[0]
        writer = threading.Thread(target=_save, args=(tensors, out / name))
        writer.start()
        del tensors
    if writer is not None:
        writer.join()
    if errors:
        raise errors[0]
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    spec_path.write_text(json.dumps(spec, indent=2))
    return facts | {"reused": False, "write_s": round(time.perf_counter() - t0, 2)}


# --- (a) the worker ------------------------------------------------------------------------


class GpuSampler:
    """Device memory in use (NVML, MiB) sampled every 20 ms: the whole process's footprint,
    CUDA context included, which torch.cuda.max_memory_allocated does not count."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self.idle_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.idle_mib = self._used()
        except Exception:  # no NVML, no GPU, or a UUID in CUDA_VISIBLE_DEVICES: no sampling
            self._nvml = None

    def _used(self) -> float:
        return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            used = self._used()
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def delta_mib(self) -> float | None:
        if self.peak_mib is None or self.idle_mib is None:
            return None
        return round(self.peak_mib - self.idle_mib, 1)


def run_worker(model_dir: Path, *, worker_cmd: list[str], device: str) -> dict[str, Any]:
    """The worker as users run it, default settings; its wall time and result.json."""
    with tempfile.TemporaryDirectory(prefix="esd-bench-") as out:
        cmd = [*worker_cmd, "--model", str(model_dir), "--output", out, "--device", device]
        with GpuSampler() as sampler:
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"worker failed with exit code {proc.returncode}: {shlex.join(cmd)}")
        markers = list(Path(out).glob("*/result.json"))
        if len(markers) != 1:
            raise SystemExit(f"expected one result.json under {out}, found {len(markers)}")
        marker = json.loads(markers[0].read_text())
        rows = _read_layers(markers[0].parent / "layers.csv")
        eigs_path = markers[0].parent / "eigs.npz"
        eigs: dict[str, np.ndarray] = {}
        if eigs_path.is_file():
            with np.load(eigs_path) as npz:
                eigs = {name: npz[name] for name in npz.files}
    return {
        "cmd": shlex.join(cmd),
        "wall_s": round(wall, 3),
        "timings": marker.get("timings"),
        "device": marker.get("device"),
        "layer_count": marker.get("layer_count"),
        "status_counts": marker.get("status_counts"),
        "nvml_peak_delta_mib": sampler.delta_mib(),
        "rows": rows,
        "eigs": eigs,
    }


def _read_layers(path: Path) -> dict[str, dict[str, str]]:
    import csv

    with path.open(newline="") as f:
        return {row["layer"]: row for row in csv.DictReader(f)}


# --- (b) the baseline ----------------------------------------------------------------------


def _linear_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield name, module


def run_baseline(model_dir: Path, *, device: torch.device, max_s: float | None) -> dict[str, Any]:
    """Load everything onto the device, then svdvals per nn.Linear, as the old scripts did.

    With max_s, the SVD loop stops once it has run that long and the remaining layers'
    time is extrapolated from the measured mean of layers of the same shape (reported as
    such). One layer of every shape goes first so every shape has a measurement.
    """
    from transformers import AutoModelForCausalLM

    from esd_worker.powerlaw import layer_metrics

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, device_map=str(device)
    )
    model.eval()
    sync()
    t_load = time.perf_counter() - t0

    layers = list(_linear_layers(model))
    first_of_shape: dict[tuple[int, ...], int] = {}
    for i, (_, module) in enumerate(layers):
        first_of_shape.setdefault(tuple(module.weight.shape), i)
    firsts = set(first_of_shape.values())
    order = sorted(firsts) + [i for i in range(len(layers)) if i not in firsts]
    rows: dict[str, dict[str, Any]] = {}
    eigs: dict[str, np.ndarray] = {}
    per_shape: dict[tuple[int, ...], list[float]] = {}
    t_svd0 = time.perf_counter()
    with torch.no_grad():
        for i in order:
            name, module = layers[i]
            shape = tuple(module.weight.shape)
            if max_s is not None and time.perf_counter() - t_svd0 > max_s:
                break
            t = time.perf_counter()
            w = module.weight.data.clone().float()
            evals = torch.linalg.svdvals(w).square()
            lam = np.sort(evals.cpu().double().numpy())
            del w, evals
            rows[name] = layer_metrics(lam, max_dim=max(shape))
            eigs[name] = lam
            per_shape.setdefault(shape, []).append(time.perf_counter() - t)
    sync()
    measured_svd = time.perf_counter() - t_svd0
    missing = [layers[i] for i in order if layers[i][0] not in rows]
    extrapolated = sum(float(np.mean(per_shape[tuple(m.weight.shape)])) for _, m in missing)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "load_s": round(t_load, 3),
        "svd_fit_s": round(measured_svd, 3),
        "layers_total": len(layers),
        "layers_measured": len(rows),
        "svd_fit_extrapolated_s": round(extrapolated, 3),
        "extrapolated": bool(missing),
        "wall_s": round(t_load + measured_svd + extrapolated, 3),
        "per_shape_mean_s": {
            "x".join(map(str, k)): round(float(np.mean(v)), 4) for k, v in per_shape.items()
        },
        "peak_gpu_mib": None if peak is None else round(peak, 1),
        "rows": rows,
        "eigs": eigs,
    }


# --- agreement and report ------------------------------------------------------------------


def compare_alphas(
    worker: tuple[dict[str, dict[str, str]], dict[str, np.ndarray]],
    baseline: tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]],
    *,
    rtol: float,
    evals_thresh: float = 1e-5,
) -> dict[str, Any]:
    """Worker (float32 Gram + eigvalsh) vs baseline (float32 svdvals) α on the same layers.

    Where α differs by more than rtol, the eigenvalues say why: the Gram path's eigenvalues
    carry an absolute error of about eps32·λ_max, so those within that of evals_thresh can
    land on the other side of it; one eigenvalue more or less in the fit moves the median
    (xmin_mid) and α by O(1/n). Such layers are listed with their counts.
    """
    (w_rows, w_eigs), (b_rows, b_eigs) = worker, baseline
    missing = sorted(set(b_rows) - set(w_rows))
    worst_rel, worst_layer = 0.0, None
    bad: list[dict[str, Any]] = []
    top500 = 0.0
    for name, base in b_rows.items():
        row = w_rows.get(name)
        if row is None:
            continue
        a_w, a_b = float(row["alpha"]), float(base["alpha"])
        lam_w, lam_b = w_eigs.get(name), b_eigs.get(name)
        if lam_w is not None and lam_b is not None and lam_w.size == lam_b.size:
            top = slice(-min(500, lam_b.size), None)
            top500 = max(top500, float(np.max(np.abs(lam_w[top] - lam_b[top]) / lam_b[top])))
        if np.isfinite(a_w) and np.isfinite(a_b):
            rel = abs(a_w - a_b) / abs(a_b)
            if rel > worst_rel:
                worst_rel, worst_layer = rel, name
            if rel <= rtol:
                continue
        elif np.isfinite(a_w) == np.isfinite(a_b):
            continue  # both failed to fit
        else:
            rel = float("nan")
        entry: dict[str, Any] = {
            "layer": name,
            "alpha_worker": a_w,
            "alpha_baseline": a_b,
            "rel_diff": rel,
        }
        if lam_w is not None and lam_b is not None:
            entry["n_fit_worker"] = int(np.count_nonzero(lam_w > evals_thresh))
            entry["n_fit_baseline"] = int(np.count_nonzero(lam_b > evals_thresh))
            entry["explained_by_thresh_count"] = entry["n_fit_worker"] != entry["n_fit_baseline"]
        bad.append(entry)
    extra = sorted(n for n, r in w_rows.items() if n not in b_rows and r["layer_type"] == "Linear")
    return {
        "layers_compared": len(b_rows) - len(missing),
        "alpha_rtol": rtol,
        "alpha_max_rel_diff": worst_rel,
        "worst_layer": worst_layer,
        "eigs_top500_max_rel_diff": top500,
        "out_of_tolerance": bad[:20],
        "out_of_tolerance_count": len(bad),
        "missing_in_worker": missing[:20],
        "worker_only_linear": extra[:20],
        "ok": not bad and not missing,
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_mib"] = round(props.total_memory / 2**20)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["torch_threads"] = torch.get_num_threads()
    return info


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def print_report(result: dict[str, Any]) -> None:
    w, b, m = result["worker"], result.get("baseline"), result["machine"]
    where = m.get("gpu") or f"CPU ({m['cpu_count']} cores)"
    ck = result["checkpoint"]
    print(f"\nmachine: {where}; torch {m['torch']}; {m['platform']}")
    how = "reused" if ck["reused"] else f"written in {ck['write_s']} s"
    print(
        f"checkpoint: {ck['params'] / 1e9:.2f}e9 params, {ck['bytes'] / 2**30:.2f} GiB bf16, "
        f"{ck['shards']} shards, {how}"
    )
    lines = [
        ("", "worker", "baseline", "target"),
        (
            "wall time (s)",
            _fmt(w["wall_s"]),
            _fmt(b and b["wall_s"]),
            f"worker <= {TARGET_WORKER_S:g}",
        ),
        ("  of which in-process (s)", _fmt(w["timings"]["total_s"]), "-", ""),
        (
            "peak GPU memory, torch (MiB)",
            _fmt(result["worker_peak_gpu_mib"]),
            _fmt(b and b["peak_gpu_mib"]),
            f"worker <= {TARGET_PEAK_GPU_MIB:g}",
        ),
        ("peak GPU memory, NVML (MiB)", _fmt(w["nvml_peak_delta_mib"]), "-", "incl. context"),
        ("layers", _fmt(w["layer_count"]), _fmt(b and b["layers_total"]), ""),
        (
            "speedup (baseline / worker wall)",
            _fmt(result["speedup"], "x"),
            "",
            f">= {TARGET_SPEEDUP:g}x",
        ),
    ]
    width = max(len(r[0]) for r in lines)
    for r in lines:
        print(f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>10}  {r[3]}")
    if b and b["extrapolated"]:
        print(
            f"baseline: {b['layers_measured']}/{b['layers_total']} layers measured, the rest "
            f"({b['svd_fit_extrapolated_s']} s) extrapolated from per-shape means"
        )
    if "agreement" in result:
        a = result["agreement"]
        print(
            f"alphas: {a['layers_compared']} layers, max rel diff {a['alpha_max_rel_diff']:.2e} "
            f"(tolerance {a['alpha_rtol']:g}) -> {'OK' if a['ok'] else 'MISMATCH'}; "
            f"eigenvalues: top-500 max rel diff {a['eigs_top500_max_rel_diff']:.2e}"
        )
        for e in a["out_of_tolerance"]:
            why = ""
            if e.get("explained_by_thresh_count"):
                why = (
                    f" ({e['n_fit_worker']} vs {e['n_fit_baseline']} eigenvalues above "
                    "evals_thresh: float32 Gram noise at the bottom of the spectrum)"
                )
            print(
                f"  {e['layer']}: alpha {e['alpha_worker']:.6f} vs {e['alpha_baseline']:.6f}{why}"
            )
    print(f"targets met: {result['targets_met']}")


# --- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--blocks", type=int, default=32, help="decoder blocks (default 32)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--intermediate", type=int, default=11008, help="MLP size (default 11008)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=int, default=2000, help="shard size in MiB (default 2000)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(".bench/llama7b"),
        help="checkpoint directory, reused when it matches (default .bench/llama7b)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--worker-cmd",
        default=f"{shlex.quote(sys.executable)} -m esd_worker.cli",
        help="how to start the worker (default: this python -m esd_worker.cli)",
    )
    p.add_argument("--skip-baseline", action="store_true", help="measure the worker only")
    p.add_argument(
        "--baseline-max-s",
        type=float,
        default=None,
        help="stop the baseline's SVD loop after this many seconds and extrapolate "
        "the remaining layers from per-shape means (default: run every layer)",
    )
    p.add_argument(
        "--alpha-rtol",
        type=float,
        default=1e-3,
        help="worker vs baseline alpha tolerance, relative (default 1e-3)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but CUDA is not available")
    device = torch.device("cuda:0" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    worker_device = "cuda" if device.type == "cuda" else "cpu"
    print(f"device: {device}", flush=True)

    ckpt = write_checkpoint(
        args.out,
        blocks=args.blocks,
        hidden=args.hidden,
        intermediate=args.intermediate,
        vocab=args.vocab,
        seed=args.seed,
        shard_mb=args.shard_mb,
        device=device,
    )
    gib = ckpt["bytes"] / 2**30
    if ckpt["reused"]:
        print(f"checkpoint: reusing {args.out} ({gib:.2f} GiB)", flush=True)
    else:
        rate = gib / max(ckpt["write_s"], 1e-9)
        print(
            f"checkpoint: wrote {gib:.2f} GiB to {args.out} in {ckpt['write_s']} s "
            f"({rate:.2f} GiB/s)",
            flush=True,
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the generator's blocks: not ours to count against the worker

    print("worker: running ...", flush=True)
    worker = run_worker(
        args.out.resolve(), worker_cmd=shlex.split(args.worker_cmd), device=worker_device
    )
    print(
        f"worker: {worker['wall_s']} s wall, {worker['timings']['total_s']} s in-process",
        flush=True,
    )
    worker_rows = worker.pop("rows")
    worker_eigs = worker.pop("eigs")

    result: dict[str, Any] = {
        "benchmark": "bench_worker",
        "shape": {
            "blocks": args.blocks,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
        },
        "checkpoint": ckpt,
        "machine": machine_info(device),
        "worker": worker,
        "worker_s": worker["wall_s"],
        "worker_inprocess_s": worker["timings"]["total_s"],
        "worker_peak_gpu_mib": (worker["device"] or {}).get("peak_memory_mib"),
    }
    speedup = None
    if not args.skip_baseline:
        print("baseline: loading the whole model, svdvals per layer ...", flush=True)
        baseline = run_baseline(args.out.resolve(), device=device, max_s=args.baseline_max_s)
        baseline_rows = baseline.pop("rows")
        baseline_eigs = baseline.pop("eigs")
        print(f"baseline: {baseline['wall_s']} s (load {baseline['load_s']} s)", flush=True)
        result["baseline"] = baseline
        result["baseline_s"] = baseline["wall_s"]
        result["baseline_peak_gpu_mib"] = baseline["peak_gpu_mib"]
        speedup = round(baseline["wall_s"] / worker["wall_s"], 2)
        result["speedup_inprocess"] = round(baseline["wall_s"] / worker["timings"]["total_s"], 2)
        result["agreement"] = compare_alphas(
            (worker_rows, worker_eigs), (baseline_rows, baseline_eigs), rtol=args.alpha_rtol
        )
    result["speedup"] = speedup

    targets: dict[str, bool | None] = {
        "worker_s": worker["wall_s"] <= TARGET_WORKER_S,
        "peak_gpu_mib": None
        if result["worker_peak_gpu_mib"] is None
        else result["worker_peak_gpu_mib"] <= TARGET_PEAK_GPU_MIB,
        "speedup": None if speedup is None else speedup >= TARGET_SPEEDUP,
    }
    if device.type != "cuda" or args.blocks != 32 or args.hidden != 4096:
        targets = {k: None for k in targets}  # the targets are for the 7B shape on a GPU
    result["targets_met"] = targets
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
