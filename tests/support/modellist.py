"""Builders for model-list tests: CSV files, adapter directories, rows."""

from __future__ import annotations

import json
from pathlib import Path

from esd_worker.core.models.modellist import (
    ModelRow,
)


def write_list(tmp_path: Path, text: str, name: str = "models.csv", *, bom: bool = False) -> Path:
    path = tmp_path / name
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


def make_adapter_dir(tmp_path: Path, name: str, config: dict[str, object] | None) -> Path:
    """A local adapter directory; config None means no adapter_config.json at all."""
    directory = tmp_path / name
    directory.mkdir()
    if config is not None:
        (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def make_model_row(
    model_id: str = "org/model", revision: str | None = None, *, relation: str = "",
    source_model: str | None = None, line: int = 0,
) -> ModelRow:
    return ModelRow(model_id, revision, relation, source_model, line=line)


HEADER = "model_id,base_model_relation,source_model\n"


GOOD = "org/good,base,\n"
