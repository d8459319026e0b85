"""Tests of esd_worker.core.store.stores and .opener: the LocalStore contract and output-URL
parsing (no network)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from esd_worker.core.errors import (
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    EXIT_USAGE,
    StoreError,
    StorePathError,
    UsageError,
)
from esd_worker.core.store.opener import open_store, parse_s3_url
from esd_worker.core.store.stores import (
    READ_PART,
    LocalStore,
    Store,
    local_store_error,
    normalize_key,
)

# --- LocalStore -----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "results")


def test_put_get_exists_delete_round_trip(store: LocalStore) -> None:
    """The Store contract: a missing key reads None, a written one reads back exactly."""
    assert store.get_bytes("m/result.json") is None
    assert not store.exists("m/result.json")
    store.put_bytes("m/result.json", b"{}\n")
    assert store.get_bytes("m/result.json") == b"{}\n"
    assert store.exists("m/result.json")
    assert (store.root / "m" / "result.json").read_bytes() == b"{}\n"
    store.put_bytes("m/result.json", b"new")
    assert store.get_bytes("m/result.json") == b"new"
    store.delete("m/result.json")
    assert not store.exists("m/result.json")
    store.delete("m/result.json")  # a missing key is not an error


PARTS = [b"", b"a,b\n", b"\xc3", b"\xa9\n" * 1000, b"", bytes(range(256)) * 5000]


def test_parts_round_trip(store: LocalStore) -> None:
    """put_parts writes the parts joined (empty ones too, a character cut between two);
    get_parts reads them back in parts of at most READ_PART bytes; None when missing."""
    assert store.get_parts("summary.csv") is None
    store.put_parts("summary.csv", iter(PARTS))
    assert store.get_bytes("summary.csv") == b"".join(PARTS)
    parts = store.get_parts("summary.csv")
    assert parts is not None
    read = list(parts)
    assert b"".join(read) == b"".join(PARTS)
    assert max(map(len, read)) <= READ_PART < len(b"".join(PARTS))


def test_put_parts_writes_nothing_when_its_parts_fail(store: LocalStore) -> None:
    """A writer whose rows fail half way (a store read, say) leaves the old value whole and
    no temporary file: put_parts is as atomic as put_bytes."""
    store.put_parts("summary.csv", [b"old\n"])

    def failing() -> Iterator[bytes]:
        yield b"new\n" * 1000
        raise StoreError("a marker read failed")

    with pytest.raises(StoreError, match="marker read failed"):
        store.put_parts("summary.csv", failing())
    assert store.get_bytes("summary.csv") == b"old\n"
    assert sorted(p.name for p in store.root.iterdir()) == ["summary.csv"]


class JoiningStore(LocalStore):
    """A store with only the abstract methods' behaviour for parts: Store's defaults."""

    put_parts = Store.put_parts
    get_parts = Store.get_parts


def test_parts_default_to_whole_values(tmp_path: Path) -> None:
    store = JoiningStore(tmp_path / "results")
    assert store.get_parts("k") is None
    store.put_parts("k", iter(PARTS))
    parts = store.get_parts("k")
    assert parts is not None and list(parts) == [b"".join(PARTS)]


def test_put_is_atomic_for_readers(store: LocalStore) -> None:
    """A reader racing many rewrites sees one whole value or the other, never a part of one."""
    a, b = b"a" * 1_000_000, b"b" * 1_000_000
    store.put_bytes("k", a)
    seen: set[bytes] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            value = store.get_bytes("k")
            assert value is not None
            seen.add(value[:1] + value[-1:] + str(len(value)).encode())

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(30):
        store.put_bytes("k", b if i % 2 else a)
    done.set()
    reader.join()
    assert seen <= {b"aa1000000", b"bb1000000"}
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]  # no leftovers


def test_list_keys_by_folder(store: LocalStore) -> None:
    """list_keys(prefix) means the folder `prefix`: 'a' does not match 'ab/...'."""
    for key in ("a/result.json", "a/layers.csv", "ab/result.json", "_failures/a.json", "top"):
        store.put_bytes(key, b"x")
    assert sorted(store.list_keys()) == sorted(
        ["a/result.json", "a/layers.csv", "ab/result.json", "_failures/a.json", "top"]
    )
    assert sorted(store.list_keys("a")) == ["a/layers.csv", "a/result.json"]
    assert list(store.list_keys("_failures")) == ["_failures/a.json"]
    assert list(store.list_keys("missing")) == []


def test_list_keys_of_a_store_not_yet_written(tmp_path: Path) -> None:
    assert list(LocalStore(tmp_path / "never").list_keys()) == []


def test_list_keys_skips_unfinished_writes(store: LocalStore) -> None:
    """A temp file of an interrupted put (.<name>.<random>.tmp) is not a key."""
    store.put_bytes("m/layers.csv", b"x")
    (store.root / "m" / ".result.json.abc123.tmp").write_bytes(b"partial")
    assert list(store.list_keys()) == ["m/layers.csv"]


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty"),
        pytest.param("/", id="only-slash"),
        pytest.param("../escape", id="dotdot"),
        pytest.param("a/../../b", id="inner-dotdot"),
        pytest.param("./a", id="dot"),
    ],
)
def test_invalid_keys_are_refused(store: LocalStore, key: str) -> None:
    for call in (lambda: store.put_bytes(key, b"x"), lambda: store.get_bytes(key),
                 lambda: store.exists(key), lambda: store.delete(key)):
        with pytest.raises(StoreError, match="invalid store key"):
            call()
    assert not store.root.exists()


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param("a/b", "a/b", id="plain"),
        pytest.param("/a//b/", "a/b", id="extra-slashes"),
        pytest.param("a.b/..c", "a.b/..c", id="dots-inside-names"),
    ],
)
def test_normalize_key(key: str, expected: str) -> None:
    assert normalize_key(key) == expected


AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _file_in_the_way(store: LocalStore) -> None:
    """`<root>/m` a file where the key m/result.json needs a folder."""
    store.root.mkdir(parents=True)
    (store.root / "m").write_text("a file")


def _folder_in_the_way(store: LocalStore) -> None:
    """`<root>/m/result.json` a folder where the key needs a file."""
    (store.root / "m" / "result.json").mkdir(parents=True)


@pytest.mark.parametrize(
    ("setup", "call"),
    [
        pytest.param(_file_in_the_way, lambda s: s.put_bytes("m/result.json", b"{}"),
                     id="write-where-a-file-holds-the-folder-name"),
        pytest.param(_folder_in_the_way, lambda s: s.put_bytes("m/result.json", b"{}"),
                     id="write-where-a-folder-holds-the-file-name"),
        pytest.param(_folder_in_the_way, lambda s: s.get_bytes("m/result.json"),
                     id="read-a-folder"),
        pytest.param(_file_in_the_way, lambda s: s.get_bytes("m/result.json"),
                     id="read-below-a-file"),
    ],
)
def test_paths_no_retry_can_fix_are_permanent(
    store: LocalStore, setup: Callable[[LocalStore], None], call: Callable[[LocalStore], object]
) -> None:
    """A file where a folder should be, or the reverse, fails every retry the same way:
    StorePathError, exit 3 (not 4, which made the controller retry a hopeless model).
    Made from files, not permissions, so these hold when the tests run as root."""
    setup(store)
    with pytest.raises(StorePathError, match="fix the output folder") as info:
        call(store)
    assert info.value.exit_code == EXIT_PERMANENT


def test_root_under_a_file_is_permanent(tmp_path: Path) -> None:
    """The check (before any work) and a write both say so; works as root too."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = LocalStore(blocker / "results")
    with pytest.raises(StorePathError, match="cannot write") as info:
        store.put_bytes("m/result.json", b"{}")
    assert info.value.exit_code == EXIT_PERMANENT
    with pytest.raises(StorePathError, match=r"cannot write to .*: .*/file is not a directory"):
        store.check()


