"""Sweep progress: a live one-line bar at a terminal, plain log lines otherwise (stdlib only)."""

from __future__ import annotations

import logging
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

log = logging.getLogger(__name__)

_BAR_WIDTH = 24
_ERASE_LINE = "\r\x1b[2K"


def format_duration(seconds: float) -> str:
    """Short human duration: 45s, 12m05s, 3h02m, 2d04h."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@dataclass(frozen=True)
class ClassProgress:
    """Where one resource class of a sharded run stands (from its Indexed Job's status and
    the running shards' progress documents in the store): models and shards by state, and
    what its workers report (bytes downloaded, seconds busy on the device, seconds up)."""

    name: str
    models: int
    done: int = 0
    failed: int = 0
    running: int = 0
    shards: int = 0
    shards_done: int = 0
    shards_failed: int = 0
    shards_running: int = 0
    bytes_downloaded: int = 0
    device_busy_s: float = 0.0
    worker_s: float = 0.0


class ProgressObserver(Protocol):
    """Something that follows a sweep's progress besides the bar (the metrics endpoint)."""

    def counts(self, *, done: int, failed: int, running: int, waiting: int) -> None: ...

    def classes(self, classes: Sequence[ClassProgress]) -> None: ...


class _ClearBeforeLog(logging.Filter):
    """Erases the bar before a log line goes to the bar's stream; the next update redraws it."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        self.progress.clear()
        return True


class Progress:
    """Progress of one sweep for `total` tasks.

    At a terminal (interactive; default: stream.isatty()) one line is redrawn in place on
    every update: bar, done/failed/running/waiting-for-GPU counts, rate and ETA. Log lines
    that go to the same stream erase the bar first (a filter on those logging handlers,
    removed by close()). Otherwise an INFO line is logged (logger controller.progress) at
    most every `log_every_s` seconds, on the first update and on the final one.

    ETA: mean run time of finished tasks (record_duration) × remaining tasks ÷ tasks running
    now; before any duration is known, from the finish rate so far.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        log_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 0)
        self.stream: TextIO = stream if stream is not None else sys.stderr
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                interactive = bool(isatty()) if isatty is not None else False
            except (OSError, ValueError):
                interactive = False
        self.interactive = interactive
        self.log_every_s = log_every_s
        self._clock = clock
        self._started = clock()
        self._durations: list[float] = []
        self._counts = (0, 0, 0, 0)  # done, failed, running, waiting
        self._updated = False
        self._drawn = False
        self._closed = False
        self._last_log: float | None = None
        self._logged_counts: tuple[int, int, int, int] | None = None
        self._filter: _ClearBeforeLog | None = None
        self._guarded: list[logging.Handler] = []
        self._observers: list[ProgressObserver] = []
        if self.interactive:
            self._guard_logging()

    def observe(self, observer: ProgressObserver) -> None:
        """Give every later update to `observer` too."""
        self._observers.append(observer)

    # Inputs -------------------------------------------------------------------------------

    def record_duration(self, seconds: float) -> None:
        """One finished task's run time, seconds (for the ETA)."""
        self._durations.append(max(seconds, 0.0))

    def update(self, *, done: int, failed: int, running: int, waiting: int) -> None:
        """New counts: redraw the bar at a terminal, else log a line when one is due."""
        if self._closed:
            return
        for observer in self._observers:
            observer.counts(done=done, failed=failed, running=running, waiting=waiting)
        self._counts = (done, failed, running, waiting)
        self._updated = True
        if self.interactive:
            self._draw()
            return
        now = self._clock()
        final = done + failed >= self.total
        due = self._last_log is None or now - self._last_log >= self.log_every_s
        if (due or final) and self._logged_counts != self._counts:
            self._log_line(now)

    def update_classes(self, classes: Sequence[ClassProgress]) -> None:
        """Per-class progress of a sharded run: for the observers (the bar shows totals)."""
        if self._closed:
            return
        for observer in self._observers:
            observer.classes(classes)

    def clear(self) -> None:
        """Erase the bar (at a terminal) until the next update."""
        if self.interactive and self._drawn:
            self._write(_ERASE_LINE)
            self._drawn = False

    def close(self) -> None:
        """Leave the final state on screen (or in the log) and stop drawing."""
        if self._closed:
            return
        if self.interactive:
            if self._updated:
                self._draw()
                self._write("\n")
                self._drawn = False
        elif self._updated and self._logged_counts != self._counts:
            self._log_line(self._clock())
        self._closed = True
        for handler in self._guarded:
            if self._filter is not None:
                handler.removeFilter(self._filter)
        self._guarded.clear()

    # Rendering ----------------------------------------------------------------------------

    def line(self) -> str:
        """The current state as one line (no bar): counts, rate, ETA."""
        done, failed, running, waiting = self._counts
        finished = done + failed
        parts = [
            f"{finished}/{self.total}",
            f"done {done}",
            f"failed {failed}",
            f"running {running}",
            f"waiting {waiting}",
        ]
        elapsed = max(self._clock() - self._started, 0.0)
        if finished and elapsed > 0:
            per_s = finished / elapsed
            parts.append(f"{per_s * 3600:.1f}/h" if per_s < 1 / 60 else f"{per_s * 60:.1f}/min")
        parts.append(f"ETA {self._eta(finished, running, elapsed)}")
        return "  ".join(parts)

    def bar(self) -> str:
        """The bar with the line: [#########...............] 45/120  done 40 ..."""
        finished = self._counts[0] + self._counts[1]
        fill = _BAR_WIDTH
        if self.total > 0:
            fill = _BAR_WIDTH * min(finished, self.total) // self.total
        return "[" + "#" * fill + "." * (_BAR_WIDTH - fill) + "] " + self.line()

    def _eta(self, finished: int, running: int, elapsed: float) -> str:
        remaining = max(self.total - finished, 0)
        if remaining == 0:
            return "0s"
        if self._durations:
            seconds = statistics.fmean(self._durations) * remaining / max(running, 1)
        elif finished and elapsed > 0:
            seconds = remaining * elapsed / finished
        else:
            return "?"
        return format_duration(seconds)

    def _draw(self) -> None:
        text = self.bar()
        width = shutil.get_terminal_size(fallback=(100, 24)).columns - 1
        if width > 20 and len(text) > width:
            text = text[:width]  # a wrapped line could not be redrawn in place
        self._write(_ERASE_LINE + text)
        self._drawn = True

    def _log_line(self, now: float) -> None:
        log.info("progress: %s", self.line())
        self._last_log = now
        self._logged_counts = self._counts

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed terminal must not stop the sweep

    def _guard_logging(self) -> None:
        self._filter = _ClearBeforeLog(self)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                handler.addFilter(self._filter)
                self._guarded.append(handler)
