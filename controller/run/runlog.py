"""The run's log file (`<log-dir>/esd-sweep.log`): opened once the run is sure to start, with
the lines logged before, so a run refused before it starts (a usage error, `--strict` and a
bad row, a bad `--single-model`) leaves nothing behind.

Owns when the file opens. How lines are written (format, redaction, 0600) is
esd_worker.core.logs'.
"""

from __future__ import annotations

import logging
from pathlib import Path

from controller.errors import SweepError
from esd_worker.core.logs import setup_logging

# Lines kept for the file before it opens: a plan's bad rows are logged one line each, and
# a list of millions may have many; past this many, the file says how many it lacks (every
# line went to stderr as it was logged).
HELD_LINES = 10_000


class HeldLog(logging.Handler):
    """Keeps the records logged from the command's start until `open` writes them, and all
    later ones, to `log_file`. Logging to stderr is set up already (esd_worker.core.logs)."""

    def __init__(self, log_file: Path, *, verbose: bool, fmt: str,
                 limit: int = HELD_LINES) -> None:
        super().__init__()
        self.log_file, self.verbose, self.fmt, self.limit = log_file, verbose, fmt, limit
        self.records: list[logging.LogRecord] = []
        self.dropped = 0
        logging.getLogger().addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.limit:
            self.records.append(record)
        else:
            self.dropped += 1

    def open(self) -> None:
        """Log to the file from now on, the held lines first; SweepError (exit 2) when the
        file cannot be written."""
        try:
            setup_logging(verbose=self.verbose, fmt=self.fmt, log_file=self.log_file)
        except OSError as e:
            raise SweepError(f"cannot write the log in {self.log_file}: {e}") from e
        # setup_logging replaced the root's handlers (this one too): stderr and the file.
        files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        for handler in files:
            for record in self.records:
                handler.handle(record)
            if self.dropped:
                handler.handle(logging.makeLogRecord({
                    "name": __name__, "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": "%d line(s) logged before this one are not in this file (they "
                    "went to stderr)", "args": (self.dropped,),
                }))
        self.records.clear()