@pytest.mark.skipif(AS_ROOT, reason="root may write to a read-only folder")
def test_read_only_folder_is_permanent(tmp_path: Path) -> None:
    """No write permission: the check, a write and a look-up below it are permanent."""
    locked = tmp_path / "locked"
    locked.mkdir()
    store = LocalStore(locked / "results")
    locked.chmod(0o500)
    try:
        with pytest.raises(StorePathError, match="not writable"):
            store.check()
        with pytest.raises(StorePathError, match="Permission denied"):
            store.put_bytes("m/result.json", b"{}")
        locked.chmod(0o000)
        with pytest.raises(StorePathError, match="Permission denied"):
            store.exists("m/result.json")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(
    ("code", "permanent"),
    [
        pytest.param(errno.EACCES, True, id="EACCES"),
        pytest.param(errno.EPERM, True, id="EPERM"),
        pytest.param(errno.EROFS, True, id="EROFS"),
        pytest.param(errno.ENOTDIR, True, id="ENOTDIR"),
        pytest.param(errno.EISDIR, True, id="EISDIR"),
        pytest.param(errno.EEXIST, True, id="EEXIST"),
        pytest.param(errno.ENAMETOOLONG, True, id="ENAMETOOLONG"),
        pytest.param(errno.ENOSPC, False, id="ENOSPC"),
        pytest.param(errno.EDQUOT, False, id="EDQUOT"),
        pytest.param(errno.EIO, False, id="EIO"),
        pytest.param(errno.ESTALE, False, id="ESTALE"),
        pytest.param(errno.ENOENT, False, id="ENOENT"),
        pytest.param(None, False, id="no-errno"),
    ],
)
def test_local_store_errors_by_errno(code: int | None, permanent: bool) -> None:
    """Permanent (3) only where no retry can help: a path or a permission to fix. A full
    disk, an I/O error or a stale NFS handle can clear by itself: transient (4), retried."""
    error = OSError(code, os.strerror(code)) if code is not None else OSError("odd")
    got = local_store_error("write /out/m/result.json", error)
    assert type(got) is (StorePathError if permanent else StoreError)
    assert got.exit_code == (EXIT_PERMANENT if permanent else EXIT_TRANSIENT)
    assert str(got).startswith("cannot write /out/m/result.json: ")


