"""The weight sync's CPU shared-memory files (staging slots, rank slots): where they live, how they are named (with
the creating process's id, so a file left by a killed process can be told apart) and their removal."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path


def shm_dir() -> Path:
    """`/dev/shm` where it is a writable directory, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def new_path(prefix: str) -> str:
    """A fresh file path `<shm_dir>/<prefix>-<pid>-<12 hex>`."""
    return str(shm_dir() / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def remove(path: str) -> None:
    """Remove a shared-memory file (already gone is fine: finalizers may run after an explicit close)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
