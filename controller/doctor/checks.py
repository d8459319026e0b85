"""A check's outcome as `esd-sweep doctor` reports it: status, what was found, what to do;
its line (✓ ✗ – •), its JSON, and the exit rule. Pure: the checks themselves are
controller.doctor.doctor's, controller.doctor.local's and controller.doctor.kubernetes's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from controller.errors import EXIT_ALL_DONE, EXIT_CHECK_FAILED
from esd_worker.core.redact import redact, redact_data

PASS, FAIL, SKIP, INFO = "pass", "fail", "skip", "info"
SYMBOLS = {PASS: "✓", FAIL: "✗", SKIP: "–", INFO: "•"}


@dataclass(frozen=True)
class Check:
    """One check's outcome. status: PASS, FAIL, SKIP (does not apply here) or INFO (applies,
    nothing to fix: e.g. no GPU with --device auto); detail: what was found; fix: what to do
    (failures)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """`✓ name: detail`, with ` — fix: …` when there is something to do; redacted."""
        text = f"{SYMBOLS[self.status]} {self.name}: {self.detail}"
        if self.fix:
            text += f" — fix: {self.fix}"
        return redact(text)

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix}


def exit_status(checks: Iterable[Check]) -> int:
    """EXIT_CHECK_FAILED when a check failed, else 0: skips and infos never fail."""
    failed = any(check.status == FAIL for check in checks)
    return EXIT_CHECK_FAILED if failed else EXIT_ALL_DONE


def report_json(checks: Iterable[Check]) -> str:
    """--json: {"ok", "exit_code", "checks": [{name, status, detail, fix}, …]}, redacted."""
    done = list(checks)
    code = exit_status(done)
    doc = {"ok": code == EXIT_ALL_DONE, "exit_code": code,
           "checks": [check.as_dict() for check in done]}
    return json.dumps(redact_data(doc), indent=2, ensure_ascii=False)