def test_check_accepts_a_root_to_be_made_and_creates_nothing(tmp_path: Path) -> None:
    """A worker that fails before writing must not leave an empty output folder behind."""
    store = LocalStore(tmp_path / "a" / "b")
    store.check()
    assert not (tmp_path / "a").exists()
    store.root.mkdir(parents=True)
    store.check()


# --- open_store -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param("results", "{cwd}/results", id="relative"),
        pytest.param("./out/run1", "{cwd}/out/run1", id="dot-relative"),
        pytest.param("/abs/dir", "/abs/dir", id="absolute"),
        pytest.param("file:///abs/dir", "/abs/dir", id="file-url"),
        pytest.param("file://localhost/abs/dir", "/abs/dir", id="file-url-localhost"),
        pytest.param("file:///abs/with%20space", "/abs/with space", id="file-url-quoted"),
    ],
)
def test_open_store_local(url: str, expected: str, monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store(url)
    assert isinstance(store, LocalStore)
    assert store.root == Path(expected.format(cwd=tmp_path))


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        pytest.param("s3://bucket", "bucket", "", id="bucket-only"),
        pytest.param("s3://bucket/", "bucket", "", id="bucket-slash"),
        pytest.param("s3://bucket/results", "bucket", "results", id="prefix"),
        pytest.param("s3://my.bucket-1/a/b/c/", "my.bucket-1", "a/b/c", id="deep-prefix"),
        pytest.param("s3://bucket//a//b", "bucket", "a/b", id="double-slashes"),
        pytest.param("S3://bucket/x", "bucket", "x", id="scheme-case"),
    ],
)
def test_parse_s3_url(url: str, bucket: str, prefix: str) -> None:
    assert parse_s3_url(url) == (bucket, prefix)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        pytest.param("s3://", "invalid bucket name", id="no-bucket"),
        pytest.param("s3:///prefix", "invalid bucket name", id="empty-bucket"),
        pytest.param("s3://ab/x", "invalid bucket name", id="bucket-too-short"),
        pytest.param("s3://localhost:9000/b", "AWS_ENDPOINT_URL", id="endpoint-in-url"),
        pytest.param("s3://bucket/x?versionId=1", "not allowed", id="query"),
        pytest.param("s3://bucket/x#frag", "not allowed", id="fragment"),
        pytest.param("s3://bucket/a/../b", "not allowed", id="dotdot"),
        pytest.param("s3://AKIAEXAMPLE:s3cr3t@bucket/x", "credentials in an s3:// URL",
                     id="credentials"),
        pytest.param("gs://bucket/x", "unsupported output URL scheme 'gs'", id="other-scheme"),
        pytest.param("file://host/dir", "file URL with a host", id="file-host"),
    ],
)
def test_open_store_refuses_bad_urls(url: str, message: str) -> None:
    """A usage error (exit 2) naming the problem; credentials in a URL are never echoed."""
    with pytest.raises(UsageError, match=message) as info:
        open_store(url)
    assert info.value.exit_code == EXIT_USAGE
    assert "s3cr3t" not in str(info.value)


def test_userinfo_is_never_echoed_for_other_schemes() -> None:
    with pytest.raises(UsageError) as info:
        open_store("https://user:s3cr3t@example.org/x")
    assert "s3cr3t" not in str(info.value)


def test_store_module_does_not_import_boto3() -> None:
    """`import esd_worker.core.store.stores` stays cheap: boto3 only when an s3:// URL is opened."""
    code = ("import sys, esd_worker.core.store.stores; "
            "print(sorted(m for m in ('boto3', 'botocore', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_check_is_optional_for_stores() -> None:
    """Store.check() has a default (nothing to check), so other stores need not define it."""
    assert "check" not in Store.__abstractmethods__


def test_put_replaces_a_planted_link_and_leaves_its_target(store: LocalStore,
                                                           tmp_path: Path) -> None:
    """A results folder others may write: a symlink at a key's name is replaced by the
    object (rename acts on the name), so the file it named keeps its bytes."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the victim's own file\n")
    (store.root / "m").mkdir(parents=True)
    (store.root / "m" / "result.json").symlink_to(victim)
    store.put_bytes("m/result.json", b"{}")
    assert victim.read_bytes() == b"the victim's own file\n"
    assert not (store.root / "m" / "result.json").is_symlink()
    assert store.get_bytes("m/result.json") == b"{}"
