"""Run checkpoints: `checkpoints/step_N/` = the trainer's distributed checkpoint + the driver state (step, weight
version, prompt-loader position, driver RNG); the newest `checkpoint.keep_last` are kept. `--resume` restores the
newest complete one."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from beamrl.loop.groups import TrainerGroup
from beamrl.loop.log import log
from beamrl.loop.run_state import load_driver_state, save_driver_state


def save_checkpoint(trainer: TrainerGroup, root: Path, step: int, version: int, data_state: dict,
                    keep_last: int) -> Path:
    """Write `root/step_<step>` (replacing an incomplete one) and delete all but the newest `keep_last`.

    `data_state` is the prompt loader's position before step `step`'s prompts."""
    d = root / f"step_{step}"
    t0 = time.perf_counter()
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    trainer.save_checkpoint(str(d / "trainer"))
    save_driver_state(d, step, version, data_state)
    kept = sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    for old in kept[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log(f"checkpoint step {step} saved to {d} in {time.perf_counter() - t0:.1f} s")
    return d


def restore_checkpoint(trainer: TrainerGroup, data, directory: Path) -> tuple[int, int]:
    """Load the trainer's state, the loader's position and the driver RNG; returns (step, weight version)."""
    trainer.load_checkpoint(str(directory / "trainer"))
    state = load_driver_state(directory)
    data.load_state_dict(state["data"])
    return state["step"], state["weight_version"]
