"""The weight sync's CPU shared-memory files (staging slots, rank slots): where they live, how they are named (with
the creating process's id, so a file left by a killed process can be told apart) and their removal.

GPU runs share CUDA memory instead and make none of these files."""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from beamrl.processes import running

_PREFIX = re.compile(r"beamrl(?:-[a-z]+)+")
_NAME = re.compile(r"beamrl(?:-[a-z]+)+-(\d+)-[0-9a-f]{12}(?:-\d+)?")


def shm_dir() -> Path:
    """`/dev/shm` where it is a writable directory, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def new_path(prefix: str) -> str:
    """A fresh file path `<shm_dir>/<prefix>-<pid>-<12 hex>` (`prefix`: `beamrl-` and lower-case words)."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"shared-memory prefix {prefix!r} must be 'beamrl-' and lower-case words joined by '-'")
    return str(shm_dir() / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def creator_pid(name: str) -> int | None:
    """The id of the process that made the file called `name` (a name from `new_path`, optionally with a `-<n>`
    suffix); None for any other name."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def files_of(pids: Iterable[int]) -> list[Path]:
    """The files of `new_path` that any of the processes `pids` made, on this machine."""
    wanted = set(pids)
    return sorted(p for p in shm_dir().glob("beamrl-*") if creator_pid(p.name) in wanted)


def remove_files_of_exited(pids: Iterable[int], wait_s: float = 10.0) -> list[str]:
    """Remove the files of `new_path` made by the processes `pids` once they have exited, waiting up to `wait_s`
    for them (a process killed a moment ago takes that long to go). A process still alive after the wait keeps its
    files: it may be another process that reused the id. Returns the removed file names."""
    pids = set(pids)
    if not files_of(pids):  # nothing to remove: no need to wait for anyone
        return []
    deadline = time.monotonic() + wait_s
    left = pids
    while True:
        left = {pid for pid in left if running(pid)}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    removed = []
    for path in files_of(pids - left):
        remove(str(path))
        removed.append(path.name)
    return removed


def remove(path: str) -> None:
    """Remove a shared-memory file (already gone is fine: finalizers may run after an explicit close)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
