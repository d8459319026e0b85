"""Kubernetes objects as YAML that YAML 1.1 and 1.2 readers read back as the same objects.

Owns the YAML the controller prints (`--dry-run`: `kubectl apply -f -` takes it). The API
server and kubectl read YAML 1.2, PyYAML (and kubernetes-validate) 1.1: a string such as
`1e-05` written plain is a number to the first. Pure; the objects come from .jobs and
.indexed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any


def jobs_to_yaml(jobs: Iterable[Mapping[str, Any]]) -> str:
    """Jobs as one multi-document YAML stream (`--dry-run`; `kubectl apply -f -` takes it).

    Written for YAML 1.2 readers (the API server, kubectl) as much as 1.1 ones (PyYAML):
    every string that is not a plain word is double-quoted (see _yaml_str), control and
    non-ASCII characters are escaped, so an odd model id or `--evals-thresh 1e-05` reads
    back as the same string under either spec. Ints and bools stay plain.
    """
    return _yaml_dump_all([_plain(job) for job in jobs])


# A scalar written plain only when it is a word that every YAML reader takes as that string:
# it starts with a letter (so no number, .inf/.nan, ~, indicator or sign), has no space, ':'
# or '#', and is not one of the words YAML 1.1 (PyYAML) or 1.2 (the API server) read as a
# bool or null. Everything else is double-quoted: PyYAML's own rule is 1.1's, which writes
# `1e-05`, `0o17` or `08` plain, and a 1.2 reader parses those as numbers.
_PLAIN_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*")
_YAML_KEYWORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})


def _yaml_str_style(value: str) -> str | None:
    """None (plain) for a safe word, '"' for every other string."""
    if _PLAIN_WORD.fullmatch(value) and value.lower() not in _YAML_KEYWORDS:
        return None
    return '"'


@functools.cache
def _yaml_dumper() -> Any:
    import yaml  # PyYAML comes with the [kube] extra; building Jobs does not need it

    class Dumper(yaml.SafeDumper):
        """SafeDumper with the YAML 1.2-safe string rule (a subclass: the global stays)."""

    def represent_str(dumper: Any, value: str) -> Any:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                       style=_yaml_str_style(value))

    Dumper.add_representer(str, represent_str)
    return Dumper


def _yaml_dump_all(documents: list[Any]) -> str:
    import yaml

    # width: never fold a long string over lines (readers cope; people grep the output).
    text: str = yaml.dump_all(
        documents, Dumper=_yaml_dumper(), explicit_start=True, sort_keys=False,
        default_flow_style=False, allow_unicode=False, width=1 << 30,
    )
    return text


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
