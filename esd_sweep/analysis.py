"""`esd_sweep.analyze`: one model's layers as a DataFrame, the worker's analysis in-process.

Owns turning what a notebook holds (a torch module, a state dict, a folder, a hub id, with
an optional LoRA adapter) into one worker analysis (esd_worker.analysis.analyze, the same
code and numbers as `esd-sweep run`) in a temporary store, and its layer table into a
DataFrame (esd_sweep.frames). Nothing of the caller's is written or modified: the result
lives in a temporary folder that is gone when the call returns.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from esd_sweep.frames import layers_frame
from esd_worker.core.command.presets import PRESETS, fit_label, settings_with
from esd_worker.core.command.settings import AnalysisSettings, WorkerSettings
from esd_worker.core.errors import UsageError
from esd_worker.core.store.layout import EIGS_NAME, model_file_key
from esd_worker.core.store.marker import LAYERS_NAME
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import eigs_from_npz, layers_from_csv

KEY = "model"  # the model's key in the temporary store


def analyze(
    model: Any,
    *,
    adapter: str | os.PathLike[str] | None = None,
    preset: str | None = None,
    device: str = "auto",
    eigenvalues: bool = False,
    fix_fingers: str | None = None,
    evals_thresh: float | None = None,
    bins: int | None = None,
    min_evals: int | None = None,
    conv_norm: float | None = None,
    precision: str | None = None,
    include_embeddings: bool | None = None,
    trust_remote_code: bool = False,
) -> pd.DataFrame:
    """The weight spectra of one model, a row per layer (docs/metrics.md, docs/api.md).

    model: a torch.nn.Module or a state dict ({name: tensor}) in memory, a local folder in
    Hugging Face layout, or a hub id (`org/name` or `org/name@revision`, downloaded as
    `esd-sweep run` does: $HF_ENDPOINT, $HF_TOKEN, the HF cache). adapter: a LoRA/PEFT
    adapter's folder or hub id, merged into `model` (its base) layer by layer. preset:
    "ww" for WeightWatcher's default analysis; the other settings override the preset's
    (None: the preset's or esd-sweep's default). device: auto, cpu or cuda. eigenvalues:
    add an `eigenvalues` column (each layer's eigenvalues of WᵀW, for plot_esd).

    The DataFrame's attrs say how it was fitted: attrs["fit"] (a label such as
    "preset ww (DKS, float64, embeddings)") and attrs["parameters"].
    """
    if preset is not None and preset not in PRESETS:
        raise UsageError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    settings = settings_with(preset, {
        "fix_fingers": fix_fingers, "evals_thresh": evals_thresh, "bins": bins,
        "min_evals": min_evals, "conv_norm": conv_norm, "precision": precision,
        "include_embeddings": include_embeddings,
    })
    with tempfile.TemporaryDirectory(prefix="esd-sweep-") as out:
        marker = _analyse(model, adapter, settings, out, device=device,
                          trust_remote_code=trust_remote_code)
        store = open_store(out)
        data = store.get_bytes(model_file_key(KEY, LAYERS_NAME))
        eigs = store.get_bytes(model_file_key(KEY, EIGS_NAME)) if eigenvalues else None
    assert data is not None  # the marker vouches for it
    frame = layers_frame(layers_from_csv(data))
    if eigs is not None:
        by_layer = eigs_from_npz(eigs)
        frame["eigenvalues"] = [by_layer.get(name) for name in frame["layer"]]
    frame.attrs["fit"] = fit_label(marker.parameters)
    frame.attrs["parameters"] = dict(marker.parameters)
    frame.attrs["model"] = marker.model
    return frame


analyse = analyze  # the spelling the rest of the project uses


def _analyse(model: Any, adapter: str | os.PathLike[str] | None, settings: AnalysisSettings,
             out: str, *, device: str, trust_remote_code: bool) -> Any:
    """One worker analysis of the model (and adapter) into the store at `out`: the marker."""
    from esd_worker.analysis.analyze import analyse_model_with
    from esd_worker.analysis.inmemory import empty_folder, hold
    from esd_worker.fetch.resolve import ResolvedModel, resolve_model

    held = None if isinstance(model, str | os.PathLike) else hold(model)
    ref = held.name if held is not None else _reference(model)
    worker = WorkerSettings(
        model=_reference(adapter) if adapter is not None else ref,
        base_model=ref if adapter is not None else None,
        relation="adapter" if adapter is not None else "",
        output=out, analysis=settings, device=device, save_eigs=True,
        trust_remote_code=trust_remote_code,
    )
    with empty_folder() as folder:
        memory = held.resolved(Path(folder)) if held is not None else None

        def resolve(reference: str) -> ResolvedModel:
            return memory if memory is not None and reference == ref else resolve_model(
                reference)

        return analyse_model_with(worker, model_key=KEY, resolve=resolve, held=held)


def _reference(model: str | os.PathLike[str]) -> str:
    """A folder that exists, made absolute (the worker reads a bare `name` as a hub id);
    anything else as given (a hub id)."""
    text = os.fspath(model)
    folder = Path(text).expanduser()
    return str(folder.resolve()) if folder.is_dir() else text
