"""`LoggingConfig`: the recipe's `logging` section, owned by the metric loggers and read under these names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from beamrl.config import Section


class WandbConfig(Section):
    """Weights & Biases. `mode: offline` never touches the network (sync the run later with `wandb sync`)."""

    enabled: bool = False
    project: str = "beamrl"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"


class LoggingConfig(Section):
    """Metric outputs. metrics.jsonl in run.output_dir is always written; `plot_reward_curve` draws
    reward_curve.png from it at the end of a run."""

    console: bool = True
    tensorboard: bool = False
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    plot_reward_curve: bool = True
