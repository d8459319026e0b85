"""`esd-sweep run --metrics-port`: /metrics scraped over HTTP while a real local run runs
(CPU worker subprocesses on models built here), its values the run's outcome; the port
free once the run ends; a port in use refused before anything runs (exit 2)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import pytest

from controller import __version__
from controller.backends import open_backend
from controller.backends.base import Backend, Outcome, OutcomeCallback, Work, WorkerSpec
from controller.backends.local.settings import LocalSettings
from controller.cli import main
from controller.output.tenure import Tenure
from controller.progress import Progress
from controller.run.sweep import run_sweep
from controller.settings import SweepSettings
from tests.controller.metrics.scrape import Samples, free_port, refused, scrape, value
from tests.support.builders import make_gpt2

pytestmark = pytest.mark.slow


class Scraped:
    """The real backend, scraping /metrics after the first outcome (the run in progress) and
    once every task has ended (before the run's end closes the endpoint)."""

    def __init__(self, inner: Backend, port: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.port = port
        self.during: Samples | None = None
        self.at_end: Samples | None = None

    def run(self, work: Work, on_outcome: OutcomeCallback,
            progress: Progress | None = None) -> Sequence[Outcome]:
        def then_scrape(outcome: Outcome) -> None:
            on_outcome(outcome)
            if self.during is None:
                self.during = scrape(self.port)

        outcomes = self.inner.run(work, then_scrape, progress)
        self.at_end = scrape(self.port)
        return outcomes

    def request_stop(self) -> None:
        self.inner.request_stop()

    def guard(self, tenure: Tenure) -> None:
        self.inner.guard(tenure)

    def stop_notice(self, count: int) -> str:
        return self.inner.stop_notice(count)

    def dry_run(self, work: Work, out: TextIO) -> int:
        return self.inner.dry_run(work, out)

    def report(self) -> dict[str, Any]:
        return self.inner.report()

    def close(self) -> None:
        self.inner.close()


def test_a_local_run_serves_its_progress_and_failures_and_frees_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tiny GPT-2s and a folder that does not exist, one CPU worker: during the run the
    endpoint answers with the run's identity and one model ended; at the end 2 done (the
    counter and the gauge), 1 failed as PermanentModelError (model domain, not retryable),
    3 attempts, 2 done durations; after the run nothing listens on the port."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    good = [make_gpt2(tmp_path / f"gpt2-{i}", seed=i) for i in range(2)]
    models = tmp_path / "models.csv"
    models.write_text("model_id\n" + "".join(f"{p}\n" for p in
                                             [good[0], tmp_path / "no-such-model", good[1]]))
    port = free_port()
    settings = SweepSettings(output=str(tmp_path / "out"), model_list=models, device="cpu",
                             local=LocalSettings(max_retries=0, log_dir=tmp_path / "logs"),
                             log_dir=tmp_path / "logs", metrics_port=port, summary=False)
    scraped: list[Scraped] = []

    def opener(s: SweepSettings, spec: WorkerSpec) -> Backend:
        scraped.append(Scraped(open_backend(s, spec), port))
        return scraped[0]

    result = run_sweep(settings, opener=opener)

    assert result.exit_code == 1
    [backend] = scraped
    during, end = backend.during, backend.at_end
    assert during is not None and end is not None
    info = {"run_id": result.run_id, "backend": "local", "version": __version__}
    assert value(during, "esd_sweep_run_info", **info) == 1
    assert value(during, "esd_sweep_run_models") == 3
    ended = sum(value(during, "esd_sweep_models", state=s) or 0 for s in ("done", "failed"))
    assert ended <= 1  # the progress line's counts lag the first outcome at most
    assert value(end, "esd_sweep_models", state="done") == 2
    assert value(end, "esd_sweep_models", state="failed") == 1
    assert value(end, "esd_sweep_models", state="to_do") == 0
    assert value(end, "esd_sweep_models_done_total") == 2
    assert value(end, "esd_sweep_failures_total", cause="PermanentModelError",
                 fault_domain="model", retryable="false") == 1
    failures = {k: v for k, v in end.items() if k[0] == "esd_sweep_failures_total"}
    assert sum(failures.values()) == 1
    assert value(end, "esd_sweep_model_attempts_total") == 3
    assert value(end, "esd_sweep_model_duration_seconds_count", outcome="done") == 2
    assert value(end, "esd_sweep_model_duration_seconds_count", outcome="failed") == 1
    assert (value(end, "esd_sweep_last_progress_time_seconds") or 0) >= (
        value(end, "esd_sweep_run_start_time_seconds") or 0) > 0
    assert refused(port)
    with socket.socket() as again:  # released, not merely unanswered: a server can listen
        # (SO_REUSEADDR, as every server sets: the scrapes' closed connections linger in
        # TIME_WAIT; a socket still listening would refuse the bind even so)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()


def test_a_port_in_use_stops_the_run_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Someone listens on the port: exit 2, one error line naming the flag, no run report,
    no lease, no log: nothing ran."""
    out = tmp_path / "out"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["run", "--single-model", str(tmp_path), "--output-dir", str(out),
                     "--device", "cpu", "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("esd-sweep: error:")]
    assert lines == [lines[0]] and f"--metrics-port {port}: cannot listen on " \
        f"127.0.0.1:{port}" in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() or not any(out.rglob("*.json"))
