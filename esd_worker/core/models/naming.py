"""Model references: what a name in a model list or a `--model` flag means, its syntax, its
one spelling and the stable `model_key` of its results. The one owner of these rules: the
list reader (esd_worker.core.models.modellist), the worker's flags, resolver and inbox and the
controller's planners all call this module and parse nothing themselves.

The rule: a name that starts with `/`, `./`, `../` or `~` (or is `.` or `..`) is a local
path; its id is its absolute, normalised path (`local_path`), so `./models/x` read in
/data and `/data/models/x` are one model with one key, and it has no revision (an '@' is
part of a directory name). Everything else is a hub id `org/name[@revision]`, checked
against the hub's syntax (`repo_id_problem`, `revision_problem`), even where a folder of
that name exists here: `models/x` is the hub repo models/x, never the folder ./models/x
(`folder_warning` says so to whoever reads such a name from a person). A name never means
one thing on one machine and another elsewhere.

A path is made absolute against the working directory and the home directory as text; the
disk is looked at only to find a '..' that would leave a symlink (`symlink_before_dotdot`),
where the text and the OS disagree, and to notice a hub id that is also a folder here.
"""

from __future__ import annotations

import hashlib
import os
import re

from esd_worker.core.echo import has_control, quoted
from esd_worker.core.redact import REDACTED

_SLUG_BAD = re.compile(r"[^a-z0-9]+")
_PATH_SEP = re.compile(r"[/\\]+")
_KEY_SLUG_MAX = 80
_REVISION_SLUG_MAX = 12
KEY_MAX = _KEY_SLUG_MAX + 1 + 10  # slug, "-", 10 hex digits of the hash
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_MODEL_KEY = re.compile(rf"[a-z0-9][a-z0-9-]{{0,{KEY_MAX - 1}}}")

# huggingface_hub.utils.validate_repo_id, written out so the controller needs no hub client:
# each part 1-96 ASCII [A-Za-z0-9_.-] chars, starting and ending with [A-Za-z0-9_]
# (REPO_ID_REGEX's \b...\b), at most one '/', no '--' or '..', no '.git' suffix.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?", re.ASCII)
# git check-ref-format, which is what the hub accepts as a branch or tag name; commit
# hashes are a subset. '/' is allowed: the hub has refs like refs/pr/1.
_REV_BAD_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_REV_MAX = 255
# Linux's PATH_MAX: a longer path names no file (and would fill every log line about it).
_PATH_MAX = 4096
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


# --- the rule ---------------------------------------------------------------------------------


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


def normalize_model_ref(ref: str) -> str:
    """A model reference in its one spelling: a local path through `local_path`, a hub id
    (`org/name`, `org/name@rev`) stripped of surrounding whitespace and otherwise as is."""
    ref = ref.strip()
    return local_path(ref) if is_local_path(ref) else ref


def split_model_ref(ref: str) -> tuple[str, str | None]:
    """(model id, revision) of a reference by the rule, without checking its syntax (that is
    `parse_ref`'s) or respelling it (`normalize_model_ref`'s): a local path is its own id
    with no revision, '@' and all; a hub reference splits at its last '@' when something
    stands on both sides of it (revision None when not given)."""
    ref = ref.strip()
    if is_local_path(ref):
        return ref, None
    model_id, at, revision = ref.rpartition("@")
    if at and model_id and revision:
        return model_id, revision
    return ref, None


def ref_key(ref: str) -> str:
    """The store key of a reference's results: `model_key` of its id and revision by the
    rule, a path in its one spelling: the key the list reader gives the same name's row."""
    return model_key(*split_model_ref(normalize_model_ref(ref)))


def folder_warning(ref: str) -> str | None:
    """The warning for a hub id that also names a folder here (None otherwise): it is read
    as the hub id; `./name` analyses the folder. For names a person wrote (a list's rows,
    --model); one stat of the disk."""
    ref = ref.strip()
    if is_local_path(ref) or not os.path.isdir(ref) or parse_ref(ref)[2] is not None:
        return None
    return (f"{ref} is read as a hub id although a folder of that name exists here; "
            f"write ./{ref} to analyse the folder")


# --- syntax -----------------------------------------------------------------------------------


def repo_id_problem(repo_id: str) -> str | None:
    """Why repo_id is not valid HF repo id syntax, or None when it is."""
    if not repo_id:
        return "empty"
    if repo_id.count("/") > 1:
        return "must be 'name' or 'org/name'"
    if any(not _REPO_PART.fullmatch(part) for part in repo_id.split("/")):
        return (
            "use letters, digits, '-', '_' and '.', not starting or ending with '-' or '.', "
            "at most 96 per part"
        )
    if "--" in repo_id or ".." in repo_id:
        return "'--' and '..' are not allowed"
    if repo_id.endswith(".git"):
        return "must not end with '.git'"
    return None


