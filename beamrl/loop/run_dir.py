"""A run's output directory: what an earlier run left there, and how a new start treats it (docs/rl-loop.md).

Decided before anything is written or started (`plan_start`); a refusal is a `RecipeError` naming
`run.output_dir` (exit 2, one line):
- a fresh run refuses a directory holding an earlier run's outputs, naming that run and leaving its files as
  they are; `--overwrite` deletes those outputs first (only files and folders a run writes), `--resume`
  continues from its newest complete checkpoint;
- `--resume` without an earlier run or without a complete checkpoint is refused;
- `--resume` of a run whose checkpoint already covers `run.num_steps` has nothing to do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from beamrl.data.tokenizer_identity import TOKENIZER_DIGEST_FILE
from beamrl.loop.checkpoints import REPLACED_SUFFIX, STAGING_SUFFIX, pick_resume, published, step_of
from beamrl.loop.resume_recipe import EARLIER, check_resume_recipe, earlier_recipe
from beamrl.recipe.errors import RecipeError
from beamrl.recipe.schema import Recipe

# What a run writes into its output directory (besides the checkpoints, which may live elsewhere).
OUTPUT_FILES = ("recipe.yaml", TOKENIZER_DIGEST_FILE, "metrics.jsonl", "samples.jsonl", "summary.json",
                "reward_curve.png")
ADAPTER_DIR = "adapter"  # a LoRA run's final adapter, PEFT format
OUTPUT_DIRS = ("sft_checkpoint", "hf_final", ADAPTER_DIR, "tensorboard", "wandb")
INIT_CHECKPOINT_GLOB = "init_checkpoint_seed*"


@dataclass(frozen=True)
class EarlierRun:
    """The outputs of an earlier run in an output directory (and its checkpoint directory)."""

    name: str | None
    num_steps: int | None
    steps_logged: int
    checkpoints: list[Path]
    outputs: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        """`run 'quickstart-addition' (3 of 150 steps logged; last checkpoint step_3)`."""
        of = f" of {self.num_steps}" if self.num_steps else ""
        last = f"last checkpoint {self.checkpoints[-1].name}" if self.checkpoints else "no checkpoint"
        return f"run {self.name or '(unnamed)'!r} ({self.steps_logged}{of} steps logged; {last})"


def checkpoint_root(recipe: Recipe) -> Path:
    """`checkpoint.dir`, or `<run.output_dir>/checkpoints`."""
    r = recipe
    return Path(r.checkpoint.dir) if r.checkpoint.dir else Path(r.run.resolved_output_dir) / "checkpoints"


def earlier_run(out_dir: Path, ckpt_root: Path) -> EarlierRun | None:
    """What an earlier run left in `out_dir` / `ckpt_root`, or None when neither holds any run output."""
    out_dir = Path(out_dir)
    outputs = [out_dir / n for n in (*OUTPUT_FILES, *OUTPUT_DIRS) if (out_dir / n).exists()]
    outputs += sorted(out_dir.glob(INIT_CHECKPOINT_GLOB)) if out_dir.is_dir() else []
    outputs += sorted(out_dir.glob(EARLIER.format(step="*"))) if out_dir.is_dir() else []  # earlier recipes
    checkpoints = published(ckpt_root)
    staged = sorted(p for suffix in (STAGING_SUFFIX, REPLACED_SUFFIX) for p in ckpt_root.glob(f"step_*{suffix}"))
    if not outputs and not checkpoints and not staged:
        return None
    name = num_steps = None
    try:
        run = (yaml.safe_load((out_dir / "recipe.yaml").read_text()) or {}).get("run", {})
        name, num_steps = run.get("name"), run.get("num_steps")
    except (OSError, yaml.YAMLError, AttributeError):
        pass  # no readable recipe.yaml: the run is described by what else it left
    return EarlierRun(name, num_steps, _steps_logged(out_dir / "metrics.jsonl"), checkpoints,
                      outputs + checkpoints + staged)


def _steps_logged(path: Path) -> int:
    steps = set()
    try:
        for line in path.read_text().splitlines():
            try:
                steps.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash
    except OSError:
        return 0
    return len(steps)


@dataclass(frozen=True)
class StartPlan:
    """How a run starts: from `resume_dir` (None: fresh), or not at all (`completed`); `replace` holds the
    earlier run's outputs that `--overwrite` deletes once the start-up checks passed."""

    out_dir: Path
    checkpoint_root: Path
    resume_dir: Path | None = None
    completed: bool = False
    replace: EarlierRun | None = None
    recipe_changed: bool = False  # a resume with settings other than the earlier stretch's (`resume_recipe`)


def plan_start(recipe: Recipe, resume: bool, overwrite: bool, log: Callable[[str], None]) -> StartPlan:
    """Decide how the run starts; `RecipeError` naming run.output_dir when it cannot start as asked, or a field a
    resume must keep (`beamrl.loop.resume_recipe`). Reads, never writes."""
    out_dir, root = Path(recipe.run.resolved_output_dir), checkpoint_root(recipe)
    earlier = earlier_run(out_dir, root)
    if resume and overwrite:
        raise ValueError("--resume continues the earlier run and --overwrite deletes it: choose one")
    if resume:
        if earlier is None:
            raise RecipeError("run.output_dir", str(out_dir), "--resume: no earlier run there to continue (start it "
                              "without --resume)")
        directory = pick_resume(root, log)
        if directory is None:
            why = ("its checkpoints are all damaged" if earlier.checkpoints else
                   "it wrote no checkpoint (checkpoint.every_n_steps: 0 writes one only at the end)")
            raise RecipeError("run.output_dir", str(out_dir), f"--resume: {earlier.describe()} cannot be resumed: "
                              f"{why}; start over with --overwrite, or set run.output_dir for a new run")
        changes = check_resume_recipe(earlier_recipe(out_dir), recipe.to_dict(), log)
        done = step_of(directory)
        return StartPlan(out_dir, root, directory, completed=done >= recipe.run.num_steps,
                         recipe_changed=bool(changes))
    if earlier is not None:
        if not overwrite:
            raise RecipeError("run.output_dir", str(out_dir), f"holds the outputs of {earlier.describe()}: continue "
                              "it with --resume, replace it with --overwrite, or set run.output_dir (or run.name) "
                              "for a new run; nothing was changed")
        return StartPlan(out_dir, root, replace=earlier)
    return StartPlan(out_dir, root)


def delete_outputs(earlier: EarlierRun, log: Callable[[str], None]) -> None:
    """`--overwrite`: delete what the earlier run wrote (its run files and checkpoints, nothing else)."""
    for path in earlier.outputs:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    log(f"--overwrite: deleted the outputs of {earlier.describe()} ({len(earlier.outputs)} files and folders)")
