"""When a model in a long-lived worker counts as hung: the no-progress limit from its size,
and the watch kept over the worker's heartbeats.

Owns the policy, for both who run long-lived workers: the shard pod's supervisor
(esd_worker.serve.supervisor) and the local backend (controller.backends.local). A worker
says `start` when a model begins and `progress` as it goes (esd_worker.core.protocol: a
weight file fetched, a step of the layer discovery, a layer analysed); "hung" means no such
line for the model's limit, never "slow": a 405B model that beats every few seconds runs as
long as it needs.

The limit: `--model-timeout` seconds (the floor, default 600), or more for a big model:
SAFETY × (reading the model at a slow READ_BYTES_PER_S + the eigensolver estimate of
esd_worker.core.estimate, whose parameter count is the size at 2 bytes per parameter). Long
steps between heartbeats are downloading one weight file and one layer's eigensolver, both
well inside that. Pure: no clock of its own (the caller passes `now`), no process handling.
"""

from __future__ import annotations

from dataclasses import dataclass

from esd_worker.core.estimate import single_gpu_minutes, width_from_params

DEFAULT_MODEL_TIMEOUT_S = 600.0
READ_BYTES_PER_S = 25e6  # a slow hub download or disk (25 MB/s): the whole model's bytes
SAFETY = 3.0
MODEL_TIMEOUT = "ModelTimeout"  # the error class of a model killed for making no progress


def no_progress_limit_s(size_bytes: int | None, floor_s: float = DEFAULT_MODEL_TIMEOUT_S) -> float:
    """Seconds without a heartbeat after which a model of `size_bytes` (None: not known yet)
    counts as hung: at least floor_s."""
    if not size_bytes or size_bytes <= 0:
        return floor_s
    params = size_bytes // 2
    estimate = (size_bytes / READ_BYTES_PER_S
                + 60 * single_gpu_minutes(params, width_from_params(params)))
    return max(floor_s, SAFETY * estimate)


@dataclass
class ModelWatch:
    """The model in progress in one worker and when it last showed progress.

    floor_s: --model-timeout. `start` when the worker says a model started, `beat` on each
    progress line (size_bytes once known raises the limit), `end` on its result; `overdue`
    is the error line to charge the model with once it has gone quiet for its limit.
    """

    floor_s: float = DEFAULT_MODEL_TIMEOUT_S
    key: str | None = None
    last_beat: float = 0.0
    size_bytes: int | None = None
    beats: int = 0

    def start(self, key: str, now: float) -> None:
        self.key, self.last_beat, self.size_bytes, self.beats = key, now, None, 0

    def beat(self, key: str, now: float, size_bytes: int | None = None) -> None:
        if key != self.key:
            return  # a late line of a model that has ended
        self.last_beat = now
        self.beats += 1
        if size_bytes is not None and size_bytes > 0:
            self.size_bytes = size_bytes

    def end(self) -> None:
        self.key = None

    @property
    def limit_s(self) -> float:
        return no_progress_limit_s(self.size_bytes, self.floor_s)

    def overdue(self, now: float) -> str | None:
        """"ModelTimeout: ..." when the model in progress made no progress for its limit."""
        if self.key is None:
            return None
        quiet = now - self.last_beat
        limit = self.limit_s
        if quiet < limit:
            return None
        size = (f"{self.size_bytes / 1e9:.1f} GB" if self.size_bytes else "size not known")
        return (f"{MODEL_TIMEOUT}: no progress for {quiet:.0f} s ({self.beats} heartbeat(s) "
                f"before; limit {limit:.0f} s for its size, {size}; --model-timeout sets "
                "the floor): killed as hung")
