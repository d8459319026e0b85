"""Model ids, revisions and the stable `model_key` derived from them (no I/O)."""

from __future__ import annotations

import hashlib
import re

_SLUG_BAD = re.compile(r"[^a-z0-9]+")
_KEY_SLUG_MAX = 80


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

    The hash is of the exact, case-sensitive strings, so ids that slug alike still get
    distinct keys; the slug is only for people.
    """
    ident = model_id if revision is None else f"{model_id}@{revision}"
    digest = hashlib.sha256(ident.encode("utf-8")).hexdigest()[:10]
    slug = "--".join(part for part in map(_slug, model_id.split("/")) if part)
    if revision:
        slug = f"{slug}--{_slug(revision)[:12]}"
    slug = slug[:_KEY_SLUG_MAX].strip("-") or "model"
    return f"{slug}-{digest}"
