"""`beamrl train RECIPE --dry-run`: check the whole layout without GPUs and print it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from beamrl.recipe.layout import format_layout, plan_layout
from beamrl.recipe.memory import engine_memory, gpu_capacity, memory_problems, trainer_memory
from beamrl.recipe.model_spec import require_model_config

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe


@dataclass(frozen=True)
class DryRunResult:
    report: str
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def reward_plan(r: "Recipe") -> tuple[str | None, list[str]]:
    """The reward pool's layout (workers per component, batch timeout) as report lines, and the components
    that do not resolve to a callable accepting their kwargs (beamrl.rewards' own loader: import path,
    registered name or entry point, and a signature check). No report when a component does not load."""
    from beamrl.rewards.loading import load_reward_fn
    from beamrl.rewards.plan import format_plan, plan_components

    problems, functions = [], []
    for i, comp in enumerate(r.rewards):
        try:
            functions.append(load_reward_fn(comp.fn, comp.kwargs.keys()))
        except Exception as e:  # any failure to load is a problem to report, not a crash of the dry run
            problems.append(f"rewards[{i}].fn={comp.fn!r}: {e}")
    if problems:
        return None, problems
    return format_plan(plan_components(r.rewards, functions, r.reward_pool), r.reward_pool), []


def dry_run(r: "Recipe", check_rewards: bool = True) -> DryRunResult:
    """Plan the layout (raises `RecipeError` on a broken rule) and estimate memory; problems that do not
    stop planning (memory over capacity, a missing reward module) are returned, not raised."""
    config, source = require_model_config(r)
    lay = plan_layout(r, config)
    tmem = trainer_memory(r, config, lay)
    emem = engine_memory(r, config, lay)
    report = format_layout(r, config, source, lay, tmem, emem, gpu_capacity(r))
    problems = memory_problems(r, lay, tmem, emem)
    if r.cluster.device != "cpu":
        from beamrl.recipe.sync_time import estimate_sync_time, format_estimate

        report += "\n" + format_estimate(estimate_sync_time(r, config), r)
    if check_rewards:
        rewards_report, reward_problems = reward_plan(r)
        if rewards_report:
            report += "\n" + rewards_report
        problems += reward_problems
    return DryRunResult(report, problems)
