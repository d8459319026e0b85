"""Fixtures the worker's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def in_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in <tmp>/work with HOME at <tmp>/home: relative paths and `~` have one meaning.
    Returns <tmp>."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path
