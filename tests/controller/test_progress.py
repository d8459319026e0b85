"""Tests of controller.progress: the bar at a (fake) terminal and log lines elsewhere."""

from __future__ import annotations

import io
import logging

import pytest

from controller.progress import Progress, format_duration

ERASE = "\r\x1b[2K"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def make_progress(total: int, **kwargs: object) -> tuple[Progress, io.StringIO, FakeClock]:
    stream = io.StringIO()
    clock = FakeClock()
    progress = Progress(total, stream=stream, clock=clock, **kwargs)  # type: ignore[arg-type]
    return progress, stream, clock


def frames(stream: io.StringIO) -> list[str]:
    """What was drawn, one entry per redraw (erase sequences split them)."""
    return [f for f in stream.getvalue().split(ERASE) if f]


# --- at a terminal --------------------------------------------------------------------------


def test_bar_shows_counts_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    """10 tasks, 2 finished in 600 s (12/h), 60 s each on average, 2 running: the 8 left
    take 8 × 60 s / 2 = 240 s. The bar has 24 cells: floor(24 × 2/10) = 4 filled."""
    monkeypatch.setenv("COLUMNS", "200")
    progress, stream, clock = make_progress(10, interactive=True)
    clock.now += 600
    progress.record_duration(50)
    progress.record_duration(70)
    progress.update(done=1, failed=1, running=2, waiting=6)
    assert frames(stream) == [
        "[####....................] 2/10  done 1  failed 1  running 2  waiting 6  12.0/h  "
        "ETA 4m00s"
    ]


def test_bar_is_redrawn_in_place_and_closed_with_a_newline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    progress, stream, clock = make_progress(4, interactive=True)
    progress.update(done=0, failed=0, running=2, waiting=2)
    clock.now += 30
    progress.record_duration(30)
    progress.update(done=1, failed=0, running=2, waiting=1)
    clock.now += 30
    progress.record_duration(30)
    progress.update(done=4, failed=0, running=0, waiting=0)
    assert "\n" not in stream.getvalue()
    progress.close()
    progress.close()
    progress.update(done=9, failed=9, running=9, waiting=9)  # after close: ignored
    drawn = frames(stream)
    assert [f.split("] ")[1].split("  ")[0] for f in drawn] == ["0/4", "1/4", "4/4", "4/4"]
    assert drawn[0].endswith("ETA ?")  # nothing finished yet
    assert drawn[-1].startswith("[" + "#" * 24 + "]")
    assert drawn[-1].endswith("ETA 0s\n")
    assert stream.getvalue().count("\n") == 1


def test_eta_from_finish_rate_before_durations_are_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 of 12 finished in 90 s: 9 left at that rate take 270 s."""
    monkeypatch.setenv("COLUMNS", "200")
    progress, stream, clock = make_progress(12, interactive=True)
    clock.now += 90
    progress.update(done=3, failed=0, running=1, waiting=8)
    assert frames(stream)[-1].endswith("2.0/min  ETA 4m30s")


def test_line_is_cut_to_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapped line cannot be redrawn with \\r: keep it within the terminal."""
    monkeypatch.setenv("COLUMNS", "40")
    progress, stream, _ = make_progress(10, interactive=True)
    progress.update(done=1, failed=0, running=1, waiting=8)
    assert len(frames(stream)[0]) == 39


def test_interactive_follows_isatty_by_default() -> None:
    assert Progress(1, stream=TtyStringIO()).interactive is True
    assert Progress(1, stream=io.StringIO()).interactive is False


def test_log_lines_to_the_same_stream_erase_the_bar_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    stream = TtyStringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress(2, stream=stream)
        progress.update(done=0, failed=0, running=1, waiting=1)
        logging.getLogger("test").warning("model=x key=y started")
        progress.update(done=1, failed=0, running=1, waiting=0)
        progress.close()
        assert handler.filters == []  # close() takes its filter away
    finally:
        root.removeHandler(handler)
    text = stream.getvalue()
    before, after = text.split("model=x key=y started\n")
    assert before.startswith(ERASE + "[") and before.endswith("ETA ?" + ERASE)
    assert after.startswith(ERASE + "[")


# --- not at a terminal ----------------------------------------------------------------------


def test_plain_log_lines_at_most_every_log_every_s_and_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    progress, stream, clock = make_progress(3, interactive=False, log_every_s=30)
    with caplog.at_level(logging.INFO, logger="controller.progress"):
        progress.update(done=0, failed=0, running=1, waiting=2)  # first: logged
        clock.now += 10
        progress.update(done=1, failed=0, running=1, waiting=1)  # too soon
        clock.now += 25
        progress.update(done=1, failed=0, running=1, waiting=1)  # due: logged
        clock.now += 40
        progress.update(done=1, failed=0, running=1, waiting=1)  # due but unchanged
        clock.now += 1
        progress.update(done=2, failed=1, running=0, waiting=0)  # final: logged at once
        progress.close()  # nothing new to say
    assert stream.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "progress: 0/3  done 0  failed 0  running 1  waiting 2  ETA ?",
        "progress: 1/3  done 1  failed 0  running 1  waiting 1  1.7/min  ETA 1m10s",
        "progress: 3/3  done 2  failed 1  running 0  waiting 0  2.4/min  ETA 0s",
    ]


def test_close_logs_the_last_state_not_yet_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Stopped early (Ctrl+C): the last counts still reach the log."""
    progress, _, clock = make_progress(5, interactive=False, log_every_s=30)
    with caplog.at_level(logging.INFO, logger="controller.progress"):
        progress.update(done=0, failed=0, running=1, waiting=4)
        clock.now += 5
        progress.update(done=1, failed=0, running=0, waiting=0)
        progress.close()
    assert len(caplog.records) == 2
    assert caplog.records[-1].getMessage().startswith("progress: 1/5  done 1")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (44.6, "45s"), (60, "1m00s"), (725, "12m05s"), (3600, "1h00m"),
     (10920, "3h02m"), (187200, "2d04h"), (-3, "0s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
