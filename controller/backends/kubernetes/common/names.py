"""What a sweep's Jobs are called and how they are found: names, label keys, selectors.

Owns the Job name (a pure function of model key and attempt, so a restarted controller
recomputes it), the label and annotation keys a sweep reads back, the selectors it lists by,
and the Kubernetes name rules (DNS-1123, label values) that Job building checks against.
Pure; does not build Jobs (controller.backends.kubernetes.common.jobs).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from controller import __version__
from controller.backends.kubernetes.common.errors import JobSpecError

APP_NAME = "esd-sweep"
COMPONENT = "worker"
LABEL_PREFIX = "esd-sweep/"
RUN_LABEL = "esd-sweep/run"
# The one key for a model: the label holds model_key_label() (≤ 63 chars), the annotation
# of the same name the full key, which adoption compares.
MODEL_KEY_LABEL = "esd-sweep/model-key"
ATTEMPT_LABEL = "esd-sweep/attempt"
OUTPUT_ANNOTATION = "esd-sweep/output"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's API (served from Kueue 0.15; v1beta1 is deprecated there and gone in 0.17) and the
# label Kueue puts on the Workload it makes for a Job: the Job's uid.
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# A sharded run's Indexed Jobs (one per resource class, built by the sharded mode's indexed)
# carry MODE_LABEL=MODE_SHARDED and their class; per-model Jobs carry no mode label.
MODE_LABEL = "esd-sweep/mode"
MODE_SHARDED = "sharded"
CLASS_LABEL = "esd-sweep/shard-class"
SHARDS_ANNOTATION = "esd-sweep/shards"  # the shard lists' store URL, credentials dropped
MODELS_ANNOTATION = "esd-sweep/models"  # models in all the Job's shards
SHARD_BYTES_ANNOTATION = "esd-sweep/shard-bytes"  # the byte budget each shard was cut to
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on its pods
JOB_NAME_PREFIX = "esd-"
MAX_ATTEMPT = 9999

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MODEL_KEY = re.compile(r"(?P<slug>[a-z0-9]([a-z0-9-]*[a-z0-9])?)-(?P<digest>[0-9a-f]{10})")


def is_dns_label(value: str) -> bool:
    """RFC 1123 label: ≤ 63 of a-z 0-9 -, alphanumeric at both ends (Job and namespace names)."""
    return isinstance(value, str) and len(value) <= 63 and bool(_DNS_LABEL.fullmatch(value))


def is_dns_subdomain(value: str) -> bool:
    """RFC 1123 subdomain: ≤ 253 chars of dot-separated labels (Secret, PVC, SA names)."""
    return isinstance(value, str) and len(value) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(value))


def is_label_value(value: str) -> bool:
    """Kubernetes label value: empty, or ≤ 63 of A-Z a-z 0-9 - _ . with alphanumeric ends."""
    return isinstance(value, str) and len(value) <= 63 and bool(_LABEL_VALUE.fullmatch(value))


def version_label(version: str | None = None) -> str:
    """The app.kubernetes.io/version label: the package version (default controller's),
    its characters a label value does not allow ("+" of a local version) as "-", cut to 63."""
    value = re.sub(r"[^-A-Za-z0-9_.]", "-", __version__ if version is None else version)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def is_extended_resource(value: str) -> bool:
    """An extended resource name as the API server checks it (nvidia.com/gpu,
    nvidia.com/mig-1g.10gb): DOMAIN/NAME, not in the kubernetes.io domain, and
    "requests.DOMAIN/NAME" a qualified name (the ResourceQuota key of it)."""
    if not isinstance(value, str) or "/" not in value or "kubernetes.io/" in value:
        return False
    return not value.startswith("requests.") and is_label_key("requests." + value)


def is_label_key(value: str) -> bool:
    """Qualified name: optional DNS-subdomain prefix (≤ 253) and '/', then a ≤ 63-char name."""
    if not isinstance(value, str):
        return False
    prefix, sep, name = value.rpartition("/")
    if sep and not (prefix and is_dns_subdomain(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def _split_key(model_key: str) -> tuple[str, str]:
    match = _MODEL_KEY.fullmatch(model_key) if isinstance(model_key, str) else None
    if match is None:
        raise JobSpecError(f"model key {model_key!r} is not <slug>-<10 hex> "
                           "(esd_worker.core.models.naming.model_key)")
    return match["slug"], match["digest"]


def _shorten(slug: str, digest: str, room: int) -> str:
    """`slug-digest` in at most `room` chars: the slug is cut, the hash always kept."""
    cut = slug[: max(room - len(digest) - 1, 0)].rstrip("-")
    return f"{cut}-{digest}" if cut else digest


# esd- + slug + -<10 hex> + room for -a9999: the prefix is the same for every attempt.
_NAME_SLUG_ROOM = 63 - len(JOB_NAME_PREFIX) - len("-a9999")


def job_name(model_key: str, attempt: int = 0) -> str:
    """The Job name for one model and attempt: `esd-<slug>-<hash>[-a<N>]`, a DNS-1123 label.

    A pure function of (model_key, attempt), so a restarted controller computes the same
    names and a create that answers 409 means "already submitted". The 10-hex hash of the
    model key is always kept (it is what tells models apart); the readable slug is cut to
    fit 63 chars with room for the attempt suffix, so every attempt of a model shares the
    prefix. Attempt 0 has no suffix.
    """
    slug, digest = _split_key(model_key)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= MAX_ATTEMPT:
        raise JobSpecError(f"attempt {attempt!r} must be an integer in 0..{MAX_ATTEMPT}")
    name = JOB_NAME_PREFIX + _shorten(slug, digest, _NAME_SLUG_ROOM)
    return f"{name}-a{attempt}" if attempt else name


def model_key_label(model_key: str) -> str:
    """The model key as a label value: itself when ≤ 63 chars, else cut slug + full hash."""
    slug, digest = _split_key(model_key)
    return model_key if len(model_key) <= 63 else _shorten(slug, digest, 63)


def run_selector(run_id: str) -> str:
    """Label selector for every Job of one run (what a restarted run lists to adopt)."""
    return f"{MANAGED_BY_LABEL}={APP_NAME},{RUN_LABEL}={run_id}"


def managed_selector() -> str:
    """Label selector for every Job esd-sweep created in a namespace, whatever the run."""
    return f"{MANAGED_BY_LABEL}={APP_NAME}"


def sweep_selector(instance: str) -> str:
    """Label selector for every Job of one sweep (one output), whatever the run."""
    return f"{managed_selector()},{INSTANCE_LABEL}={instance}"


def sharded_selector(instance: str) -> str:
    """Label selector for the Indexed Jobs of one sweep's sharded runs, whatever the run."""
    return f"{sweep_selector(instance)},{MODE_LABEL}={MODE_SHARDED}"


def per_model_selector(instance: str) -> str:
    """Label selector for one sweep's per-model Jobs only (no mode label: not sharded)."""
    return f"{sweep_selector(instance)},!{MODE_LABEL}"


def output_annotation(url: str) -> str:
    """The OUTPUT_ANNOTATION value: the URL without user:password@ or a query string
    (annotations are readable by anyone who can list Jobs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.username is None and parts.password is None and not parts.query:
        return url
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
_MAX_REF = 1024


def check_ref(what: str, value: str, problems: list[str]) -> None:
    """Append to `problems` why `value` (a model ref, a URL) cannot be one argv element."""
    # Model ids are untrusted: they only ever become one argv element and one annotation
    # value, but a leading '-' would read as a flag and control characters have no business
    # in an id, a path or a log line.
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{what}: empty")
    elif value.startswith("-"):
        problems.append(f"{what}: {value!r} starts with '-'")
    elif _CONTROL_CHARS.search(value):
        problems.append(f"{what}: {value!r} contains control characters")
    elif len(value) > _MAX_REF:
        problems.append(f"{what}: longer than {_MAX_REF} characters")
