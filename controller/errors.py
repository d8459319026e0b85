"""The controller's exit statuses and exception family, and the one mapping from errors to both.

`esd-sweep` exits 0 all done, 1 some models failed, 2 usage or configuration, 3
infrastructure (store or cluster unreachable, permissions), 130 interrupted
(docs/design.md, "Exit codes"); `esd-sweep doctor` exits 1 when one of its checks failed
(EXIT_CHECK_FAILED). Every command turns an error into its one-line message and
status with `describe_error`; nothing else picks an exit status from an exception. The
worker's own exit codes are esd_worker.core.errors'.
"""

from __future__ import annotations

from esd_worker.core.errors import StoreError, StorePermanentError, WorkerError

EXIT_ALL_DONE = 0
EXIT_SOME_FAILED = 1
EXIT_CHECK_FAILED = EXIT_SOME_FAILED  # doctor: a check that applies failed
EXIT_USAGE = 2
EXIT_INFRA = 3
EXIT_INTERRUPTED = 130


class SweepError(Exception):
    """A problem that stops a command before or while it runs; `exit_code` says which."""

    exit_code = EXIT_USAGE


class InfrastructureError(SweepError):
    """The store, the machine or the cluster cannot be used (unreachable, no permission)."""

    exit_code = EXIT_INFRA


class ResultsError(SweepError):
    """A results location cannot be reported on, refit or compared as asked (exit 2)."""

    exit_code = EXIT_USAGE


def describe_error(e: BaseException) -> tuple[int, str] | None:
    """(exit status, one-line message) for an error a command expects; None for a bug.

    The table, in order: the controller's own errors carry their status; the result store's
    errors are infrastructure (3) whether transient or not (a wrong bucket, no access, a
    store that is down); any other worker-side error raised in the controller (a bad
    output URL, bad analysis flags) is usage (2).
    """
    if isinstance(e, SweepError):
        return e.exit_code, str(e)
    if isinstance(e, StoreError):
        return EXIT_INFRA, f"result store: {e}"
    if isinstance(e, StorePermanentError):
        return EXIT_INFRA, str(e)
    if isinstance(e, WorkerError):
        return EXIT_USAGE, str(e)
    return None
