"""A model's weight shape before any download: its parameters and its largest matrix's width.

Owns the WeightShape (the GPU rule's input, controller.gpu.gpurule) and where it comes from:
the model list's num_params and matrix_dim columns; the safetensors headers of a local
directory's weight files (parsed and checked by esd_worker.core.models.safetensors, as the
worker's reader does: a header the worker refuses gives no shape here either; no tensor data
is read); or the hub: the model info's parameter count (the Sizer's lookup, shared with
sizes: no second call) and, only for a model big enough that its width can change the
answer (GpuRule.width_matters: ~95B parameters and up at the default threshold), the header
of its first safetensors file through Range requests (the first 100 kB, as huggingface_hub's
get_safetensors_metadata does, then the rest if the header is longer).
An adapter's shape is its base's: the worker analyses the merged matrices. Does not talk
HTTP itself (the Sizer's client does, within its rate, retry and lookup limits;
HF_HUB_OFFLINE=1: no request), turn a shape into a GPU count (controller.gpu.counts) or
decide which GPUs a worker gets (the backends).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controller.weights.sizing import Sizer, local_files
from esd_worker.core.estimate import width_from_params
from esd_worker.core.models.modellist import ModelRow
from esd_worker.core.models.naming import is_local_path, parse_ref
from esd_worker.core.models.safetensors import (
    PREFIX_BYTES,
    Header,
    HeaderError,
    header_length,
    parse_header,
    read_header,
)
from esd_worker.core.models.weightfiles import GGUF_BITS, gguf_quant, weight_names

log = logging.getLogger(__name__)

PARAMS_COLUMN = "num_params"  # an optional model-list column: parameters ("70e9", "70B")
WIDTH_COLUMN = "matrix_dim"  # an optional column: the smaller side of the largest matrix
MAX_PARAMS = 10**15  # 1000T parameters: a num_params past it is no model's
MAX_WIDTH = 10**7  # a matrix_dim past it is no model's matrix
FIRST_READ_BYTES = 100_001  # bytes=0-100000: one request holds ~97% of the hub's headers
_WARNED = 5  # bad headers logged one by one; the rest only counted
_COUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}

Listed = Callable[[str], "ModelRow | None"]  # a model key -> the run's row of it, if listed


@dataclass(frozen=True)
class HeaderShape:
    """One safetensors file's tensors: params (elements, all tensors), width (the largest
    smaller side of a 2-D or 4-D tensor, 0 if none) and data_bytes (their bytes on disk)."""

    params: int
    width: int
    data_bytes: int


def header_shape(header: Header) -> HeaderShape:
    """The shape of a header's tensors. Width as the worker sees it: a 2-D weight's Gram
    has the smaller side's width; a 4-D (conv) weight [out, in, kh, kw] is kh·kw matrices of
    out x in (esd_worker.analysis.spectra.as_matrices); other ranks are not analysed."""
    shapes = [t.shape for t in header.tensors.values()]
    width = max((min(s[0], s[1]) for s in shapes if len(s) in (2, 4)), default=0)
    return HeaderShape(sum(math.prod(s) for s in shapes), width, header.data_bytes)


def read_shape(path: Path) -> HeaderShape:
    """A local safetensors file's header shape (OSError, HeaderError)."""
    return header_shape(read_header(path))


def local_shape(directory: Path) -> WeightShape | None:
    """The shape of a local model from its weight files (esd_worker.core.models.weightfiles,
    with its component folders): every safetensors header read; files without one
    (pytorch_model*.bin, GGUF) give an estimate from their bytes (bytes_params). None without
    weights. Raises OSError, HeaderError."""
    sizes = local_files(directory)
    files = weight_names(sizes)
    if not files:
        return None
    if not all(name.endswith(".safetensors") for name in files):
        params = bytes_params(sizes, files)
        return WeightShape(params, width_from_params(params), "local", width_inferred=True)
    headers = [read_shape(directory / name) for name in files]
    params = sum(h.params for h in headers)
    return WeightShape(params, max(h.width for h in headers) or 1, "local")


