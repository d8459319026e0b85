"""Model ids, revisions and the stable `model_key` derived from them (no I/O)."""

from __future__ import annotations

import hashlib
import re

_SLUG_BAD = re.compile(r"[^a-z0-9]+")
_PATH_SEP = re.compile(r"[/\\]+")
_KEY_SLUG_MAX = 80
_REVISION_SLUG_MAX = 12
KEY_MAX = _KEY_SLUG_MAX + 1 + 10  # slug, "-", 10 hex digits of the hash


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
