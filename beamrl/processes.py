"""Whether an OS process is still running: one rule for the engines' child processes, the weight sync's leftover
files and the tests that watch killed processes."""

from __future__ import annotations

import psutil


def running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (a killed process its parent has not reaped yet has
    exited). Another user's process that cannot be inspected counts as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
