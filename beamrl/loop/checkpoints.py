"""The run's checkpoints on the driver side (docs/checkpoints.md): when to save, atomic publication, rotation and
the choice of the checkpoint `--resume` continues from.

Layout under `checkpoint.dir`: `step_N/` = `trainer/` (the trainer's distributed checkpoint) + `driver_state.json`
(step, weight version, data position, driver RNG) + `manifest.json` (size and SHA-256 of those two JSON files; the
trainer's files are listed in `trainer/beamrl_checkpoint.json`). A checkpoint is written to `step_N.incomplete/`
and renamed to `step_N/` only after every trainer rank finished (the trainer's async write included) and the
driver state and manifest are written: a `step_N/` directory is complete by construction, and a crash leaves
at most an `.incomplete` directory, which the next save or rotation removes.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

from beamrl import manifest
from beamrl.loop.run_state import STATE_FILE, load_driver_state, save_driver_state
from beamrl.removal import remove_tree, undeleted_line
from beamrl.trainer.megatron.checkpoint import META_FILE, CheckpointDamagedError
from beamrl.trainer.megatron.checkpoint import check as check_trainer_checkpoint

TRAINER_DIR = "trainer"
MANIFEST_FILE = "manifest.json"
STAGING_SUFFIX = ".incomplete"
REPLACED_SUFFIX = ".replaced"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_due(steps_done: int, every_n_steps: int, num_steps: int) -> bool:
    """A periodic checkpoint after `steps_done` steps? (The final one is always written by `finish`: with
    `every_n_steps: 0` it is the only one.)"""
    return every_n_steps > 0 and steps_done % every_n_steps == 0 and steps_done < num_steps


def step_of(directory: Path) -> int:
    """N of a `step_N` directory."""
    m = _STEP_DIR.match(Path(directory).name)
    if m is None:
        raise ValueError(f"{directory} is not a step_N checkpoint directory")
    return int(m.group(1))


def published(root: Path) -> list[Path]:
    """Published `step_N` directories under `root`, oldest first (not validated)."""
    if not Path(root).is_dir():
        return []
    return sorted((p for p in Path(root).iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=step_of)


def problems(directory: Path) -> list[str]:
    """Why a published checkpoint cannot be resumed from (empty: it can), each naming the file. Cheap: manifests
    parse, every file exists at its recorded size, small files (JSON, metadata) match their SHA-256. The trainer
    checks every data file's SHA-256 when it loads."""
    directory = Path(directory)
    try:
        own = manifest.read_json(directory / MANIFEST_FILE, "checkpoint manifest")
        files = own["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [str(e) if isinstance(e, ValueError) else f"{directory / MANIFEST_FILE}: no 'files' entry"]
    found = manifest.check(directory, files, full=False)
    return found or check_trainer_checkpoint(directory / TRAINER_DIR, full=False)


def pick_resume(root: Path, log: Callable[[str], None], skip: tuple[Path, ...] = ()) -> Path | None:
    """The newest published checkpoint without `problems` (None if there is none). Each damaged one is reported
    with its first problem, and the next older one is tried."""
    for directory in reversed(published(root)):
        if directory in skip:
            continue
        found = problems(directory)
        if not found:
            return directory
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        log(f"checkpoint {directory} is damaged: {found[0]}{more}; falling back to the previous checkpoint")
    return None


class RunCheckpoints:
    """Saves of one run: at most one in flight (an async trainer save is published when every rank finished)."""

    def __init__(self, root: Path, keep_last: int, async_save: bool, timeout_s: float, log: Callable[[str], None]):
        self.root, self.keep_last, self.async_save, self.timeout_s, self.log = \
            Path(root), keep_last, async_save, timeout_s, log
        self._pending: tuple[int, Path, float] | None = None

    def save(self, trainer, step: int, weight_version: int, data_state: dict) -> None:
        """Checkpoint after `step` steps. Waits for the previous save first; returns once the trainer state is
        staged (async) or written (sync)."""
        self.wait(trainer)
        staging = self.root / f"step_{step}{STAGING_SUFFIX}"
        if staging.exists():
            shutil.rmtree(staging)  # left by a crash
        staging.mkdir(parents=True)
        t0 = time.perf_counter()
        trainer.save_checkpoint(str(staging / TRAINER_DIR), self.async_save, self.timeout_s)
        save_driver_state(staging, step, weight_version, data_state)
        self._pending = (step, staging, t0)
        if self.async_save:
            self.log(f"checkpoint step {step}: state staged in {time.perf_counter() - t0:.1f} s, writing in the "
                     f"background")
        else:
            self.wait(trainer)

    def load_for_resume(self, trainer, directory: Path) -> Path:
        """Load `directory` (from `pick_resume`) into the trainer. If the trainer finds a damaged data file (it
        checks every digest before loading anything), report it and fall back to the previous checkpoint.
        Returns the checkpoint loaded."""
        tried: list[Path] = []
        while True:
            try:
                trainer.load_checkpoint(str(Path(directory) / TRAINER_DIR), self.timeout_s)
                return Path(directory)
            except Exception as e:  # noqa: BLE001 - only damage is handled here; the rest is re-raised
                damage = _damage(e)
                if damage is None:
                    raise
                self.log(f"checkpoint {directory} is damaged: {damage}; falling back to the previous checkpoint")
            tried.append(Path(directory))
            directory = pick_resume(self.root, self.log, skip=tuple(tried))
            if directory is None:
                raise FileNotFoundError(f"--resume: no undamaged checkpoint left under {self.root}")

    def poll(self, trainer) -> None:
        """Publish the save in flight if every trainer rank has finished writing (does not block)."""
        if self._pending is not None and trainer.finalize_checkpoint(False, self.timeout_s) is not None:
            self._publish()

    def wait(self, trainer) -> None:
        """Finish and publish the save in flight (blocks up to the checkpoint timeout)."""
        if self._pending is not None:
            trainer.finalize_checkpoint(True, self.timeout_s)
            self._publish()

    def _publish(self) -> None:
        step, staging, t0 = self._pending
        self._pending = None
        files = {STATE_FILE: manifest.file_entry(staging / STATE_FILE)}
        rel = f"{TRAINER_DIR}/{META_FILE}"
        files[rel] = manifest.file_entry(staging / rel)
        manifest.write_json_atomic(staging / MANIFEST_FILE, {"step": step, "files": files})
        final = self.root / f"step_{step}"
        replaced = None
        if final.exists():  # the same step saved again (a resumed run): keep the old one until the rename
            replaced = final.with_name(final.name + REPLACED_SUFFIX)
            self._remove(replaced)  # left by a crash; if it stays, the replace below fails loudly
            os.replace(final, replaced)
        os.replace(staging, final)
        _fsync_dir(self.root)
        if replaced is not None:
            self._remove(replaced)
        self._rotate(keep=final)
        self.log(f"checkpoint step {step} published at {final} ({time.perf_counter() - t0:.1f} s after the save "
                 f"started)")

    def _rotate(self, keep: Path) -> None:
        done = published(self.root)
        for old in done[: max(0, len(done) - self.keep_last)]:
            if old != keep:
                self._remove(old)
        for suffix in (STAGING_SUFFIX, REPLACED_SUFFIX):
            for stale in self.root.glob(f"step_*{suffix}"):
                self._remove(stale)

    def _remove(self, path: Path) -> None:
        """Delete an old checkpoint folder; a failure is said, in one line per folder (the run goes on, but the
        disk fills up)."""
        errors = remove_tree(path)
        if errors:
            self.log(f"checkpoints: {undeleted_line(path, errors)}")


def _damage(error: BaseException) -> str | None:
    """The trainer's `CheckpointDamagedError` message if `error` is (or was caused by) one."""
    while error is not None:
        if isinstance(error, CheckpointDamagedError):
            return str(error)
        error = error.__cause__
    return None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore_driver_state(data, directory: Path) -> tuple[int, int]:
    """The prompt loader's position and the driver RNG of a loaded checkpoint; returns (step, weight version)."""
    state = load_driver_state(Path(directory))
    data.load_state_dict(state["data"])
    return state["step"], state["weight_version"]
