"""Tests of esd_worker.core.redact and of the log setup that sends every line through it
(esd_worker.core.logs): URL userinfo, known secret variables, token shapes; log files 0600.

Why the expected values are right: a secret is replaced whole by [REDACTED] and nothing
around it changes, so a person still reads which URL, header or token it was; a line with
no secret comes back as it went in (the same string).
"""

from __future__ import annotations

import io
import json
import logging
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.logs import open_private, setup_logging
from esd_worker.core.redact import REDACTED, Redactor, redact_data
from tests.support import REPO_ROOT

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"  # the shape of a real HF token (hf_ + 34)
AKID = "AKIA" + "IOSFODNN7EXAMPLE"
ENV_SECRET = "plain-looking-secret-42"  # no known shape: only the environment says it is one


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        pytest.param("output s3://KEY:SECRET@bucket/x", {}, f"output s3://{REDACTED}@bucket/x",
                     id="s3-userinfo"),
        pytest.param("GET http://user:pa55@example.com:8080/api", {},
                     f"GET http://{REDACTED}@example.com:8080/api", id="http-userinfo"),
        pytest.param("clone https://ghp_tok3n@github.com/org/repo.git", {},
                     f"clone https://{REDACTED}@github.com/org/repo.git", id="https-token-as-user"),
        pytest.param("s3://KEY:wJal/rXUtn+FEMI@bucket/x", {}, f"s3://{REDACTED}@bucket/x",
                     id="secret-with-slash"),
        pytest.param('{"url": "ftp://a:b@host/f"}', {}, f'{{"url": "ftp://{REDACTED}@host/f"}}',
                     id="userinfo-in-json"),
        pytest.param(f"base org/{ENV_SECRET} not found", {"HF_TOKEN": ENV_SECRET},
                     f"base org/{REDACTED} not found", id="env-hf-token"),
        pytest.param(f"token={ENV_SECRET}!", {"HUGGING_FACE_HUB_TOKEN": ENV_SECRET},
                     f"token={REDACTED}!", id="env-hub-token"),
        pytest.param("denied for minioadmin-key and minio-s3cret",
                     {"AWS_ACCESS_KEY_ID": "minioadmin-key",
                      "AWS_SECRET_ACCESS_KEY": "minio-s3cret"},
                     f"denied for {REDACTED} and {REDACTED}", id="env-aws-keys"),
        pytest.param("session FwoGZXIvYXdzEJr end", {"AWS_SESSION_TOKEN": "FwoGZXIvYXdzEJr"},
                     f"session {REDACTED} end", id="env-session-token"),
        pytest.param("the tokenvalue-long and tokenvalue", {"HF_TOKEN": "tokenvalue-long",
                                                            "AWS_SESSION_TOKEN": "tokenvalue"},
                     f"the {REDACTED} and {REDACTED}", id="env-longest-first"),
        pytest.param(f"401 for {HF}: invalid", {}, f"401 for hf_{REDACTED}: invalid",
                     id="hf-token-shape"),
        pytest.param(f"base org/{HF}", {}, f"base org/hf_{REDACTED}", id="hf-token-in-a-repo-id"),
        pytest.param(f"key id {AKID} denied", {}, f"key id AKIA{REDACTED} denied", id="akia"),
        pytest.param("ASIA" + "ABCDEFGHIJKLMNOP used", {}, f"ASIA{REDACTED} used", id="asia"),
    ],
)
def test_redactor_replaces_secrets(text: str, env: dict[str, str], expected: str) -> None:
    assert Redactor(env)(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("layers 12/48 analysed (model.layers.11.mlp.down_proj)", id="plain"),
        pytest.param("model=org/name@main key=org--name-main-3fa9c2 done", id="ref-with-at"),
        pytest.param("report: s3://bucket/prefix/runs/x.json", id="s3-without-userinfo"),
        pytest.param("GET https://huggingface.co/org/m/resolve/main/config.json", id="hub-url"),
        pytest.param("hf_transfer is not installed; hf_hub_download retried", id="hf-names"),
        pytest.param("git@github.com:org/repo.git and a@b.com", id="no-scheme"),
        pytest.param("TZ Asia/Tokyo, AKIA-short", id="near-shapes"),
        pytest.param("abc stays", id="short-env-value-ignored"),
    ],
)
def test_redactor_leaves_text_without_secrets_unchanged(text: str) -> None:
    """The short HF_TOKEN "abc" is ignored: redacting it would garble ordinary words."""
    assert Redactor({"HF_TOKEN": "abc"})(text) == text


def test_redact_data_redacts_every_string_keys_included() -> None:
    doc: dict[str, Any] = {"error": "s3://K:S@b/x", "counts": {"done": 1},
                           "failures": {f"key {HF}": ["ok", ("s3://u:p@h",)]}, "ok": None}
    assert redact_data(doc) == {
        "error": f"s3://{REDACTED}@b/x", "counts": {"done": 1},
        "failures": {f"key hf_{REDACTED}": ["ok", [f"s3://{REDACTED}@h"]]}, "ok": None,
    }


# --- every log line, stderr and file, text and JSON -----------------------------------------


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_lines_are_redacted_on_every_handler_and_the_file_is_private(
    fmt: str, tmp_path: Path
) -> None:
    """The message and the traceback leave redacted through stderr and the log file, and
    the file is 0600 whatever the umask (it names private repos even when redacted)."""
    stream = io.StringIO()
    log_file = tmp_path / "logs" / "run.log"
    setup_logging(fmt=fmt, stream=stream, log_file=log_file)
    log = logging.getLogger("test.redact")
    log.info("opening s3://KEY:SECRET1@bucket/x for %s", HF)
    try:
        raise RuntimeError("cannot reach https://user:SECRET2@host/")
    except RuntimeError:
        log.exception("failed")
    for handler in logging.getLogger().handlers:
        handler.flush()
    written = {"stderr": stream.getvalue(), "file": log_file.read_text()}
    for where, text in written.items():
        assert "s3://" in text and "RuntimeError" in text, where
        for secret in ("SECRET1", "SECRET2", HF):
            assert secret not in text, (where, secret)
        if fmt == "json":
            assert all(json.loads(line) for line in text.splitlines() if line.startswith("{"))
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600


def test_open_private_tightens_a_readable_log_and_appends(tmp_path: Path) -> None:
    """A log an older version left 0644 is 0600 once opened again; what it held stays."""
    path = tmp_path / "w.log"
    path.write_bytes(b"old\n")
    path.chmod(0o644)
    with open_private(path) as out:
        out.write(b"new\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"old\nnew\n"


@pytest.mark.parametrize(
    "code",
    [
        pytest.param("raise RuntimeError('s3://KEY:SECRET9@bucket/x')", id="main-thread"),
        pytest.param("import threading\n"
                     "def boom(): raise RuntimeError('s3://KEY:SECRET9@bucket/x')\n"
                     "t = threading.Thread(target=boom, name='boom'); t.start(); t.join()",
                     id="thread"),
    ],
)
def test_an_uncaught_exception_prints_its_traceback_redacted(code: str) -> None:
    """A bug's traceback still reaches the person (type, message, where), its secret not."""
    script = f"from esd_worker.core.logs import setup_logging\nsetup_logging()\n{code}\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)
    assert "Traceback" in done.stderr and f"RuntimeError: s3://{REDACTED}@bucket/x" in done.stderr
    assert "SECRET9" not in done.stderr
