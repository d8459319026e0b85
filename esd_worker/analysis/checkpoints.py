"""The weights of one model folder as components (issue 41).

Owns what a model folder holds, by esd_worker.core.models.weightfiles' rule (the download's
and the controller's sizes' too): one checkpoint at its top (today's Checkpoint), a pipeline
of components each in its own folder (diffusers), a model with module folders
(sentence-transformers), or one GGUF file set (esd_worker.analysis.gguf); and one Tensors over
all of them with each component's keys under its prefix. Does not decide which tensors are
layers (esd_worker.analysis.layers) or dequantize (esd_worker.analysis.quantized).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from esd_worker.analysis.gguf import open_gguf
from esd_worker.analysis.weights import Checkpoint, Tensors
from esd_worker.core.errors import PermanentModelError
from esd_worker.core.models.weightfiles import model_weights


@dataclass(frozen=True)
class Component:
    """One part of a model: `prefix` ("" for a plain model, else e.g. "unet/") put before
    its layer names and keys; `directory` holds its config.json (if any). A GGUF file set's
    `directory` is its first file: a GGUF file is its own config, no config.json applies."""

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
    """The model folder's components, each opened (the caller closes them: `combined`):
    a plain model: one, its top's Checkpoint under prefix ""; a diffusers pipeline: a
    Checkpoint per component folder holding weights, under "<folder>/"; a sentence-
    transformers model: its top's under "", each module folder holding weights under
    "<folder>/"; GGUF: the chosen file set under "". What one opened is closed when a later
    one fails."""
    layout = model_weights(_listing(directory), adapter=False)
    if layout is None or layout.kind == "model":
        # As before: the top's checkpoint, or its error for a folder without weights.
        return [Component("", directory, Checkpoint(directory, beat=beat))]
    if layout.kind == "gguf":
        names = layout.parts[0].weights.names
        return [Component("", directory / names[0], open_gguf(directory, names, beat=beat))]
    opened: list[Component] = []
    try:
        for part in layout.parts:
            folder = directory / part.folder if part.folder else directory
            opened.append(Component(part.prefix, folder, Checkpoint(folder, beat=beat)))
    except BaseException:
        for component in opened:
            component.tensors.close()
        raise
    return opened


def _listing(directory: Path) -> list[str]:
    """The files of `directory` and of its folders (relative names, "/"-separated): all the
    rule looks at. Hidden entries (.cache/, .git/) are left out."""
    names: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_file():
                    names.append(entry.name)
                elif entry.is_dir():
                    with os.scandir(entry.path) as inner:
                        names.extend(f"{entry.name}/{f.name}" for f in inner if f.is_file())
    except OSError:
        return names  # no directory: Checkpoint says so
    return names


def combined(components: Sequence[Component]) -> Tensors:
    """One Tensors over the components, each key under its component's prefix; a plain
    model's one component (prefix "") as it is."""
    if len(components) == 1 and not components[0].prefix:
        return components[0].tensors
    return Combined(components)


class Combined:
    """The Tensors of several components: keys() in component order, each `prefix + key`;
    every call goes to the component the key is under; close closes them all. `directory`:
    the model folder (the components' folders are in it)."""

    def __init__(self, components: Sequence[Component]) -> None:
        self.components = list(components)
        self.directory = _model_folder(self.components)
        self._owner: dict[str, tuple[Tensors, str]] = {}
        for component in self.components:
            for key in component.tensors.keys():  # noqa: SIM118 - Tensors is not a Mapping
                name = component.prefix + key
                if name in self._owner:
                    raise PermanentModelError(f"tensor {name!r} is stored in two components "
                                              f"of {self.directory}")
                self._owner[name] = (component.tensors, key)

    def __enter__(self) -> Combined:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _at(self, key: str) -> tuple[Tensors, str]:
        return self._owner[key]

    def keys(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def shape(self, key: str) -> tuple[int, ...]:
        tensors, inner = self._at(key)
        return tensors.shape(inner)

    def dtype(self, key: str) -> str:
        tensors, inner = self._at(key)
        return tensors.dtype(inner)

    def read(self, key: str) -> torch.Tensor:
        tensors, inner = self._at(key)
        return tensors.read(inner)

    def read_row(self, key: str, index: int) -> torch.Tensor:
        tensors, inner = self._at(key)
        return tensors.read_row(inner, index)

    def nbytes(self, key: str) -> int:
        tensors, inner = self._at(key)
        return tensors.nbytes(inner)

    def in_memory(self, key: str) -> bool:
        tensors, inner = self._at(key)
        return tensors.in_memory(inner)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        tensors, inner = self._at(key)
        return tensors.read_into(inner, out)

    def scheme(self, key: str) -> str | None:
        tensors, inner = self._at(key)
        return tensors.scheme(inner)

    def refusal(self, key: str) -> str | None:
        tensors, inner = self._at(key)
        return tensors.refusal(inner)

    def folded(self) -> Mapping[str, str]:
        return {c.prefix + stored: c.prefix + into
                for c in self.components for stored, into in c.tensors.folded().items()}

    def close(self) -> None:
        errors: list[BaseException] = []
        for component in self.components:
            try:
                component.tensors.close()
            except Exception as e:  # the others are closed all the same
                errors.append(e)
        self._owner.clear()
        if errors:
            raise errors[0]


def _model_folder(components: Sequence[Component]) -> Path:
    """The folder the components are in: a prefix of n folders is n levels down."""
    first = components[0]
    depth = len([p for p in first.prefix.split("/") if p])
    folder = first.directory
    for _ in range(depth):
        folder = folder.parent
    return folder
