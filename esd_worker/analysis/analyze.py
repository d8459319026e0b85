"""Analyse one model end to end: resolve, discover layers (with speculative spectra alongside,
esd_worker.analysis.speculate), stream + merge, spectra, results.

Owns what is computed for one layer (its row, its LoRA merge on the device, its spectrum)
and the model's result; the spreading of layers over devices, one stream each, and the
memory bound per layer are esd_worker.analysis.streams'."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from esd_worker import __version__
from esd_worker.analysis.accounting import coverage as tensor_coverage
from esd_worker.analysis.adapters import AdapterMatch, PeftAdapter
from esd_worker.analysis.checkpoints import Component, combined, open_components
from esd_worker.analysis.hostsolve import default_host_solvers
from esd_worker.analysis.inmemory import MEMORY_SOURCE, HeldWeights
from esd_worker.analysis.knownmaps import known_layer_map
from esd_worker.analysis.layers import LayerMap, joined_maps
from esd_worker.analysis.metamodel import discover_layers
from esd_worker.analysis.modellayers import LayerAnalysis
from esd_worker.analysis.quantized import dequantized
from esd_worker.analysis.speculate import Speculation, candidate_keys, speculation_mode
from esd_worker.analysis.stacks import Sliced
from esd_worker.analysis.streams import Capacity, device_capacity, select_devices
from esd_worker.analysis.weights import float_dtype
from esd_worker.core.command.settings import WorkerSettings
from esd_worker.core.errors import GpuOutOfMemoryError, PermanentModelError, WorkerError
from esd_worker.core.models.naming import folder_warning, ref_key
from esd_worker.core.store.layout import EIGS_NAME, write_model_result
from esd_worker.core.store.marker import LAYERS_NAME, BaseModelRef, Marker, canonical_parameters
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import eigs_to_npz, layers_to_csv, summarize_layers
from esd_worker.core.store.stores import Store
from esd_worker.fetch.resolve import ResolvedModel, resolve_model

log = logging.getLogger(__name__)

ADAPTER_RELATIONS = frozenset({"adapter", "lora", "peft"})
# progress(layers done so far, the model's bytes on disk or None: unchanged)
Progress = Callable[[int, "int | None"], None]
# done(the marker written, the layer rows of layers.csv): a batch's results-tables writer
Done = Callable[[Marker, Sequence[dict[str, Any]]], None]


def select_device(requested: str) -> torch.device:
    """auto: CUDA when available (cuda:0), else CPU; cuda without a GPU is a usage error. The
    one device of a single stream (esd_worker.serve.selfcheck); models use select_devices."""
    return select_devices(requested, parallel=False)[0]


def _device_info(devices: Sequence[torch.device], layers_per_stream: list[int]) -> dict[str, Any]:
    """result.json's device: the first device's type and name, how many streams ran, on what
    and how many layers each took; on CUDA each device's peak allocated memory and the
    largest (peak_memory_mib, the bound per GPU; with one GPU as before)."""
    first = devices[0]
    info: dict[str, Any] = {
        "type": first.type,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "host": platform.node(),
        "count": len(devices),
        "layers_per_stream": layers_per_stream,
    }
    if first.type == "cuda":
        names = [torch.cuda.get_device_name(d) for d in devices]
        peaks = [round(torch.cuda.max_memory_allocated(d) / 2**20, 1) for d in devices]
        info |= {"name": names[0], "names": names, "peak_memory_mib": max(peaks),
                 "peak_memory_mib_per_device": peaks}
    else:
        name = platform.processor() or platform.machine()
        info |= {"name": name, "names": [name] * len(devices), "threads": torch.get_num_threads()}
    return info


def _versions() -> dict[str, str]:
    """Versions of what made the numbers; read from package metadata (no imports: peft alone
    takes seconds to import)."""
    versions = {
        "esd_worker": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    for dist in ("transformers", "safetensors", "peft", "huggingface_hub", "accelerate"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return versions


def analyse_model(
    settings: WorkerSettings,
    *,
    store: Store | None = None,
    model_key: str | None = None,
    resolve: Callable[[str], ResolvedModel] = resolve_model,
    progress: Progress | None = None,
    done: Done | None = None,
) -> Marker:
    """Analyse settings.model and write layers.csv, eigs.npz and result.json (last) to the store.

    resolve: how model references (the model, an adapter's base) become local files; a
    caller that has downloaded them already hands in its own. progress: called as
    progress(layers done, bytes on disk) once the files are there (0 layers; the model's
    bytes with its base's), as discovery goes (0 layers, bytes None: often, so it must be
    cheap) and after each layer (bytes None: unchanged): a long-lived worker's heartbeat.
    done: called with the marker and the layer rows once the marker is written. Returns the
    marker written (result.json).
    """
    return analyse_model_with(settings, store=store, model_key=model_key, resolve=resolve,
                              progress=progress, done=done)


def analyse_model_with(
    settings: WorkerSettings,
    *,
    store: Store | None = None,
    model_key: str | None = None,
    resolve: Callable[[str], ResolvedModel] = resolve_model,
    speculate: str = "auto",
    devices: Sequence[torch.device] | None = None,
    capacity: Capacity = device_capacity,
    progress: Progress | None = None,
    done: Done | None = None,
    held: HeldWeights | None = None,
) -> Marker:
    """analyse_model, with the speculation switch (esd_worker.analysis.speculate): auto decides by
    the
    device, off/on force it, complete speculates every candidate tensor before the analysis.
    The results are the same byte for byte in every mode (tests compare them).

    devices: one analysis stream each (tests and benchmarks: [cpu, cpu, cpu] runs three
    streams on the CPU); default: esd_worker.analysis.streams.select_devices from settings.device
    and
    settings.parallel_gpu. capacity: usable bytes of a device for one layer (default: a
    CUDA device's total memory less a margin; None, no bound, for the CPU). held: the
    weights of a model in memory (esd_worker.analysis.inmemory), read instead of files:
    those of the model `resolve` gives with source "memory" (the model, or an adapter's
    base)."""
    settings.validate()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    key = model_key or ref_key(settings.model)
    if store is None:  # a store passed in has been checked by the caller
        store = open_store(settings.output)
        store.check()  # before any download or analysis: an unwritable output fails in a second
    if devices is None:
        devices = select_devices(settings.device, settings.parallel_gpu)
    devices = list(devices)
    for device in devices:
        if device.type == "cuda":  # peak_memory_mib is this model's, not the process's
            torch.cuda.reset_peak_memory_stats(device)
    mode = speculation_mode(speculate, devices[0])
    host_solvers = (default_host_solvers(devices) if settings.host_eigensolvers is None
                    else settings.host_eigensolvers)

    model = resolve(settings.model)
    adapter: PeftAdapter | None = None
    base: ResolvedModel | None = None
    if settings.relation.lower() in ADAPTER_RELATIONS or model.is_adapter:
        if not model.is_adapter:
            raise PermanentModelError(
                f"{settings.model} is listed as an adapter but has no adapter_config.json"
            )
        adapter = PeftAdapter(model.directory)
        base = _resolve_base(settings, adapter, resolve)
    weights_model = base or model
    if progress is not None:
        progress(0, sum(_on_disk(m) for m in (model, base) if m is not None))
    t_resolve = time.perf_counter()

    memory = held if held is not None and weights_model.source == MEMORY_SOURCE else None
    # Discovery beats the heartbeat as it goes (each weight file opened, each module of the
    # meta model built and mapped): a model of hundreds of blocks can take minutes before its
    # first layer, and a watch under a short --model-timeout would kill it as hung.
    beat = None if progress is None else _discovery_beat(progress)
    components = [Component("", weights_model.directory, memory.checkpoint())] if memory else [
        dataclasses.replace(c, tensors=dequantized(c.tensors, c.config(), c.directory))
        for c in open_components(weights_model.directory, beat=beat)
    ]
    with contextlib.closing(combined(components)) as ckpt:
        speculation = None if mode == "off" else Speculation(
            ckpt.read, candidate_keys(ckpt, settings.analysis), settings.analysis, devices[0],
            complete=mode == "complete",
        )
        with speculation or contextlib.nullcontext():
            # A known architecture's map from its config and names (no transformers import,
            # no meta model: seconds on a cold worker); any other, from the model.
            layer_map = memory.layer_map(
                ckpt, include_embeddings=settings.analysis.include_embeddings,
            ) if memory else joined_maps([
                (c.prefix, _discover(c, settings, beat)) for c in components])
        matched: AdapterMatch | None = None
        if adapter is not None:
            matched = adapter.match(layer_map.layers, ckpt.keys())
            log.info(
                "adapter: %d adapter modules merged on the fly, %d modules replaced, "
                "%d on weights not analysed",
                matched.merged_modules, len(matched.replaced), len(matched.unanalysed),
            )
        # Before any layer is computed: a tensor neither analysable nor skipped by a rule
        # fails the model now, not after hours (UnexplainedTensors).
        coverage = tensor_coverage(ckpt, [spec.key for spec in layer_map.layers],
                                   layer_map.skipped)
        t_discover = time.perf_counter()
        log.info(
            "model=%s layers=%d discovery=%s architecture=%s",
            settings.model, len(layer_map.layers), layer_map.discovery, layer_map.architecture,
        )
        sliced = Sliced(ckpt)  # a layer may be one expert of a stored stack: `key[i]`
        job = LayerAnalysis(
            model, layer_map, sliced.read, settings.analysis, devices, matched,
            adapter.fan_in_fan_out if adapter else False, speculation,
            capacity=capacity, stored_dtype=lambda name: float_dtype(sliced.dtype(name)),
            reader=sliced, host_solvers=host_solvers,
            quantization=sliced.quantization,
        )
        try:
            job.run(None if progress is None else lambda done: progress(done, None))
        except torch.cuda.OutOfMemoryError as e:
            raise GpuOutOfMemoryError(
                f"out of GPU memory analysing {settings.model}: {_first_line(e)}"
            ) from e
    t_analyse = time.perf_counter()

    layers_csv = layers_to_csv(job.rows)
    eigs = eigs_to_npz(job.eigs) if settings.save_eigs else None
    statuses = Counter(row["status"] for row in job.rows)
    marker = Marker(
        model=settings.model,
        model_key=key,
        parameters=canonical_parameters(settings.analysis.as_dict()),
        model_id=model.model_id,
        revision=model.revision,
        resolved_revision=model.resolved_revision,
        source=model.source,
        relation=settings.relation,
        base_model=None if base is None else BaseModelRef(
            model=base.ref, resolved_revision=base.resolved_revision, source=base.source,
        ),
        adapter=None if adapter is None or matched is None else {
            **adapter.info.__dict__,
            "merged_modules": matched.merged_modules,
            "replaced_layers": len(matched.replaced),
            "unanalysed_modules": len(matched.unanalysed),
        },
        layer_discovery=layer_map.discovery,
        architecture=layer_map.architecture,
        discovery_note=layer_map.note,
        coverage=coverage,
        layer_count=len(job.rows),
        status_counts=dict(sorted(statuses.items())),
        summary=summarize_layers(job.rows),
        layers_name=LAYERS_NAME,
        eigs_name=EIGS_NAME if eigs is not None else None,
        device=_device_info(devices, job.streams.layers_per_stream if job.streams else [])
        | {"host_eigensolvers": host_solvers,
           "host_solved_layers": job.host.host_layers if job.host else 0},
        versions=_versions(),
        started_at=started.isoformat(timespec="seconds"),
    )
    timings = {
        "resolve_s": round(t_resolve - t0, 4),
        "discover_s": round(t_discover - t_resolve, 4),
        "analyse_s": round(t_analyse - t_discover, 4),
        "read_wait_s": round(job.wait_s, 4),
        "speculated_layers": job.speculated_layers,
    }

    def finish(written: Marker) -> Marker:
        """Stamp the time the layer table and eigenvalues took to write, and the end."""
        now = time.perf_counter()
        return dataclasses.replace(
            written,
            timings={**timings, "write_s": round(now - t_analyse, 4),
                     "total_s": round(now - t0, 4)},
            finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    # The marker goes last: a model is done iff result.json exists.
    marker = write_model_result(store, marker, layers=layers_csv, eigs=eigs, finish=finish)
    log.info(
        "model=%s key=%s done: %d layers %s in %.2fs",
        settings.model, key, len(job.rows), dict(statuses), marker.total_s,
    )
    if done is not None:  # the rows at hand: nobody reads layers.csv back for the tables
        done(marker, job.rows)
    return marker


def _discover(component: Component, settings: WorkerSettings,
              beat: Callable[[], None] | None) -> LayerMap:
    """One component's layer map: a known architecture's from its config and names, any
    other from the model transformers builds from its config (or from the names)."""
    include = settings.analysis.include_embeddings
    return known_layer_map(component.directory, component.tensors,
                           include_embeddings=include) or discover_layers(
        component.directory, component.tensors, include_embeddings=include,
        trust_remote_code=settings.trust_remote_code, beat=beat,
    )


def _discovery_beat(progress: Progress) -> Callable[[], None]:
    """A beat of `progress` with no layer done yet and the size unchanged (the heartbeat
    throttles its lines: esd_worker.serve.batch.Heartbeat)."""
    return lambda: progress(0, None)


def _resolve_base(
    settings: WorkerSettings, adapter: PeftAdapter, resolve: Callable[[str], ResolvedModel]
) -> ResolvedModel:
    """The adapter's base: --base-model, else adapter_config.json's base_model_name_or_path."""
    if settings.base_model:
        return resolve(settings.base_model)
    ref = adapter.info.base_model
    if not ref:
        raise PermanentModelError(
            f"adapter base not found for {settings.model}: adapter_config.json names no "
            "base_model_name_or_path; pass --base-model"
        )
    try:
        return resolve(ref)
    except WorkerError as e:
        # A base saved as `models/x` was a folder to peft; by the one rule it is a hub id.
        folder = folder_warning(ref)
        raise type(e)(
            f"adapter base {ref} (from adapter_config.json) could not be resolved: {e}; "
            + (f"{folder}, or " if folder else "") + "pass --base-model"
        ) from e


def _on_disk(model: ResolvedModel) -> int:
    """The model's bytes: as sized for the download, else its folder's files (the weights
    and configs sit at its top, or a folder down: a pipeline's components)."""
    if model.size_bytes is not None:
        return model.size_bytes
    top = [p for p in model.directory.iterdir() if not p.name.startswith(".")]
    below = [q for p in top if p.is_dir() for q in p.iterdir() if not q.name.startswith(".")]
    return sum(p.stat().st_size for p in (*top, *below) if p.is_file())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
