"""A synthetic results store at atlas scale, written fast and without analysing anything:
N models of about L layers each, as the per-model files a worker writes (`<key>/layers.csv`,
then its sealed `result.json`) and as the results tables (`_tables/` parts whose rows vouch
for those files, so that readers count them), plus failure records.

Owns the synthetic mix (architectures, relations, sizes, alpha ~ lognormal with tails, some
fit_failed layers, a few error classes) and how it is written: the tables are built
vectorised with numpy a chunk of models at a time (bounded memory) and written through
esd_worker.core.store.tables.write_part, one part per architecture per chunk. Does not own
the tables' schema or keys (esd_worker.core.store.tables) nor the marker / record formats
(esd_worker.core.store.marker, records). Used by benchmarks/synth_store.py (the CLI),
benchmarks/bench_tables.py and tests/e2e/test_report_browser.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from esd_worker.core.models.naming import model_key
from esd_worker.core.store.layout import MARKER_NAME, failure_key, marker_key, model_file_key
from esd_worker.core.store.marker import LAYERS_NAME, FileSeal, Marker
from esd_worker.core.store.records import FailureRecord
from esd_worker.core.store.results import LAYER_COLUMNS, SUMMARY_FIELDS, layers_to_csv
from esd_worker.core.store.stores import LocalStore, Store
from esd_worker.core.store.tables import (
    LAYER_SCHEMA,
    MODEL_SCHEMA,
    arch_partition,
    family_of,
    parameters_text,
    write_part,
)

# (architecture, weight, its layers' name stem): a hub-like mix, decoders first.
ARCHS: tuple[tuple[str, float, str], ...] = (
    ("LlamaForCausalLM", 0.30, "model.layers"),
    ("MistralForCausalLM", 0.15, "model.layers"),
    ("Qwen2ForCausalLM", 0.15, "model.layers"),
    ("GPT2LMHeadModel", 0.10, "transformer.h"),
    ("BertModel", 0.12, "encoder.layer"),
    ("RobertaModel", 0.06, "encoder.layer"),
    ("T5ForConditionalGeneration", 0.05, "encoder.block"),
    ("PhiForCausalLM", 0.04, "model.layers"),
    ("GemmaForCausalLM", 0.03, "model.layers"),
)
RELATIONS = (("base", 0.25), ("finetune", 0.45), ("lora", 0.2), ("adapter", 0.1))
ERRORS = (("GpuOutOfMemoryError", True), ("PermanentModelError", False),
          ("UnsupportedAdapterError", False), ("StoreError", True), ("TransientError", True))
SUBLAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PARAMETERS = {"fix_fingers": "xmin_mid", "min_evals": 10, "evals_thresh": 1e-5}
FINISHED_AT = "2026-11-20T12:00:00+00:00"
FIT_FAILED_SHARE = 0.02
CHUNK = 5000


@dataclass(frozen=True)
class SynthSpec:
    """What to write: `models` models of `layers` layers each (seed fixes the mix), each
    as its per-model files; `untabled_every`: every n-th model in no part (0: none), read by
    the tables' fallback; `failures`: how many failure records; `tables`: whether to write
    the parts (False: a store for compact to build)."""

    models: int
    layers: int = 100
    seed: int = 0
    untabled_every: int = 0
    failures: int = 0
    tables: bool = True
    chunk: int = CHUNK


def model_ids(spec: SynthSpec) -> Iterator[str]:
    for i in range(spec.models):
        yield model_id(i)


def model_id(i: int) -> str:
    return f"synth-org{i % 997}/model-{i:07d}"


def _choice(rng: np.random.Generator, table: tuple[tuple, ...], n: int) -> np.ndarray:
    weights = np.array([row[1] for row in table], dtype=float)
    return rng.choice(len(table), size=n, p=weights / weights.sum())


@dataclass
class _Chunk:
    start: int
    arch: np.ndarray            # index into ARCHS, per model
    relation: np.ndarray        # index into RELATIONS
    num_params: np.ndarray      # per model, total
    alpha: np.ndarray           # models × layers
    ok: np.ndarray              # models × layers, bool
    metrics: dict[str, np.ndarray]  # column → models × layers
    dims: tuple[np.ndarray, np.ndarray]  # M, N: models × layers
    total_s: np.ndarray


def _make_chunk(rng: np.random.Generator, start: int, n: int, layers: int) -> _Chunk:
    arch = _choice(rng, ARCHS, n)
    relation = _choice(rng, RELATIONS, n)
    # Sizes log-uniform over 10M..70B; each layer a share of it.
    num_params = np.exp(rng.uniform(np.log(1e7), np.log(7e10), n)).astype(np.int64)
    shape = (n, layers)
    # alpha: lognormal around ~3.5, 1% heavy tails (alpha up to ~20) and some below 2.
    alpha = rng.lognormal(np.log(3.5), 0.25, shape)
    tails = rng.random(shape) < 0.01
    alpha[tails] = rng.lognormal(np.log(8.0), 0.5, int(tails.sum()))
    ok = rng.random(shape) >= FIT_FAILED_SHARE
    width = np.sqrt(num_params / (12 * layers)).clip(64, 16384).astype(np.int64)
    m = np.repeat(width[:, None], layers, axis=1)
    nn = (m * rng.choice([1, 1, 1, 4], size=shape)).astype(np.int64)
    spectral = rng.lognormal(np.log(20.0), 0.6, shape)
    log_spectral = np.log10(spectral)
    norm = spectral * rng.uniform(3, 30, shape)
    metrics = {
        "D": rng.uniform(0.02, 0.15, shape),
        "xmin": rng.lognormal(np.log(2.0), 0.5, shape),
        "alpha_weighted": alpha * 2 * log_spectral,
        "log_alpha_norm": np.log10(norm) * alpha / 3,
        "spectral_norm": spectral,
        "log_spectral_norm": log_spectral,
        "norm": norm,
        "log_norm": np.log10(norm),
        "stable_rank": (norm / spectral) ** 2,
        "entropy": rng.uniform(0.6, 0.99, shape),
    }
    metrics["xmax"] = metrics["xmin"] * rng.uniform(50, 500, shape)
    total_s = rng.lognormal(np.log(30.0), 1.0, n)
    return _Chunk(start, arch, relation, num_params, alpha, ok, metrics, (m, nn), total_s)


def _nan_where(values: np.ndarray, ok: np.ndarray) -> np.ndarray:
    return np.where(ok, values, np.nan)


def _summary(c: _Chunk, layers: int) -> dict[str, np.ndarray]:
    """SUMMARY_FIELDS per model, vectorised: the alpha family over ok layers only."""
    a = _nan_where(c.alpha, c.ok)
    ok_n = c.ok.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(ok_n > 0, ((a >= 2) & (a <= 6)).sum(axis=1) / ok_n, np.nan)
        out = {
            "layers": np.full(len(ok_n), layers, dtype=np.int64),
            "layers_ok": ok_n.astype(np.int64),
            "alpha_mean": np.nanmean(a, axis=1),
            "alpha_median": np.nanmedian(a, axis=1),
            "alpha_std": np.nanstd(a, axis=1),
            "alpha_in_2_6_share": share,
            "stable_rank_mean": c.metrics["stable_rank"].mean(axis=1),
            "log_spectral_norm_mean": c.metrics["log_spectral_norm"].mean(axis=1),
            "log_norm_mean": c.metrics["log_norm"].mean(axis=1),
            "entropy_mean": c.metrics["entropy"].mean(axis=1),
            "alpha_weighted_mean": np.nanmean(_nan_where(c.metrics["alpha_weighted"], c.ok),
                                              axis=1),
            "log_alpha_norm_mean": np.nanmean(_nan_where(c.metrics["log_alpha_norm"], c.ok),
                                              axis=1),
        }
    assert set(out) == set(SUMMARY_FIELDS)
    return out


def _layer_names(arch: int, layers: int) -> list[str]:
    stem = ARCHS[arch][2]
    return [f"{stem}.{j // len(SUBLAYERS)}.{SUBLAYERS[j % len(SUBLAYERS)]}" for j in range(layers)]


def _relation_text(c: _Chunk) -> list[str]:
    return [RELATIONS[r][0] for r in c.relation]


def _base_of(i: int, relation: str) -> str | None:
    return None if relation == "base" else model_id((i // 4) * 4)


def _f(v: float) -> float | None:
    return None if not np.isfinite(v) else float(v)


def _tables(c: _Chunk, keys: list[str], rows: np.ndarray, layers: int,
            files: list[str]) -> tuple[pa.Table, pa.Table]:
    """The models and layers tables of the chunk's models at `rows` (one architecture);
    files: each model's `files` cell (what its per-model files are, _model_files)."""
    n = len(rows)
    stats = {k: v[rows] for k, v in _summary(c, layers).items()}
    rel = [RELATIONS[r][0] for r in c.relation[rows]]
    ids = [model_id(c.start + int(r)) for r in rows]
    mkeys = [keys[int(r)] for r in rows]
    bases = [_base_of(c.start + int(r), rl) for r, rl in zip(rows, rel, strict=True)]
    arch_name = ARCHS[int(c.arch[rows[0]])][0]
    dev = "cuda (NVIDIA H100 80GB HBM3)"
    parts = []
    for j in range(n):
        part = {"model_key": mkeys[j], "relation": rel[j], "base_model": bases[j],
                **{f: (int(stats[f][j]) if f in ("layers", "layers_ok") else _f(stats[f][j]))
                   for f in SUMMARY_FIELDS},
                "device": dev, "total_s": round(float(c.total_s[rows[j]]), 3),
                "finished_at": FINISHED_AT}
        parts.append(json.dumps(part, separators=(",", ":")))
    cols: dict[str, object] = {
        "model_key": mkeys, "model": ids, "model_id": ids, "revision": [None] * n,
        "relation": rel, "base_model": bases, "architecture": [arch_name] * n,
        "family": [family_of(arch_name)] * n, "num_params": c.num_params[rows],
        **stats, "device": [dev] * n, "total_s": c.total_s[rows],
        "finished_at": [FINISHED_AT] * n, "parameters": [parameters_text(PARAMETERS)] * n,
        "summary_part": parts, "files": [files[int(r)] for r in rows],
    }
    # The columns not set here (the coverage: synthetic models have none) are nulls.
    models = pa.table({f.name: pa.array(cols.get(f.name, [None] * n), type=f.type)
                       for f in MODEL_SCHEMA}, schema=MODEL_SCHEMA)
    # Layers: model-level strings taken by index (no per-row Python work).
    idx = pa.array(np.repeat(np.arange(n), layers))
    lay = {"model_key": pa.array(mkeys).take(idx), "model_id": pa.array(ids).take(idx),
           "finished_at": pa.array([FINISHED_AT] * n * layers),
           "layer_index": pa.array(np.tile(np.arange(layers, dtype=np.int64), n)),
           "revision": pa.nulls(n * layers, pa.string()),
           "quantization": pa.nulls(n * layers, pa.string()),  # read as stored
           "layer": pa.array(_layer_names(int(c.arch[rows[0]]), layers)).take(
               pa.array(np.tile(np.arange(layers), n))),
           "layer_type": pa.array(["linear"]).take(pa.array(np.zeros(n * layers, np.int64))),
           "fix_fingers": pa.array(["xmin_mid"]).take(pa.array(np.zeros(n * layers, np.int64))),
           "status": pa.array(["ok", "fit_failed"]).take(
               pa.array((~c.ok[rows]).astype(np.int64).ravel()))}
    ok = c.ok[rows]
    m, nn = c.dims[0][rows], c.dims[1][rows]
    num = {"M": m, "N": nn, "num_params": m * nn, "num_evals": np.minimum(m, nn),
           "matrix_rank": np.minimum(m, nn),
           "num_pl_spikes": (np.minimum(m, nn) // 20).astype(np.int64),
           "alpha": _nan_where(c.alpha[rows], ok),
           **{k: (_nan_where(v[rows], ok) if k in ("D", "xmin", "xmax", "alpha_weighted",
                                                    "log_alpha_norm") else v[rows])
              for k, v in c.metrics.items()}}
    for k, v in num.items():
        lay[k] = pa.array(np.ascontiguousarray(v).ravel())
    layers_t = pa.table({f.name: lay[f.name].cast(f.type) for f in LAYER_SCHEMA},
                        schema=LAYER_SCHEMA)
    return models, layers_t


def _model_files(store: Store, c: _Chunk, keys: list[str], r: int, layers: int,
                 stats: dict[str, np.ndarray]) -> str:
    """A worker's per-model files for the chunk's model r: layers.csv, then its marker,
    sealing it; the `files` cell of its models row (the sizes of both). stats: the chunk's
    _summary."""
    i = c.start + r
    ok = c.ok[r]
    arch = int(c.arch[r])
    names = _layer_names(arch, layers)
    rows = []
    for j in range(layers):
        m, nn = int(c.dims[0][r, j]), int(c.dims[1][r, j])
        row: dict[str, object] = {"model_id": model_id(i), "revision": "", "layer": names[j],
               "layer_type": "linear", "M": m, "N": nn,
               "fix_fingers": "xmin_mid", "status": "ok" if ok[j] else "fit_failed"}
        row["num_params"] = m * nn
        row["num_evals"] = row["matrix_rank"] = min(m, nn)
        row["num_pl_spikes"] = min(m, nn) // 20
        row["alpha"] = float(c.alpha[r, j]) if ok[j] else ""
        for k, v in c.metrics.items():
            fit = k in ("D", "xmin", "xmax", "alpha_weighted", "log_alpha_norm")
            row[k] = "" if (fit and not ok[j]) else float(v[r, j])
        rows.append({col: row.get(col, "") for col in LAYER_COLUMNS})
    summary = {f: (int(v[r]) if f in ("layers", "layers_ok") else _f(v[r]))
               for f, v in stats.items()}
    relation = RELATIONS[int(c.relation[r])][0]
    table = layers_to_csv(rows)
    marker = Marker(
        model=model_id(i), model_key=keys[r], parameters=PARAMETERS, model_id=model_id(i),
        relation=relation, architecture=ARCHS[arch][0], layer_count=layers,
        status_counts={"ok": int(ok.sum()), "fit_failed": int((~ok).sum())},
        summary=summary, timings={"total_s": round(float(c.total_s[r]), 3)},
        device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
        started_at=FINISHED_AT, finished_at=FINISHED_AT,
        files={LAYERS_NAME: FileSeal.of(table)})
    data = marker.to_json()
    _put(store, model_file_key(keys[r], LAYERS_NAME), table)
    _put(store, marker_key(keys[r]), data)
    return json.dumps({LAYERS_NAME: len(table), MARKER_NAME: len(data)}, sort_keys=True,
                      separators=(",", ":"))


def _put(store: Store, key: str, data: bytes) -> None:
    """store.put_bytes, but straight into a local folder: 2 files a model, and the store's
    atomic write (a temporary file, fsync, rename) would make writing 100k models the slow
    part of what uses this store."""
    if isinstance(store, LocalStore):
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        store.put_bytes(key, data)


def write_failures(store: Store, count: int, offset: int, seed: int = 0) -> int:
    """`count` failure records for models offset.. (ids past the done ones), a few classes."""
    rng = np.random.default_rng(seed + 1)
    classes = rng.integers(0, len(ERRORS), count)
    for k in range(count):
        mid = model_id(offset + k)
        error, retryable = ERRORS[int(classes[k])]
        record = FailureRecord(
            model=mid, model_key=model_key(mid), error=error, exit_code=3 if retryable else 4,
            signal=None, retryable=retryable, attempts=1 + k % 3,
            stderr_tail=(f"esd-worker: error: {error}: synthetic",), run_id="synth-run",
            time=FINISHED_AT)
        store.put_bytes(failure_key(record.model_key), record.to_json())
    return count


def write_synth_store(store: Store, spec: SynthSpec) -> dict[str, int]:
    """Write the synthetic store; counts of what was written (parts, model_files, failures)."""
    rng = np.random.default_rng(spec.seed)
    counts = {"models": spec.models, "parts": 0, "model_files": 0, "failures": 0}
    for start in range(0, spec.models, spec.chunk):
        n = min(spec.chunk, spec.models - start)
        c = _make_chunk(rng, start, n, spec.layers)
        keys = [model_key(model_id(start + r)) for r in range(n)]
        stats = _summary(c, spec.layers)
        files = [_model_files(store, c, keys, r, spec.layers, stats) for r in range(n)]
        counts["model_files"] += n
        tabled = np.array([spec.untabled_every == 0 or (start + r) % spec.untabled_every != 0
                           for r in range(n)], dtype=bool)
        if spec.tables:
            for a in np.unique(c.arch):
                rows = np.flatnonzero((c.arch == a) & tabled)
                if not len(rows):
                    continue
                models_t, layers_t = _tables(c, keys, rows, spec.layers, files)
                write_part(store, arch_partition(ARCHS[int(a)][0]), models_t, layers_t,
                           part_id=f"20261120T120000Z-{start // spec.chunk:06d}{int(a):02d}")
                counts["parts"] += 1
    if spec.failures:
        counts["failures"] = write_failures(store, spec.failures, spec.models, spec.seed)
    return counts


def models_csv(spec: SynthSpec) -> bytes:
    """A model list (`model` column) of the store's done models."""
    return ("model_id\n" + "".join(f"{m}\n" for m in model_ids(spec))).encode()
