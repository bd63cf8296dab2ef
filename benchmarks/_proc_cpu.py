"""CPU time of this process and its descendants, split into named groups (for phase profiles on a busy machine).

Wall-clock time on a shared machine mostly measures the other users; the CPU time a process spends on a
phase does not (apart from cache effects). Times come from `/proc/<pid>/task/<tid>/schedstat` (nanoseconds,
every thread), so a 10 ms phase is resolved; `psutil` finds the descendants (Ray actors, the raylet, reward
workers) and a process is put in the first group whose pattern its command line contains.
"""

from __future__ import annotations

import os
import time
import psutil


def process_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of every thread of `pid` so far (0 when the process is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    return sum(_schedstat_ns(f"/proc/{pid}/task/{tid}/schedstat") for tid in tasks)


def _schedstat_ns(path: str) -> int:
    try:  # os-level reads: this runs thousands of times per step
        fd = os.open(path, os.O_RDONLY)
        try:
            return int(os.read(fd, 64).split(None, 1)[0])
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return 0  # the thread ended between the listing and the read


class ProcessGroups:
    """Samples the CPU time of the calling process ("driver") and of its descendants by group.

    `patterns` maps a group name to a command-line substring, e.g. {"trainer": "ray::TrainerActor"}; a
    descendant matching none is counted as "other" (Ray daemons, reward workers)."""

    def __init__(self, patterns: dict[str, str]):
        self.patterns = dict(patterns)
        self.groups = ["driver", *self.patterns, "other"]
        self._members: dict[int, str] = {}
        self._overhead_ns = 0
        self.refresh()

    def refresh(self) -> None:
        """Re-list the descendants (actors start and reward workers come and go during a run)."""
        members = {}
        for child in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            members[child.pid] = next((g for g, pat in self.patterns.items() if pat in cmd), "other")
        self._members = members

    def sample(self) -> dict[str, int]:
        """CPU ns so far per group. The sampling's own cost is kept out of "driver"."""
        t0 = time.thread_time_ns()
        out = dict.fromkeys(self.groups, 0)
        for pid, group in self._members.items():
            out[group] += process_cpu_ns(pid)
        self._overhead_ns += time.thread_time_ns() - t0
        out["driver"] = process_cpu_ns(os.getpid()) - self._overhead_ns
        return out

    def pids(self, group: str) -> list[int]:
        return [p for p, g in self._members.items() if g == group]
