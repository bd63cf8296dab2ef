"""OS processes: whether one still runs (one rule for the engines' child processes, the weight sync's leftover
files and the tests that watch killed processes), and how a set of them is stopped within a bounded time."""

from __future__ import annotations

import os
import time

import psutil

_POLL_S = 0.02


def running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (a killed process its parent has not reaped yet has
    exited). Another user's process that cannot be inspected counts as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def group_members(pgid: int) -> list[psutil.Process]:
    """The running processes of process group `pgid` (a server started with `start_new_session=True` and
    everything it started, re-parented or not)."""
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and running(p.pid):
                members.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _exited(p: psutil.Process) -> bool:
    try:
        p.wait(timeout=0)  # reaps it if it is this process's child
        return True
    except psutil.TimeoutExpired:
        return not running(p.pid)  # an exited orphan waits as a zombie for its new parent to reap it


def _wait(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    alive = list(procs)
    while alive:
        alive = [p for p in alive if not _exited(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    return alive


def _signal(p: psutil.Process, kill: bool) -> None:
    try:
        if kill:
            p.kill()
        else:
            p.terminate()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or its pid now belongs to another user's process
        pass


def stop_processes(procs: list[psutil.Process], grace: float) -> list[int]:
    """SIGTERM each of `procs` (so their handlers run), wait up to `grace` s for all to exit, then SIGKILL the
    rest and wait up to `grace` s more. Returns the pids still running after that (normally none)."""
    for p in procs:
        _signal(p, kill=False)
    alive = _wait(procs, time.monotonic() + grace)
    for p in alive:
        _signal(p, kill=True)
    return [p.pid for p in _wait(alive, time.monotonic() + grace)]


def stop_group(pgid: int, grace: float, rounds: int = 3) -> list[int]:
    """Stop every process of group `pgid` (`stop_processes`); then again for members that appeared meanwhile (one
    may start a process between the listing and its signal), at most `rounds` listings. Returns the pids still
    running."""
    signalled: set[int] = set()
    left: list[int] = []
    for _ in range(rounds):
        new = [p for p in group_members(pgid) if p.pid not in signalled]
        if not new:
            break
        signalled.update(p.pid for p in new)
        left += stop_processes(new, grace)
    return sorted(set(left) | {p.pid for p in group_members(pgid)})
