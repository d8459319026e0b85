"""Model ids, revisions, local paths and the stable `model_key` derived from them.

Owns what a reference is: a hub id (`org/name[@rev]`, kept exactly as written) or a local
path (made absolute here, and only here). A path is made absolute against the working
directory and the home directory as text; the disk is looked at only to find a '..' that
would leave a symlink (`symlink_before_dotdot`), where the text and the OS disagree.
"""

from __future__ import annotations

import hashlib
import os
import re

_SLUG_BAD = re.compile(r"[^a-z0-9]+")
_PATH_SEP = re.compile(r"[/\\]+")
_KEY_SLUG_MAX = 80
_REVISION_SLUG_MAX = 12
KEY_MAX = _KEY_SLUG_MAX + 1 + 10  # slug, "-", 10 hex digits of the hash
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_MODEL_KEY = re.compile(rf"[a-z0-9][a-z0-9-]{{0,{KEY_MAX - 1}}}")


def is_local_path(ref: str) -> bool:
    """True for references taken as paths: they start with /, ./, ../ or ~, or are . or ..
    (anything else is a hub id, even where a directory of that name exists)."""
    return ref.startswith(_LOCAL_PREFIXES) or ref in (".", "..")


def local_path(path: str) -> str:
    """`path` absolute and normalised, as the one spelling of a local model: `~` expanded,
    relative to the working directory, `.`, `..`, repeated and trailing `/` folded (so
    `/m`, `/m/`, `//m` and `./m` run from `/` are all `/m`). Symlinks are kept: a link
    names its model as the user wrote it, and resolving it would make the key depend on
    where the link points today."""
    normal = os.path.abspath(os.path.expanduser(path))
    # POSIX lets a leading '//' mean something else, so normpath keeps it; on Linux it
    # is '/', and one directory must not have two keys.
    return "/" + normal.lstrip("/") if normal.startswith("//") else normal


def symlink_before_dotdot(path: str) -> str | None:
    """The symlink a '..' of `path` steps back out of, or None when there is none.

    `local_path` folds '..' as text (`link/../g` is `./g`); the OS goes to the parent of
    the link's target instead, another directory. Where the two part ways the path must be
    refused, or another model would be analysed under the name given. Only a '..' that
    follows a symlink (after the folds before it) parts them; `link/x/..` is the link
    either way. The one look at the disk in this module: lstat of the components a '..'
    follows (a missing one is no link: the worker reports the missing model)."""
    expanded = os.path.expanduser(path)
    if ".." not in expanded.split("/"):
        return None
    folded: list[str] = []
    for part in os.path.join(os.getcwd(), expanded).split("/"):
        if part in ("", "."):
            continue
        if part != "..":
            folded.append(part)
        elif folded:
            here = "/" + "/".join(folded)
            if os.path.islink(here):
                return here
            folded.pop()
    return None


def normalize_model_ref(ref: str) -> str:
    """A model reference in its one spelling: a local path through `local_path`, a hub id
    (`org/name`, `org/name@rev`) stripped of surrounding whitespace and otherwise as is."""
    ref = ref.strip()
    return local_path(ref) if is_local_path(ref) else ref


def split_model_ref(ref: str) -> tuple[str, str | None]:
    """Split `org/name@revision` into id and revision (None when not given).

    Local paths may contain '@' in a directory name, so only the last '@' counts and
    only when something follows it.
    """
    ref = ref.strip()
    if "@" in ref:
        model_id, _, revision = ref.rpartition("@")
        if model_id and revision:
            return model_id, revision
    return ref, None


def is_model_key(key: object) -> bool:
    """Whether `key` has the shape `model_key` gives every key: 1 to KEY_MAX characters of
    [a-z0-9-], not starting with '-'. A key that comes from outside (a protocol request, a
    marker) is checked against this before it names anything in the store."""
    return isinstance(key, str) and _MODEL_KEY.fullmatch(key) is not None


def _slug(text: str) -> str:
    return _SLUG_BAD.sub("-", text.lower()).strip("-")


def model_key(model_id: str, revision: str | None = None) -> str:
    """Readable slug of id and revision plus a short hash of both, stable across machines.

    The slug is made of the last two path segments of the id: a hub id `org/name` has
    exactly those, and a local path (`/data/models/org/name`, `./name`, `C:\\models\\x`)
    keeps only the part that names the model, not the machine's directory layout. The
    hash is of the exact, case-sensitive id and revision, so ids that slug alike (two
    paths ending alike, `Org/Name` vs `org/name`) still get distinct keys; the slug is
    only for people. Keys are at most KEY_MAX characters of [a-z0-9-].
    """
    ident = model_id if revision is None else f"{model_id}@{revision}"
    digest = hashlib.sha256(ident.encode("utf-8")).hexdigest()[:10]
    segments = [s for s in map(_slug, _PATH_SEP.split(model_id)) if s]
    slug = "--".join(segments[-2:])
    if revision:
        slug = f"{slug}--{_slug(revision)[:_REVISION_SLUG_MAX]}"
    slug = slug[:_KEY_SLUG_MAX].strip("-") or "model"
    return f"{slug}-{digest}"
