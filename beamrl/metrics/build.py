"""The metrics logger a recipe asks for: console + metrics.jsonl (always) + TensorBoard + wandb."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from beamrl.metrics.console import ConsoleLogger
from beamrl.metrics.jsonl import JsonlLogger
from beamrl.metrics.logger import MetricsLogger, MultiLogger

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe


def build_metrics_logger(recipe: "Recipe", output_dir: str | Path | None = None) -> MultiLogger:
    """Backends under `output_dir` (default run.output_dir): metrics.jsonl, tensorboard/, wandb/."""
    out = Path(output_dir if output_dir is not None else recipe.run.resolved_output_dir)
    lg = recipe.logging
    loggers: list[MetricsLogger] = [JsonlLogger(out)]
    if lg.console:
        loggers.append(ConsoleLogger(recipe.run.num_steps))
    if lg.tensorboard:
        from beamrl.metrics.tensorboard import TensorBoardLogger

        loggers.append(TensorBoardLogger(out / "tensorboard"))
    if lg.wandb.enabled:
        from beamrl.metrics.wandb_backend import WandbLogger

        loggers.append(WandbLogger(lg.wandb.project, recipe.run.name, out, lg.wandb.mode, lg.wandb.entity,
                                   config=recipe.to_dict()))
    return MultiLogger(loggers)
