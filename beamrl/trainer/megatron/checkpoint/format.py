"""The checkpoint's JSON: `beamrl_checkpoint.json` (format, step, layout, configs, scheduler, file manifest).

Written last, by rank 0, once every rank's files are complete: a directory without it is not a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from beamrl import manifest

FORMAT = "beamrl-megatron-dist-v1"
META_FILE = "beamrl_checkpoint.json"
RNG_DIR = "rng"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit this trainer; the message names the file."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint file is missing, truncated or corrupted (found before anything was loaded from it)."""


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}.json"


def read_meta(directory: str | Path) -> dict:
    """The checkpoint's `beamrl_checkpoint.json`; `CheckpointError` naming the file if absent (incomplete
    checkpoint), unreadable or of another format."""
    path = Path(directory) / META_FILE
    if not path.exists():
        raise CheckpointError(f"{path} not found: {directory} is not a complete beamrl Megatron checkpoint")
    try:
        meta = manifest.read_json(path, "beamrl checkpoint metadata")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    for key in ("step", "adam_step", "world_size", "parallel", "dtype", "model", "scheduler", "files"):
        if key not in meta:
            raise CheckpointError(f"{path}: field {key!r} missing (corrupted metadata)")
    return meta


def write_meta(directory: Path, meta: dict) -> None:
    manifest.write_json_atomic(Path(directory) / META_FILE, meta)


def check(directory: str | Path, full: bool) -> list[str]:
    """Problems of a trainer checkpoint (empty: complete and intact). `full=False`: metadata readable, every file
    present at its recorded size, small files' digests (cheap); `full=True`: every file's digest."""
    try:
        meta = read_meta(directory)
        return manifest.check(Path(directory), meta["files"], full)
    except CheckpointError as e:
        return [str(e)]
    except (TypeError, KeyError, AttributeError) as e:
        return [f"{Path(directory) / META_FILE}: malformed file list ({type(e).__name__}: {e})"]
