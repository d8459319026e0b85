"""The marker, `<model_key>/result.json`: what it says about a model and the files it vouches for.

Owns the marker's fields and their JSON form (`Marker`, schema MARKER_SCHEMA), the seals of
the files it names (`FileSeal`: size and SHA-256) and the checks of those files against them
(`check_listed` from a listing's sizes, `check_data` on the bytes read). Where the marker and
its files lie, and the order they are written in, is esd_worker.core.store.layout's; no store here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LAYERS_NAME = "layers.csv"
MARKER_SCHEMA = 1
# A name the marker gives one of the model's files: a plain name in the model's folder (what
# the worker and refit write: layers.csv, layers.<tag>.csv, eigs.npz), never a path: a
# marker naming `../../x` must not have report, refit or compare read it.
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


class MarkerError(ValueError):
    """Bytes that are not a marker this version can read; the message says why."""


class DamagedResult(ValueError):
    """A model's file is missing or is not what its marker vouches for; the message says
    which file and how (for one line: `model_key=… <message>`)."""


def canonical_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """parameters as they read back from result.json (tuples become lists, and so on)."""
    return dict(json.loads(json.dumps(dict(parameters))))


@dataclass(frozen=True)
class BaseModelRef:
    """An adapter's base as its worker resolved it."""

    model: str
    resolved_revision: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class FileSeal:
    """What a marker vouches for about one of the model's files: its size and SHA-256."""

    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> FileSeal:
        return cls(size=len(data), sha256=hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class Marker:
    """`<model_key>/result.json`: a model is done, with these parameters, and how it went.

    model: the reference the worker was given (id[@rev] or a local path); model_key: its
    folder. parameters: the analysis settings
    (esd_worker.core.command.settings.AnalysisSettings.as_dict).
    summary: the across-layer statistics (esd_worker.core.store.results.summarize_layers), None in
    markers written before it existed. layers_name / eigs_name: the files beside it
    (eigs_name None: no eigenvalues stored). timings: seconds per phase (total_s, ...).
    device, versions, adapter: informational, as the worker recorded them.
    coverage: what the checkpoint holds and what became of it (esd_worker.analysis.accounting;
    None in markers written before it existed): tensors and parameters held, those analysed
    (and the matrices: layer rows), those skipped by each documented rule. A model with a
    tensor neither analysed nor skipped fails instead: no marker says done without it.
    files: file name → FileSeal of each file the marker vouches for (empty in markers
    written before seals existed: those are checked for presence only).
    """

    model: str
    model_key: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    schema: int = MARKER_SCHEMA
    model_id: str | None = None
    revision: str | None = None
    resolved_revision: str | None = None
    source: str | None = None
    relation: str = ""
    base_model: BaseModelRef | None = None
    adapter: Mapping[str, Any] | None = None
    layer_discovery: str | None = None
    architecture: str | None = None
    discovery_note: str | None = None
    coverage: Mapping[str, Any] | None = None
    layer_count: int | None = None
    status_counts: Mapping[str, int] = field(default_factory=dict)
    summary: Mapping[str, Any] | None = None
    layers_name: str = LAYERS_NAME
    eigs_name: str | None = None
    timings: Mapping[str, Any] = field(default_factory=dict)
    device: Mapping[str, Any] | None = None
    versions: Mapping[str, Any] = field(default_factory=dict)
    started_at: str | None = None
    finished_at: str | None = None
    files: Mapping[str, FileSeal] = field(default_factory=dict)

    @property
    def total_s(self) -> float | None:
        value = self.timings.get("total_s")
        return float(value) if isinstance(value, int | float) else None

    def to_dict(self) -> dict[str, Any]:
        base = self.base_model
        return {
            "schema": self.schema,
            "model": self.model,
            "model_id": self.model_id,
            "revision": self.revision,
            "resolved_revision": self.resolved_revision,
            "source": self.source,
            "model_key": self.model_key,
            "relation": self.relation,
            "base_model": None if base is None else {
                "model": base.model, "resolved_revision": base.resolved_revision,
                "source": base.source,
            },
            "adapter": None if self.adapter is None else dict(self.adapter),
            "parameters": dict(self.parameters),
            "layer_discovery": self.layer_discovery,
            "architecture": self.architecture,
            "discovery_note": self.discovery_note,
            "coverage": None if self.coverage is None else dict(self.coverage),
            "layer_count": self.layer_count,
            "status_counts": dict(self.status_counts),
            "summary": None if self.summary is None else dict(self.summary),
            "outputs": {"layers": self.layers_name, "eigs": self.eigs_name},
            "files": {name: {"size": seal.size, "sha256": seal.sha256}
                      for name, seal in sorted(self.files.items())},
            "timings": dict(self.timings),
            "device": None if self.device is None else dict(self.device),
            "versions": dict(self.versions),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    def to_json(self) -> bytes:
        """Sorted keys, two-space indent; NaN is refused (JSON has none)."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
        return (text + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Marker:
        """Parse a stored marker; MarkerError naming the problem when it is not one.

        The schema must be one this version knows (1..MARKER_SCHEMA): a newer marker is
        refused rather than half understood. Keys this version does not know are ignored.
        """
        try:
            doc = json.loads(data.decode("utf-8"), parse_constant=_not_finite,
                             parse_float=_finite)
        except MarkerError:
            raise
        except RecursionError:
            raise MarkerError("not JSON this version reads: nested too deep") from None
        except (UnicodeDecodeError, ValueError) as e:  # also a number of over 4300 digits
            raise MarkerError(f"not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise MarkerError("not a JSON object")
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Marker:
        schema = doc.get("schema")
        if isinstance(schema, bool) or not isinstance(schema, int):
            raise MarkerError(f"schema must be an integer, got {schema!r}")
        if not 1 <= schema <= MARKER_SCHEMA:
            raise MarkerError(f"schema {schema} is not one this version reads (1.."
                              f"{MARKER_SCHEMA}): written by a newer esd-sweep?")
        outputs = _get(doc, "outputs", Mapping, {})
        base = _get(doc, "base_model", Mapping, None)
        return cls(
            schema=schema,
            model=_need(doc, "model", str),
            model_key=_need(doc, "model_key", str),
            parameters=dict(_get(doc, "parameters", Mapping, {})),
            model_id=_get(doc, "model_id", str, None),
            revision=_get(doc, "revision", str, None),
            resolved_revision=_get(doc, "resolved_revision", str, None),
            source=_get(doc, "source", str, None),
            relation=_get(doc, "relation", str, None) or "",
            base_model=None if base is None else BaseModelRef(
                model=_need(base, "model", str, where="base_model."),
                resolved_revision=_get(base, "resolved_revision", str, None),
                source=_get(base, "source", str, None),
            ),
            adapter=_get(doc, "adapter", Mapping, None),
            layer_discovery=_get(doc, "layer_discovery", str, None),
            architecture=_get(doc, "architecture", str, None),
            discovery_note=_get(doc, "discovery_note", str, None),
            coverage=_get(doc, "coverage", Mapping, None),
            layer_count=_count(doc, "layer_count"),
            status_counts=_numbers(_get(doc, "status_counts", Mapping, {}), "status_counts",
                                   counts=True),
            summary=_summary(doc),
            layers_name=_file_name(outputs, "layers") or LAYERS_NAME,
            eigs_name=_file_name(outputs, "eigs"),
            timings=_numbers(_get(doc, "timings", Mapping, {}), "timings"),
            device=_get(doc, "device", Mapping, None),
            versions=dict(_get(doc, "versions", Mapping, {})),
            started_at=_get(doc, "started_at", str, None),
            finished_at=_get(doc, "finished_at", str, None),
            files=_seals(_get(doc, "files", Mapping, {})),
        )

    def vouched_names(self) -> tuple[str, ...]:
        """The files this marker stands for: its layer table, and its eigenvalues if any."""
        return (self.layers_name,) if self.eigs_name is None else (
            self.layers_name, self.eigs_name)


def _not_finite(constant: str) -> Any:
    """json's hook for NaN and ±Infinity, which no marker holds (to_json refuses them)."""
    raise MarkerError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    """json's hook for a number with a fraction or exponent: 1e999 would be infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise MarkerError(f"{_shown(text)} is not a finite number")
    return value


def _shown(value: Any, limit: int = 80) -> str:
    """`value` for a message, at most `limit` characters of its repr: a marker's field may
    be of any length, and the message goes to the log."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _file_name(outputs: Mapping[str, Any], name: str) -> str | None:
    value = _get(outputs, name, str, None, where="outputs.")
    if value is not None and not _FILE_NAME.fullmatch(value):
        raise MarkerError(f"outputs.{name} is not a file name: {_shown(value)}")
    return value


def _count(doc: Mapping[str, Any], name: str) -> int | None:
    value = _get(doc, name, int, None)
    if value is not None and value < 0:
        raise MarkerError(f"{name} must be >= 0, got {value}")
    return value


def _numbers(values: Mapping[str, Any], where: str, *, counts: bool = False) -> dict[str, Any]:
    """`values` when each is a number or null (counts: a whole number >= 0), as the worker
    writes them; MarkerError naming the first that is not."""
    for key, value in values.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if counts:
            fits = number and isinstance(value, int) and value >= 0
        else:
            fits = value is None or number
        if not fits:
            kind = "a count" if counts else "a number or null"
            raise MarkerError(f"{where}.{_shown(key, 40)} must be {kind}, got {_shown(value)}")
    return dict(values)


def _summary(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    summary = _get(doc, "summary", Mapping, None)
    return None if summary is None else _numbers(summary, "summary")


def _seals(doc: Mapping[str, Any]) -> dict[str, FileSeal]:
    seals = {}
    for name, entry in doc.items():
        if not _FILE_NAME.fullmatch(str(name)):
            raise MarkerError(f"files: {_shown(name)} is not a file name")
        if not isinstance(entry, Mapping):
            raise MarkerError(f"files.{name} must be an object, got {_shown(entry)}")
        size = _need(entry, "size", int, where=f"files.{name}.")
        digest = _need(entry, "sha256", str, where=f"files.{name}.")
        if size < 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise MarkerError(f"files.{name} is not a size and a SHA-256: {_shown(dict(entry))}")
        seals[str(name)] = FileSeal(size=size, sha256=digest)
    return seals


def _need(doc: Mapping[str, Any], name: str, kind: type, *, where: str = "") -> Any:
    if name not in doc:
        raise MarkerError(f"lacks {(where + name)!r}")
    value = _get(doc, name, kind, None, where=where)
    if value is None:
        raise MarkerError(f"{where}{name} must not be null")
    return value


def _get(doc: Mapping[str, Any], name: str, kind: type, default: Any, *, where: str = "") -> Any:
    value = doc.get(name)
    if value is None:
        return default
    # bool is an int subclass: keep them apart.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MarkerError(f"{where}{name} must be {kind.__name__}, got {_shown(value)}")
    return value


# -- whether a model's files are whole ------------------------------------------------------------


def check_listed(marker: Marker, sizes: Mapping[str, int]) -> str | None:
    """What is wrong with the files `marker` vouches for, given the sizes a listing gave
    (file name → bytes, for the model's folder); None when each is there at its sealed
    size. Markers without seals (written before them) are checked for presence only."""
    for name in marker.vouched_names():
        size = sizes.get(name)
        if size is None:
            return f"{name} is missing"
        seal = marker.files.get(name)
        if seal is not None and size != seal.size:
            return f"{name} has {size} bytes, its marker says {seal.size}"
    return None


def check_data(marker: Marker, name: str, data: bytes | None) -> bytes:
    """`data`, the model's file `name`, when it is what the marker sealed; DamagedResult
    naming the file when it is missing or differs in size or SHA-256 (a file the marker
    has no seal for is taken as it is)."""
    if data is None:
        raise DamagedResult(f"{name} is missing")
    seal = marker.files.get(name)
    if seal is not None:
        if len(data) != seal.size:
            raise DamagedResult(f"{name} has {len(data)} bytes, its marker says {seal.size}")
        if hashlib.sha256(data).hexdigest() != seal.sha256:
            raise DamagedResult(f"{name} is corrupt: its SHA-256 is not the one its marker "
                                "vouches for")
    return data
