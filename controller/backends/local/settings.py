"""How the local backend runs workers: its settings, and their checks.

Owns LocalSettings (retries and their backoff, CPU workers, worker logs, the terminate grace,
worker reuse), which controller.settings holds for a run and controller.cli builds from flags.
Its own module so the run's settings import no backend: the backend (.backend) and its run
loop (.loop) import this, never the other way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalSettings:
    """How the local backend runs workers.

    max_retries: extra attempts for transient failures (exit 4/5, killed by a signal);
        default 2, so at most 3 attempts.
    backoff_s: pause before the first retry, seconds (default 5.0); doubles per retry, with
        jitter (x0.5..1.0); other tasks keep running meanwhile.
    backoff_max_s: longest pause between attempts, seconds (default 300).
    cpu_workers: workers at the same time without a GPU tracker (CPU mode; default 1).
    log_dir: each attempt's stdout+stderr is appended to <log_dir>/workers/<key>.log under
        an attempt header (default None: output kept only for the stderr tail).
    terminate_grace_s: after SIGTERM, seconds before SIGKILL (default 10).
    worker_reuse: models one long-lived worker analyses before a fresh one replaces it
        (default None: no limit).
    """

    max_retries: int = 2
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    cpu_workers: int = 1
    log_dir: Path | None = None
    terminate_grace_s: float = 10.0
    worker_reuse: int | None = None

    def validate(self) -> None:
        """Raise one ValueError that names every bad field."""
        problems: list[str] = []
        if self.max_retries < 0:
            problems.append(f"max_retries: must be >= 0, got {self.max_retries}")
        if not self.backoff_s >= 0:
            problems.append(f"backoff_s: must be >= 0 s, got {self.backoff_s}")
        if not self.backoff_max_s >= 0:
            problems.append(f"backoff_max_s: must be >= 0 s, got {self.backoff_max_s}")
        if self.cpu_workers < 1:
            problems.append(f"cpu_workers: must be >= 1, got {self.cpu_workers}")
        if self.worker_reuse is not None and self.worker_reuse < 1:
            problems.append(f"worker_reuse: must be >= 1, got {self.worker_reuse}")
        if not self.terminate_grace_s >= 0:
            problems.append(f"terminate_grace_s: must be >= 0 s, got {self.terminate_grace_s}")
        if problems:
            raise ValueError("invalid local backend settings: " + "; ".join(problems))