def revision_problem(revision: str) -> str | None:
    """Why revision is not a valid branch, tag or commit name, or None when it is."""
    if not revision:
        return "empty"
    if len(revision) > _REV_MAX:
        return f"longer than {_REV_MAX} characters"
    bad = _REV_BAD_CHARS.search(revision)
    if bad:
        char = bad.group()
        return "whitespace is not allowed" if char.isspace() else f"{char!r} is not allowed"
    if ".." in revision or "@{" in revision or "//" in revision or revision == "@":
        return "'..', '//', '@{' and a lone '@' are not allowed"
    if revision.startswith("/") or revision.endswith(("/", ".")):
        return "must not start with '/' or end with '/' or '.'"
    if any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        return "no part may start with '.' or end with '.lock'"
    return None


def parse_ref(ref: str) -> tuple[str, str | None, str | None]:
    """(model_id, revision, problem) for `org/name[@rev]` or a local path, by the rule.

    A local path is made absolute and normalised (`local_path`), '@' and all: a directory
    name may contain one. Only the last '@' of a hub reference separates the revision, as
    in `split_model_ref`. A reference holding a control character (a newline, ESC) is
    refused: it would break every log line, command line and record naming it. So is a hub
    reference holding ':' (a URL, or user:password@host), which no hub id or revision may
    hold; its problem masks what precedes its last '@'.
    """
    ref = ref.strip()
    if not ref:
        return "", None, "empty model id"
    if has_control(ref):
        return ref, None, f"control characters are not allowed in a model id: {quoted(ref)}"
    if is_local_path(ref):
        path = local_path(ref)
        if len(path) > _PATH_MAX:
            return ref, None, f"longer than {_PATH_MAX} characters, so no path: {quoted(ref)}"
        return path, None, symlink_problem(ref)
    if ":" in ref:
        # Checked before the split at '@': 'https://bob:PASS' (the part before the '@')
        # no longer looks like a URL with a password, and would be shown as it is.
        return ref, None, (f"{quoted(_masked(ref))} is not a model id (a URL?): give "
                           "org/name[@revision] or a local directory; a hub token goes in "
                           "HF_TOKEN, not in the list")
    model_id, revision = ref, None
    if "@" in ref:
        model_id, _, revision = ref.rpartition("@")
        if not revision:
            return ref, None, f"empty revision after '@' in {quoted(ref)}"
        if not model_id:
            return ref, None, f"empty model id before '@' in {quoted(ref)}"
    why = repo_id_problem(model_id)
    if why:
        if os.path.isdir(ref):  # the old reading of a folder path: say how to write it now
            why += f"; a folder of that name exists here: write {quoted('./' + ref)} for it"
        return model_id, revision, f"malformed model id {quoted(model_id)}: {why}"
    if revision is not None:
        why = revision_problem(revision)
        if why:
            return model_id, revision, (f"bad revision {quoted(revision)} in {quoted(ref)}: "
                                        f"{why}")
    return model_id, revision, None


def symlink_problem(ref: str) -> str | None:
    """Why a local path is refused because its '..' steps out of a symlink (the OS would
    read another directory than the one its text names); None when it does not, or when
    `ref` is a hub id."""
    ref = ref.strip()
    link = symlink_before_dotdot(ref) if is_local_path(ref) else None
    if link is None:
        return None
    return (f"{quoted(ref)}: its '..' steps out of the symlink {quoted(link)}, which the OS "
            "resolves from the link's target, not from where the link is: write the path "
            "without '..'")


def symlink_before_dotdot(path: str) -> str | None:
    """The symlink a '..' of `path` steps back out of, or None when there is none.

    `local_path` folds '..' as text (`link/../g` is `./g`); the OS goes to the parent of
    the link's target instead, another directory. Where the two part ways the path must be
    refused, or another model would be analysed under the name given. Only a '..' that
    follows a symlink (after the folds before it) parts them; `link/x/..` is the link
    either way. Looks at the disk: lstat of the components a '..' follows (a missing one
    is no link: the worker reports the missing model)."""
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


def _masked(ref: str) -> str:
    """`ref` with all between its scheme (if any) and its last '@' masked: the userinfo of
    `https://user:password@host/…` or `user:password@host/…`, a password holding '/', ':'
    or '@' included (more is masked when an '@' follows the host: safe, not pretty)."""
    head, at, tail = ref.rpartition("@")
    if not at:
        return ref
    scheme = _SCHEME.match(head)
    return f"{scheme.group() if scheme else ''}{REDACTED}@{tail}"


# --- the key ----------------------------------------------------------------------------------


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
    only for people. Keys are at most KEY_MAX characters of [a-z0-9-]. Give it the id
    and revision `split_model_ref` or `parse_ref` made (`ref_key` does both): the key of a
    path is the key of its one spelling.
    """
    ident = model_id if revision is None else f"{model_id}@{revision}"
    digest = hashlib.sha256(ident.encode("utf-8")).hexdigest()[:10]
    segments = [s for s in map(_slug, _PATH_SEP.split(model_id)) if s]
    slug = "--".join(segments[-2:])
    if revision:
        slug = f"{slug}--{_slug(revision)[:_REVISION_SLUG_MAX]}"
    slug = slug[:_KEY_SLUG_MAX].strip("-") or "model"
    return f"{slug}-{digest}"
