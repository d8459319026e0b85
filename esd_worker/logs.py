"""Log setup for both commands: plain lines for people, JSON lines for clusters (stderr)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
_QUIET = ("urllib3", "httpx", "httpcore", "filelock", "huggingface_hub", "botocore", "boto3",
          "s3transfer")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (for cluster log pipelines)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")


def setup_logging(
    *,
    verbose: bool = False,
    fmt: str = "text",
    stream: TextIO | None = None,
    log_file: Path | None = None,
) -> None:
    """Log to stderr (and to `log_file` when given, always with timestamps)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_formatter(fmt))
    handlers: list[logging.Handler] = [handler]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            if fmt == "text" else JsonFormatter()
        )
        handlers.append(file_handler)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Third-party chatter (HTTP requests, file locks) only when asked for.
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
