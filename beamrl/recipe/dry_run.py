"""`beamrl train RECIPE --dry-run`: check the whole layout without GPUs and print it, with the run's start-up
checks (`preflight.py`) wherever what they check is on this machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from beamrl.recipe.layout import format_layout, plan_layout
from beamrl.recipe.memory import engine_memory, gpu_capacity, memory_problems, trainer_memory
from beamrl.recipe.model_spec import require_model_config
from beamrl.recipe.preflight import preflight

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe


@dataclass(frozen=True)
class DryRunResult:
    report: str
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def reward_plan(r: "Recipe", functions: list) -> str:
    """The reward pool's layout (workers per component, batch timeout) as report lines, for the loaded
    reward `functions` (`beamrl.recipe.preflight.load_reward_functions`)."""
    from beamrl.rewards.plan import format_plan, plan_components

    return format_plan(plan_components(r.rewards, functions, r.reward_pool), r.reward_pool)


def dry_run(r: "Recipe", checks: bool = True) -> DryRunResult:
    """Plan the layout (raises `RecipeError` on a broken rule), estimate memory and, with `checks`, run the
    run's start-up checks wherever their subject is on this machine (`beamrl.recipe.preflight`: checkpoint
    tensors, tokenizer, data source, reward imports; a failure raises `RecipeError` naming the field) and print
    the reward pool. Memory over capacity is returned as a problem, not raised."""
    config, source = require_model_config(r)
    lay = plan_layout(r, config)
    tmem = trainer_memory(r, config, lay)
    emem = engine_memory(r, config, lay)
    report = format_layout(r, config, source, lay, tmem, emem, gpu_capacity(r))
    problems = memory_problems(r, lay, tmem, emem)
    if r.cluster.device != "cpu":
        from beamrl.recipe.sync_time import estimate_sync_time, format_estimate, format_lora_estimate

        estimate = estimate_sync_time(r, config)
        report += "\n" + format_estimate(estimate, r)
        if r.trainer.lora is not None:
            report += "\n" + format_lora_estimate(estimate, r, config)
    if checks:
        found = preflight(r, config)
        report += "\nstart-up checks:\n" + "\n".join(f"  {line}" for line in found.lines)
        report += "\n" + reward_plan(r, found.reward_functions)
    return DryRunResult(report, problems)
