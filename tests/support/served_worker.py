"""A stand-in for `esd-worker --serve` that speaks the real protocol (esd_worker.core.protocol) and
behaves by model name, so the local backend's handling of long-lived workers is tested
without torch: run as `python -m tests.support.served_worker [worker flags, ignored]`.

Model names (the request's "model"):
    ok-*          analysed in 50 ms: done
    wait-*        analysed in 1 s
    slow-*        analysed in 30 s (stop tests)
    fail-*        a permanent failure (exit 3)
    transient-*   a transient failure (exit 4): a retry may help
    poison-*      kills its worker (SIGKILL) every time
    crash-once-*  kills its worker the first time, is done the next
    chatty-*      writes CHATTY_BYTES of log lines to stderr (four pipe buffers), then done
    hang-*        hangs: no heartbeat, no result (HANG_S, far past any limit a test sets)
    hang-once-*   hangs the first time, is done the next
    big-hang-*    one heartbeat saying the model is BIG_BYTES (a limit above the floor), then
                  hangs
    beat-*        slow but alive: BEAT_S of work with a heartbeat every BEAT_EVERY_S, then done
Every start is appended to $FAKE_WORKER_STATE/starts as "<pid> <key> <attempt>" (the tests count
workers and attempts from it), every worker's argv and CUDA_VISIBLE_DEVICES to
$FAKE_WORKER_STATE/workers as a JSON line; the directory also holds crash-once flags.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from esd_worker.core.protocol import (
    DONE,
    FAILED,
    Request,
    Result,
    begin_line,
    end_line,
    event_line,
    progress_line,
)
from esd_worker.serve.inbox import Inbox

CHATTY_BYTES = 256 * 1024  # a Linux pipe holds 64 KiB: a writer nobody reads blocks past it
HANG_S = 20.0
BIG_BYTES = 25_000_000  # its no-progress limit (esd_worker.core.watchdog) is about 3 s
BEAT_S, BEAT_EVERY_S = 2.0, 0.2  # twice a 1 s --model-timeout, beating 5 times a second


def analyse(request: Request, state: Path, out: TextIO) -> Result:
    name = request.model
    with open(state / "starts", "a") as f:
        f.write(f"{os.getpid()} {request.key} {request.attempt}\n")
    print(f"analysing {name} attempt {request.attempt}", file=sys.stderr, flush=True)
    if name.startswith("poison-"):
        os.kill(os.getpid(), signal.SIGKILL)
    if name.startswith("crash-once-"):
        flag = state / f"crashed-{request.key}"
        if not flag.exists():
            flag.touch()
            os.kill(os.getpid(), signal.SIGKILL)
    if name.startswith("wait-"):
        time.sleep(1)
    if name.startswith("big-hang-"):
        out.write(progress_line(request.key, layers=0, size_bytes=BIG_BYTES))
        out.flush()
        time.sleep(HANG_S)
    if name.startswith("hang-once-"):
        flag = state / f"hung-{request.key}"
        if not flag.exists():
            flag.touch()
            time.sleep(HANG_S)
    elif name.startswith("hang-"):
        time.sleep(HANG_S)
    if name.startswith("beat-"):
        for layer in range(round(BEAT_S / BEAT_EVERY_S)):
            time.sleep(BEAT_EVERY_S)
            out.write(progress_line(request.key, layers=layer + 1))
            out.flush()
    if name.startswith("slow-"):
        time.sleep(30)
    if name.startswith("chatty-"):
        line = "chatter " + "x" * 120 + "\n"
        for _ in range(CHATTY_BYTES // len(line) + 1):
            sys.stderr.write(line)
        sys.stderr.flush()
    if name.startswith("fail-"):
        print("esd-worker: error: model not found: " + name, file=sys.stderr, flush=True)
        return Result(request.key, FAILED, 3, f"PermanentModelError: model not found: {name}")
    if name.startswith("transient-"):
        return Result(request.key, FAILED, 4, "TransientError: hub unreachable", True)
    time.sleep(0.05)
    return Result(request.key, DONE, 0)


def main() -> int:
    state = Path(os.environ["FAKE_WORKER_STATE"])
    with open(state / "workers", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "cpu_share": os.environ.get("ESD_CPU_SHARE")}) + "\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(4))
    out = sys.stdout
    out.write(event_line("ready", pid=os.getpid()))
    out.flush()
    inbox = Inbox()  # the real worker's request reader: drain drops what is queued
    inbox.read_from(sys.stdin)
    for op in inbox:
        out.write(event_line("start", key=op.key))
        out.flush()
        sys.stderr.write(begin_line(op.key, op.attempt))
        sys.stderr.flush()
        result = analyse(op, state, out)
        sys.stderr.write(end_line(op.key))
        sys.stderr.flush()
        out.write(result.to_line())
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
