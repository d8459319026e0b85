"""`esd-sweep doctor`: checks that this machine (or cluster) can run a sweep, one line each.

Skeleton: the checks are being written (issue 16).
"""

from __future__ import annotations

import argparse

from controller.errors import SweepError


def run_doctor(args: argparse.Namespace) -> int:
    """Run every check that applies; 0 when all pass, 1 when one fails."""
    raise SweepError("esd-sweep doctor: not written yet")