def bytes_params(sizes: Mapping[str, int], files: list[str]) -> int:
    """The parameters `files` hold, guessed from their bytes: 2 a parameter (16-bit
    weights), a GGUF file's by the bits per weight of its name's quantization tag
    (weightfiles.GGUF_BITS; 4.5 without one)."""
    params = 0.0
    for name in files:
        if name.lower().endswith(".gguf"):
            tag = gguf_quant(name)
            params += sizes[name] * 8 / (GGUF_BITS[tag] if tag else 4.5)
        else:
            params += sizes[name] / 2
    return int(params)


@dataclass(frozen=True)
class WeightShape:
    """What the rule needs of a model's weights: params (P, all tensors), width (n, the smaller
    side of its largest 2-D/4-D weight: its Gram's width), where they came from ("column",
    "local" or "hub") and width_inferred: the width is width_from_params' guess."""

    params: int
    width: int
    source: str = "column"
    width_inferred: bool = False


class WidthRule(Protocol):
    """What the finder asks of the GPU rule (controller.gpu.gpurule.GpuRule): whether a
    model of `params` parameters is big enough that its matrices' width can change its
    GPU count (only then is a hub header worth its requests)."""

    def width_matters(self, params: int) -> bool: ...


@dataclass
class ShapeStats:
    """Where the models' shapes came from (column, local, hub) and how many stayed unknown:
    each model once (the first 100,000; a sharded plan reads its list twice)."""

    column: int = 0
    local: int = 0
    hub: int = 0
    unknown: int = 0


