"""esd_worker.core.files: open_regular opens or creates a regular file, anything else planted at the
name is refused without touching what it points at, a FIFO does not hang, and with owned=True
another user's file is refused; write_atomic writes a file whole without ever writing
through a link planted at its name or at its temporary name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from esd_worker.core import files
from esd_worker.core.files import NotOwnedFileError, NotRegularFileError, open_regular, write_atomic

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


# --- a file that is not ours ------------------------------------------------------------------

OTHER_UID = 65534  # nobody


def chown_to_another_user(path: Path) -> None:
    """Give `path` to another user, as if they had created it in a folder both may write."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user takes root (chown), and these tests do "
                    "not run as root here")
    os.chown(path, OTHER_UID, -1)


@pytest.mark.parametrize(
    ("owner", "owned", "refused"),
    [("us", True, False), ("another user", False, False), ("another user", True, True)],
    ids=["ours", "theirs-not-asked", "theirs-refused"],
)
def test_owned_refuses_another_users_file(tmp_path: Path, owner: str, owned: bool,
                                          refused: bool) -> None:
    """owned=True (a log: what we write there must stay ours to read) refuses a regular
    file someone else created, say 0666 in a shared folder, so that they could read every
    line we append: it is left as it was. Without owned= (the lease, which sweeps of
    several users share) it is opened as before."""
    path = tmp_path / "x.log"
    path.write_bytes(TARGET)
    path.chmod(0o666)
    if owner == "another user":
        chown_to_another_user(path)
    if not refused:
        os.close(open_regular(path, APPEND, owned=owned))
        return
    with pytest.raises(NotOwnedFileError) as raised:
        open_regular(path, APPEND, owned=owned)
    assert str(raised.value) == (f"it belongs to another user (uid {OTHER_UID}), who could "
                                 "read what is written to it; refused (remove it if it is "
                                 "not yours)")
    assert raised.value.filename == str(path)
    assert isinstance(raised.value, OSError)
    assert path.read_bytes() == TARGET
    assert (path.stat().st_mode & 0o777, path.stat().st_uid) == (0o666, OTHER_UID)


# --- a file written whole, by rename ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "file", "symlink", "dangling-symlink"],
                         ids=["created", "replaced", "symlink", "dangling-symlink"])
def test_write_atomic_replaces_the_name_never_what_a_link_names(tmp_path: Path,
                                                                kind: str) -> None:
    """The data lands at the name as a regular file whatever was there: a symlink at the name
    is itself replaced (rename(2) acts on the name), so the file it names keeps its bytes and
    a dangling link's target is not created. No temporary file is left beside it."""
    path = tmp_path / "report.json"
    target = plant(path, kind)
    write_atomic(path, b"new\n")
    assert path.read_bytes() == b"new\n" and not path.is_symlink()
    if kind == "symlink":
        assert target.read_bytes() == TARGET
    elif kind == "dangling-symlink":
        assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"report.json"} | ({"target.txt"} if kind == "symlink" else set()))


@pytest.mark.parametrize(("kind", "refused_as"), [
    ("fifo", "a FIFO"),
    ("link-to-fifo", "a symbolic link to a FIFO"),
    ("link-to-dev-null", "a symbolic link to a device"),
])
def test_write_atomic_never_replaces_a_device_or_a_pipe(tmp_path: Path, kind: str,
                                                         refused_as: str) -> None:
    """`--out /dev/stdout` (a link to a pipe or a terminal) or a FIFO at the name: replacing
    it would, run as root, remove a system file; it is refused and left as it was."""
    path = tmp_path / "out.csv"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    else:
        path.symlink_to(os.devnull)
    with pytest.raises(NotRegularFileError, match=refused_as):
        write_atomic(path, b"new\n")
    assert path.is_symlink() or path.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"out.csv"} | ({"pipe"} if kind == "link-to-fifo" else set()))


@pytest.mark.parametrize(("umask", "mode", "expected"),
                         [(0o022, 0o666, 0o644), (0o027, 0o666, 0o640), (0o022, 0o600, 0o600)],
                         ids=["022", "027", "private"])
def test_write_atomic_mode_is_as_os_open_gives_it(tmp_path: Path, umask: int, mode: int,
                                                  expected: int) -> None:
    """mode is given at creation, so the umask clears bits as for any file a tool creates
    (results a shared folder or a web server reads follow it)."""
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "r.json", b"{}", mode)
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == expected


def test_write_atomic_never_writes_through_a_link_at_a_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a temporary name someone guessed and planted a link at is not written through:
    it is created exclusively (O_EXCL), so the planted link is passed over for another name
    and the file it names keeps its bytes. (The random part is made predictable here.)"""
    tokens = iter(["guessed", "guessed", "fresh"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda _n: next(tokens))
    target = tmp_path / "target.txt"
    target.write_bytes(TARGET)
    (tmp_path / ".r.json.guessed.tmp").symlink_to(target)
    write_atomic(tmp_path / "r.json", b"new\n")
    assert target.read_bytes() == TARGET
    assert (tmp_path / "r.json").read_bytes() == b"new\n"
    assert (tmp_path / ".r.json.guessed.tmp").is_symlink()  # theirs: left alone
    assert not (tmp_path / ".r.json.fresh.tmp").exists()


def test_write_atomic_leaves_nothing_when_it_fails(tmp_path: Path) -> None:
    """A rename that fails (a folder at the name) raises OSError and removes the
    temporary file: the folder holds what it held."""
    (tmp_path / "r.json").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "r.json", b"new\n")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
