"""The weights of one model folder as components (issue 41: being built).

Owns what a model folder holds: one checkpoint at its top (today's Checkpoint), a pipeline
of components each in its own folder (diffusers), a model with module folders
(sentence-transformers), or GGUF files; and one Tensors over all of them with each
component's keys under its prefix. Does not decide which tensors are layers
(esd_worker.analysis.layers) or dequantize (esd_worker.analysis.quantized).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esd_worker.analysis.weights import Checkpoint, Tensors


@dataclass(frozen=True)
class Component:
    """One part of a model: `prefix` ("" for a plain model, else e.g. "unet/") put before
    its layer names and keys; `directory` holds its config.json (if any)."""

    prefix: str
    directory: Path
    tensors: Tensors

    def config(self) -> dict[str, Any] | None:
        """The component's config.json as a dict, or None."""
        try:
            config = json.loads((self.directory / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return config if isinstance(config, dict) else None


def open_components(directory: Path, *, beat: Callable[[], None] | None = None
                    ) -> list[Component]:
    """The model folder's components, each opened (the caller closes them: `combined`)."""
    return [Component("", directory, Checkpoint(directory, beat=beat))]


def combined(components: Sequence[Component]) -> Tensors:
    """One Tensors over the components, each key under its component's prefix."""
    if len(components) == 1 and not components[0].prefix:
        return components[0].tensors
    raise NotImplementedError("components under prefixes")
