"""The model config.json describes, built on the meta device (no weights), and the layer map
of a model folder: the first class built whose modules explain its checkpoint
(esd_worker.analysis.modulemap), else the best of them, else the names alone.

Owns importing transformers (under one lock), warming it up in a long-lived worker, reading
config.json, the order of the classes tried and building each. The join of a model to its
checkpoint is esd_worker.analysis.modulemap's; what a tensor no module types is,
esd_worker.analysis.accounting's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook

from esd_worker.analysis.hflock import TRANSFORMERS as _TRANSFORMERS
from esd_worker.analysis.layers import Beat, LayerMap, map_by_names
from esd_worker.analysis.modulemap import Join, join_model
from esd_worker.analysis.weights import Tensors

log = logging.getLogger(__name__)




def warm_up(*, cuda: bool) -> None:
    """Import what layer discovery needs (transformers, its model base class: ~3 s on a CPU,
    more on a cold image) and start CUDA, so that a long-lived worker pays this while its
    first model downloads, not after. Safe in a background thread."""
    try:
        with _TRANSFORMERS:
            import transformers.modeling_utils  # noqa: F401
            from accelerate import init_empty_weights  # noqa: F401
            from transformers.pytorch_utils import Conv1D  # noqa: F401
        if cuda and torch.cuda.is_available():
            torch.cuda.init()
    except Exception as e:  # the model that needs it will report the problem
        log.debug("warm-up: %s", e)


def _meta_config(directory: Path, *, trust_remote_code: bool
                 ) -> tuple[Any, list[Any], int] | None:
    """config.json as transformers reads it, the classes to build it with, in order (those its
    `architectures` name, then the auto classes: _auto_classes) and how many of them it
    names; None when there is no config.json or transformers cannot read it."""
    with _TRANSFORMERS:
        import transformers

        if not (directory / "config.json").is_file():
            return None
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(directory), trust_remote_code=trust_remote_code
            )
        except Exception as e:  # any config transformers cannot read: fallback
            text = str(e).strip()
            first_line = text.splitlines()[0] if text else type(e).__name__
            log.warning("config.json not understood by transformers (%s); using fallback",
                        first_line)
            return None
        classes: list[Any] = [
            cls for arch in (config.architectures or [])
            if (cls := getattr(transformers, arch, None))
        ]
        return config, [*classes, *_auto_classes(transformers)], len(classes)


def _auto_classes(transformers: Any) -> tuple[Any, ...]:
    """The auto classes tried after config.json's architectures: the causal LM, the bare
    model, and last the pretraining model (with its heads: a checkpoint saved from
    pretraining, as BERT's were, holds them whatever class config.json names)."""
    return (transformers.AutoModelForCausalLM, transformers.AutoModel,
            transformers.AutoModelForPreTraining)


def _beat_on_registration(beat: Beat, *_: object) -> None:
    """A module-registration hook that beats and returns None: anything else it returned
    would replace the module being registered."""
    beat()


def _build_meta_model(cls: Any, config: Any, *, trust_remote_code: bool,
                      beat: Beat | None = None) -> torch.nn.Module | None:
    """`cls` built from `config` with no weights, or None when it cannot be built. `beat` is
    called as each submodule is registered: building a model of hundreds of blocks takes
    long enough for a watchdog to take the worker for hung."""
    with _TRANSFORMERS:
        import transformers
        from accelerate import init_empty_weights

        autos = _auto_classes(transformers)
        # torch's global module-registration hook is the one place every block and
        # projection passes through while transformers builds the model, whatever the
        # architecture (a process-wide hook: removed as soon as the model is built).
        hook = None if beat is None else register_module_module_registration_hook(
            partial(_beat_on_registration, beat))
        try:
            with init_empty_weights(), contextlib.redirect_stderr(io.StringIO()):
                if cls in autos:
                    return cls.from_config(config, trust_remote_code=trust_remote_code)
                return cls._from_config(config)
        except Exception as e:  # any class that cannot be built: the caller tries the next
            log.debug("cannot build %s on meta: %s", getattr(cls, "__name__", cls), e)
            return None
        finally:
            if hook is not None:
                hook.remove()


def _concrete(cls: Any, config: Any) -> Any:
    """The class an auto class builds for `config` (itself for any other), or None when it
    cannot tell: known before a build, so a class tried already is not built again."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return cls
    try:
        return mapping[type(config)]
    except Exception:  # no class for this config, or a lazy import failing: build to see
        return None


def discover_layers(
    directory: Path,
    checkpoint: Tensors,
    *,
    include_embeddings: bool = False,
    trust_remote_code: bool = False,
    beat: Beat | None = None,
) -> LayerMap:
    """The layer map of a model folder: its modules joined to its checkpoint for the first
    class built from config.json (its architectures, then the auto classes) whose modules
    explain every matrix the checkpoint holds under their own names; when none does, the
    class that explains most (modulemap.Join.score), with a note; without a class
    transformers can build, the names alone. Whatever the class, every tensor of the
    checkpoint is in the map: the architecture names and types them, the checkpoint says
    what exists. `beat` is called as discovery goes (the worker's heartbeat)."""
    config, classes, named = _meta_config(
        directory, trust_remote_code=trust_remote_code) or (None, [], 0)
    best: Join | None = None
    first: str | None = None
    built: set[type] = set()
    for i, cls in enumerate(classes):
        if _concrete(cls, config) in built:
            continue  # an auto class that is a class tried already: not built again
        model = _build_meta_model(cls, config, trust_remote_code=trust_remote_code, beat=beat)
        if model is None or type(model) in built:
            continue
        built.add(type(model))
        found = join_model(model, checkpoint, include_embeddings=include_embeddings, beat=beat,
                           named=i < named)
        if found is None:
            continue  # no module of this class is stored: not this model's class
        first = first or found.layer_map.architecture
        if best is None or found.score < best.score:
            best = found
        if found.perfect:
            break
    if best is None:
        return map_by_names(checkpoint, include_embeddings=include_embeddings,
                            reason="architecture unknown to transformers")
    chosen = best.layer_map
    if chosen.architecture != first:
        instead = (f"{first} does not explain the checkpoint as well as "
                   f"{chosen.architecture} does")
        log.warning("%s", instead)
        chosen = dataclasses.replace(chosen, note="; ".join(n for n in (instead, chosen.note) if n))
    return chosen
