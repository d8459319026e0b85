"""esd_worker.files.open_regular: a regular file is opened or created, anything else planted at
the name is refused without touching what it points at, and a FIFO does not hang."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from esd_worker.files import NotRegularFileError, open_regular

APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND
TARGET = b"someone else's file\n"


def plant(path: Path, kind: str) -> Path:
    """Put a `kind` at `path`; returns the file a link there would name."""
    target = path.parent / "target.txt"
    if kind == "file":
        path.write_bytes(TARGET)
    elif kind == "symlink":
        target.write_bytes(TARGET)
        path.symlink_to(target)
    elif kind == "dangling-symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    return target


@pytest.mark.parametrize(
    ("kind", "refused_as"),
    [
        ("missing", None),
        ("file", None),
        ("symlink", "a symbolic link"),
        ("dangling-symlink", "a symbolic link"),
        ("fifo", "a FIFO"),
        ("folder", "a folder"),
    ],
    ids=["created", "appended", "symlink", "dangling-symlink", "fifo", "folder"],
)
def test_only_a_regular_file_is_opened(tmp_path: Path, kind: str, refused_as: str | None) -> None:
    """What a caller could be made to write through is refused: a symlink (even one to
    nowhere, which O_CREAT would create), a FIFO (opening it to write waits for a reader:
    refused at once instead), a folder. A file, there or not, is opened as os.open would.
    The refusal says what was found, and the link's target keeps its bytes or stays absent."""
    path = tmp_path / "x.log"
    target = plant(path, kind)
    if refused_as is None:
        fd = open_regular(path, APPEND)
        try:
            os.write(fd, b"line\n")
            assert os.get_blocking(fd)
        finally:
            os.close(fd)
        assert path.read_bytes() == (TARGET if kind == "file" else b"") + b"line\n"
        return
    with pytest.raises(NotRegularFileError) as raised:
        open_regular(path, APPEND)
    assert str(raised.value) == (f"it is {refused_as}, not a regular file; refused (remove it "
                                 "if it is not yours)")
    assert raised.value.filename == str(path)
    if kind == "symlink":
        assert target.read_bytes() == TARGET
    else:
        assert not target.exists()
