"""File manifests: the size and SHA-256 of every file of a checkpoint, recorded in JSON when it is published, so a
truncated or corrupted file is found (and named) before anything is loaded from it.

Entries are `{"size": bytes, "sha256": hex}` keyed by the path relative to the checkpoint directory.
`check` compares files with their entries: `full=False` checks existence and size of every file and the digest of
files up to `SMALL_FILE_BYTES` (metadata and JSON: cheap), `full=True` the digest of every file.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: Files up to this size are always checksummed, also in a cheap check (metadata, JSON, RNG states).
SMALL_FILE_BYTES = 4 << 20
#: Files digested in parallel by `check` (hashlib and file reads release the GIL; a rank's data files are several).
CHECK_THREADS = 4
_CHUNK = 8 << 20


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file (streamed)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    """The manifest entry of one file."""
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def check(directory: Path, files: dict[str, dict], full: bool) -> list[str]:
    """Problems of `directory`'s files against their entries, one line each naming the file (empty: all good).
    Up to `CHECK_THREADS` files are read at a time."""

    def problem(rel: str, entry: dict) -> str | None:
        path = Path(directory) / rel
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path}: {size} bytes, the manifest records {entry['size']} (truncated or overwritten)"
        if (full or size <= SMALL_FILE_BYTES) and sha256_of(path) != entry["sha256"]:
            return f"{path}: SHA-256 differs from the manifest (corrupted)"
        return None

    items = sorted(files.items())
    if len(items) > 1 and CHECK_THREADS > 1:
        with ThreadPoolExecutor(max_workers=min(CHECK_THREADS, len(items))) as pool:
            found = list(pool.map(lambda kv: problem(*kv), items))
    else:
        found = [problem(*kv) for kv in items]
    return [p for p in found if p]


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to `path` through a temporary file and a rename: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; `ValueError` naming the file and `what` it should be if absent or unparsable."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {what} ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a JSON object ({what})")
    return obj
