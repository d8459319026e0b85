"""Checkpoint files of one model: which tensors exist, their shapes, reading them one by one."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from esd_worker.errors import PermanentModelError

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def find_weight_files(directory: Path, *, adapter: bool = False) -> tuple[str, list[Path]]:
    """The weight files of a model directory, safetensors preferred, and their format.

    The order follows what `save_pretrained` writes: a sharded index, a single file, then
    any other root-level safetensors; `pytorch_model*.bin` only when no safetensors exist.
    """
    if adapter:
        candidates = [
            ("safetensors", ["adapter_model.safetensors"]),
            ("bin", ["adapter_model.bin"]),
        ]
        for fmt, names in candidates:
            files = [directory / n for n in names if (directory / n).is_file()]
            if files:
                return fmt, files
        raise PermanentModelError(
            f"no adapter weights in {directory} (looked for adapter_model.safetensors/.bin)"
        )
    for fmt, index_name in (("safetensors", SAFETENSORS_INDEX), ("bin", BIN_INDEX)):
        index = directory / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise PermanentModelError(f"corrupt checkpoint index {index}: {e}") from e
            files = [directory / name for name in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise PermanentModelError(
                    f"checkpoint index {index.name} names missing shards: {', '.join(missing[:3])}"
                )
            return fmt, files
    single = directory / "model.safetensors"
    if single.is_file():
        return "safetensors", [single]
    others = sorted(
        p for p in directory.glob("*.safetensors") if not p.name.startswith("adapter_model")
    )
    if others:
        return "safetensors", others
    bins = sorted(p for p in directory.glob("pytorch_model*.bin"))
    if bins:
        return "bin", bins
    raise PermanentModelError(
        f"no weights in {directory} (looked for *.safetensors, {SAFETENSORS_INDEX}, "
        "pytorch_model*.bin): unsupported format"
    )


class Checkpoint:
    """Lazy view of a model's tensors; `read` loads one tensor into CPU memory.

    safetensors files are memory-mapped, so only the tensor asked for is read from disk.
    `.bin` files are loaded with `weights_only=True` (no code from the file runs) and
    memory-mapped where the file format allows it.
    """

    def __init__(self, directory: Path, *, adapter: bool = False) -> None:
        self.directory = directory
        self.format, self.files = find_weight_files(directory, adapter=adapter)
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        try:
            for path in self.files:
                self._open(path)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, path: Path) -> None:
        if self.format == "safetensors":
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    sl = handle.get_slice(key)
                    self._where[key] = handle
                    self._shapes[key] = tuple(int(d) for d in sl.get_shape())
                    self._dtypes[key] = str(sl.get_dtype())
            except (SafetensorError, OSError, ValueError) as e:
                raise PermanentModelError(f"corrupt safetensors file {path.name}: {e}") from e
            return
        state = _load_bin(path)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                self._where[key] = state
                self._shapes[key] = tuple(value.shape)
                self._dtypes[key] = str(value.dtype).removeprefix("torch.")

    def close(self) -> None:
        self._stack.close()
        self._where.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        return self._dtypes[key]

    def read(self, key: str) -> torch.Tensor:
        source = self._where[key]
        if isinstance(source, dict):
            return source[key]
        try:
            tensor: torch.Tensor = source.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise PermanentModelError(f"corrupt tensor {key!r} in {self.directory}: {e}") from e
        return tensor

    def iter_tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            yield key, self.read(key)


def _load_bin(path: Path) -> dict[str, Any]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # Legacy (pre-zip) files cannot be memory-mapped.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise PermanentModelError(
            f"corrupt or unsafe weights file {path.name}: {_load_error(e)}"
        ) from e
    except OSError as e:
        raise PermanentModelError(f"cannot read weights file {path.name}: {e}") from e
    if not isinstance(state, dict):
        raise PermanentModelError(f"{path.name} holds {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    return state


def _load_error(e: BaseException) -> str:
    """torch.load's reason, without its advice to retry with weights_only=False (which would
    run code from the file: never here)."""
    text = " ".join(str(e).split())
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
    if found:
        return f"not loadable with weights_only=True ({found.group(1).rstrip('. ')})"
    return text[:300]
