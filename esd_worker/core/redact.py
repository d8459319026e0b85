"""Secret redaction for every text that leaves a process: log lines (stderr and files, text
and JSON), printed and stored JSON (reports, failure records), worker output and error lines.

Owns what counts as a secret: URL userinfo (`s3://KEY:SECRET@bucket` → `s3://[REDACTED]@bucket`),
the values of the secret environment variables this tool knows, well-known token shapes (HF
tokens, AWS access key ids) and Authorization / Bearer / aws_secret_access_key values.
Pure and cheap (no heavy imports; it runs on every log line): both packages import it. Does
not decide where text goes, nor file modes (esd_worker.core.logs opens log files owner-only).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "[REDACTED]"

SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
              "AWS_ACCESS_KEY_ID")
# Shorter values are left alone: redacting "abc" everywhere would garble ordinary words,
# and real tokens and keys are 20 characters or more.
MIN_SECRET_LEN = 8

# (lower-case substrings one of which a match holds, pattern, replacement). Order matters:
# whole header values first, then bare tokens that may stand anywhere.
_PATTERNS: tuple[tuple[tuple[str, ...], re.Pattern[str], str], ...] = (
    # scheme://user:password@host, any scheme. The user part stops at '/', the password may
    # hold '/' (AWS secret keys do, and people paste them unencoded).
    (("://",),
     re.compile(r"""(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/@?#"'<>]+(?::[^\s@?#"'<>]*)?@"""),
     r"\1" + REDACTED + "@"),
    # Authorization: Bearer xyz / 'Authorization': 'token xyz' / authorization=Basic xyz
    (("authorization",),
     re.compile(r"""(?i)(\bauthorization['"]?\s*[:=]\s*['"]?)(?:(?:bearer|token|basic)\s+)?"""
                r"""[^\s'",;]+"""),
     r"\1" + REDACTED),
    (("bearer",), re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=\-]+"), r"\1" + REDACTED),
    # aws_secret_access_key = xyz, AWS_SECRET_ACCESS_KEY="xyz", aws_session_token: xyz
    (("aws_",),
     re.compile(r"""(?i)(\baws_(?:secret_access_key|session_token|security_token)['"]?\s*"""
                r"""[:=]\s*['"]?)[^\s'",;]+"""),
     r"\1" + REDACTED),
    # HF user tokens are hf_ + 34 letters and digits (30+ keeps hf_transfer, hf_hub_… apart)
    (("hf_",), re.compile(r"\bhf_[A-Za-z0-9]{30,}"), "hf_" + REDACTED),
    (("api_org_",), re.compile(r"\bapi_org_[A-Za-z0-9]{8,}"), "api_org_" + REDACTED),
    # AWS access key ids (long-term AKIA, temporary ASIA)
    (("akia", "asia"), re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b"), r"\1" + REDACTED),
)


class Redactor:
    """Redacts the patterns above and the values of `SECRET_ENV` in `environ`.

    The values are read once, when built: the process-wide one (`redact`) reads os.environ
    on first use, after the CLI has started (variables set later are not known to it).
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        values = {environ.get(name, "").strip() for name in SECRET_ENV}
        # Longest first: a value holding another is replaced whole.
        self.values = tuple(sorted((v for v in values if len(v) >= MIN_SECRET_LEN),
                                   key=len, reverse=True))

    def __call__(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, REDACTED)
        # The fast path (every log line comes here): a pattern runs only on a line holding
        # its substring, which a few `in` tests on the lower-cased line tell, ten times
        # faster than one case-insensitive regex search.
        lowered = text.lower()
        for needles, pattern, replacement in _PATTERNS:
            for needle in needles:
                if needle in lowered:
                    text = pattern.sub(replacement, text)
                    break
        return text


_default: Redactor | None = None


def redact(text: str) -> str:
    """`text` with every secret this process knows of replaced by [REDACTED]."""
    global _default
    if _default is None:  # a race builds two equal ones: harmless
        _default = Redactor(os.environ)
    return _default(text)


def redact_data(value: Any) -> Any:
    """A JSON-like value (dicts, lists, tuples, strings) with every string redacted, keys
    included; other values as they are. Redacting before encoding keeps JSON escapes from
    hiding a secret (a quote or backslash in it would be escaped in the encoded text)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {redact(k) if isinstance(k, str) else k: redact_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value


# A URL with an '@' after its scheme. Any '@', not only one before the first '/': a
# password may hold '/' (AWS secret keys do) and '@' when pasted unencoded.
_USERINFO = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.\-]*://[^@]*@")


def has_userinfo(url: str) -> bool:
    """Whether `url` is a URL carrying a user name, password or token before an '@' (for a
    value that would be stored where others read it, as a Kubernetes Job's env: refused,
    not stripped, since the workers would then lack the credentials meant for them)."""
    return _USERINFO.match(url) is not None


def without_userinfo(url: str) -> str:
    """`url` without its user:password@ part, everything else as given: for a URL that is
    still used (an endpoint in a message, a store URL in a Job's argv, where anyone who can
    read the Job would read it), not only shown."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