class ShapeFinder:
    """A model's WeightShape before download: the list's columns, else its local directory's
    headers, else the hub (through `sizer`: its model info, and a header only when
    rule.width_matters); None when nothing says (offline, lookup limit, a failed lookup, a
    bad header, an adapter whose base is not known)."""

    def __init__(self, sizer: Sizer, rule: WidthRule) -> None:
        self.sizer = sizer
        self.rule = rule
        self._bad_headers = 0
        self._hub_shapes: dict[str, WeightShape | None] = {}  # ref -> shape (looked up)
        self._lock = threading.Lock()

    def needs_hub(self, row: ModelRow, listed: Listed | None = None) -> bool:
        """Whether shape(row) would ask the hub (the others are answered at once)."""
        target = _target(row, listed)
        if target is None or self._columns(row) or self._columns(target):
            return False
        return not is_local_path(target.model_id) and not self.sizer.offline

    def shape(self, row: ModelRow, listed: Listed | None = None) -> WeightShape | None:
        """`row`'s shape (its base's for an adapter, unless its own row has the columns)."""
        target = _target(row, listed)
        columns = self._columns(row) or (self._columns(target) if target is not None else None)
        if target is None:
            return columns
        width = self._width(target) or self._width(row)
        if columns is not None:
            shape: WeightShape | None = columns
        elif is_local_path(target.model_id):
            shape = self._local(target)
        else:
            shape = self._hub(target)
        if shape is not None and width and shape.source != "column":
            shape = WeightShape(shape.params, width, shape.source)  # the list knows better
        return shape

    def _columns(self, row: ModelRow) -> WeightShape | None:
        """The shape the list's columns give: num_params, with matrix_dim or inferred."""
        params = self.sizer.cells.read(row, PARAMS_COLUMN, _parse_count, lo=1, hi=MAX_PARAMS,
                                       what="a parameter count from 1 to 1000T")
        if params is None:
            return None
        width = self._width(row)
        if width:
            return WeightShape(params, width, "column")
        return WeightShape(params, width_from_params(params), "column", width_inferred=True)

    def _width(self, row: ModelRow) -> int | None:
        return self.sizer.cells.read(row, WIDTH_COLUMN, _parse_count, lo=1, hi=MAX_WIDTH,
                                     what=f"a matrix side from 1 to {MAX_WIDTH}")

    def _local(self, row: ModelRow) -> WeightShape | None:
        try:
            return local_shape(Path(os.path.expanduser(row.model_id)))
        except (OSError, HeaderError) as e:
            self._bad_header(row, str(getattr(e, "strerror", None) or e))
            return None

    def _hub(self, row: ModelRow) -> WeightShape | None:
        # Memoised: a sharded plan asks twice and must get the same answer, and a header
        # read is a lookup of its own (the Sizer memoises the model info).
        with self._lock:
            if row.ref in self._hub_shapes:
                return self._hub_shapes[row.ref]
        shape = self._hub_lookup(row)
        if self.sizer.hub_info(row) is not None:  # memoised: looked up, not skipped
            with self._lock:
                self._hub_shapes[row.ref] = shape
        return shape

    def _hub_lookup(self, row: ModelRow) -> WeightShape | None:
        info = self.sizer.hub_info(row)
        files = weight_names(info.files) if info is not None else []
        if info is None or not files:
            return None
        total = sum(info.files[name] for name in files)
        params = info.params or bytes_params(info.files, files)  # without the hub's count
        inferred = WeightShape(params, width_from_params(params), "hub", width_inferred=True)
        tensors = [name for name in files if name.endswith(".safetensors")]
        if not tensors or not self.rule.width_matters(params):
            return inferred
        # The first file (of a sharded checkpoint, model-00001-of-…) holds the embeddings
        # and the first layers: a transformer's widest matrices are there like anywhere.
        head = self._hub_header(row, tensors[0])
        if head is None or head.width == 0:
            return inferred
        if info.params is None and head.data_bytes:
            params = round(total * head.params / head.data_bytes)  # its dtype's bytes
        return WeightShape(params, head.width, "hub")

    def _hub_header(self, row: ModelRow, name: str) -> HeaderShape | None:
        first = self.sizer.read_range(row, name, 0, FIRST_READ_BYTES - 1)
        if first is None:
            return None
        try:
            length = header_length(first)
            raw = first[PREFIX_BYTES:PREFIX_BYTES + length]
            if len(raw) < length:
                rest = self.sizer.read_range(row, name, len(first), PREFIX_BYTES + length - 1)
                if rest is None:
                    return None
                raw += rest
            if len(raw) < length:
                raise HeaderError(f"the header is cut off ({len(raw)} of {length} bytes)")
            return header_shape(parse_header(raw))
        except HeaderError as e:
            self._bad_header(row, f"{name}: {e}")
            return None

    def _bad_header(self, row: ModelRow, why: str) -> None:
        with self._lock:
            self._bad_headers += 1
            count = self._bad_headers
        if count <= _WARNED:
            log.warning("model=%s: cannot read its weights' shape (%s): it gets one GPU%s",
                        row.ref, why, "; further ones are only counted" if count == _WARNED
                        else "")


def _target(row: ModelRow, listed: Listed | None) -> ModelRow | None:
    """The row whose weights decide `row`'s cost: its own, or an adapter's base (its listed
    row if any; a local adapter's adapter_config.json when the list names no base)."""
    if not row.is_adapter:
        return row
    source = row.source_model
    if not source and is_local_path(row.model_id):
        config = Path(os.path.expanduser(row.model_id)) / "adapter_config.json"
        try:
            base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            base = None
        source = base if isinstance(base, str) and base else None
    if not source:
        return None
    model_id, revision, problem = parse_ref(source)
    if problem is not None:
        return None
    base_row = ModelRow(model_id, revision, "", None)
    return (listed(base_row.key) if listed is not None else None) or base_row


def _parse_count(text: str) -> float | None:
    """A count such as 7000000000, 7e9, 7B or 1.5T (k, M, B, T: 10³ … 10¹²); None if it is
    not one (its range is ListNumbers.read's)."""
    match = _COUNT.fullmatch(text)
    if match is None:
        return None
    return float(match.group(1)) * _SCALE[match.group(2).lower()]
