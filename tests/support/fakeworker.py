"""A fake supervised child for the supervisor's tests: one model, the batch's protocol lines
and attempt note, and one way of ending (hang, crash, leak, ...), in a tenth of a second
instead of a torch import.

    python fakeworker.py STORE_DIR KEY SCENARIO MAX_RETRIES

Like esd_worker.serve.batch it writes the model's attempt note (starts + 1) before `start`,
clears it with the model's result or on SIGTERM, and past MAX_RETRIES + 1 starts reports
the model as poison with the note's `last_error` as its error (what the real batch's
record says), then exits 0. Imports nothing of the repository.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("slow", "hang", "sigkill", "sigsegv", "leak", "device", "idle-kill",
             "transient", "stop", "oom-killed", "gpu-oom")


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def result(key: str, status: str, code: int, error: str = "", retryable: bool = False) -> None:
    emit(event="result", key=key, status=status, exit_code=code, error=error,
         retryable=retryable, seconds=0.0)


def main(store: Path, key: str, scenario: str, max_retries: int) -> int:
    note_path = store / "_attempts" / f"{key}.json"

    def clear_note(signum: int = 0, frame: object = None) -> None:
        note_path.unlink(missing_ok=True)
        if signum:
            sys.exit(4)  # a stop: not the model's fault

    signal.signal(signal.SIGTERM, clear_note)
    emit(event="ready", pid=os.getpid())
    if scenario == "device":
        return 6
    if scenario == "idle-kill":
        os.kill(os.getpid(), signal.SIGKILL)
    note = json.loads(note_path.read_text()) if note_path.exists() else {}
    starts = note.get("starts", 0) + 1
    note_path.parent.mkdir(parents=True, exist_ok=True)
    note_path.write_text(json.dumps({"model": f"org/{scenario}", "starts": starts,
                                     "run_id": "run-7"}))
    emit(event="start", key=key)
    if starts > max_retries + 1:
        clear_note()
        result(key, "failed", 3, note.get("last_error", "WorkerCrashed: no cause"))
        return 0
    if scenario in ("slow", "stop"):
        for layer in range(12 if scenario == "slow" else 600):
            time.sleep(0.2)  # longer than the limit in all, a beat well inside it
            emit(event="progress", key=key, layers=layer + 1, bytes=1000)
    elif scenario == "hang":
        # A grandchild in its group: the supervisor's kill must take it too.
        sleeper = subprocess.Popen(["sleep", "3600"])
        (store / "grandchild.pid").write_text(str(sleeper.pid))
        time.sleep(3600)
    elif scenario == "oom-killed":  # as the kernel does it: counted in memory.events
        events = store / "memory.events"
        kills = int(events.read_text().split()[-1]) if events.exists() else 0
        events.write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills + 1}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario in ("sigkill", "sigsegv"):
        os.kill(os.getpid(), signal.SIGKILL if scenario == "sigkill" else signal.SIGSEGV)
    elif scenario == "leak":
        hoard = []
        for _ in range(100):  # 2 GB at most, 20 MB at a time, every page touched
            hoard.append(bytearray(b"\x01") * (20 << 20))
            time.sleep(0.02)
        time.sleep(3600)
    elif scenario == "gpu-oom":  # the batch's ProcessPoisoned: no result, the note kept
        return 5
    elif scenario == "transient":
        clear_note()
        result(key, "failed", 4, "TransientError: the hub said 503", retryable=True)
        return 4
    clear_note()
    result(key, "done", 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
