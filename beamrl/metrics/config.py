"""`LoggingConfig`: the recipe's `logging` section, owned by the metric loggers and read under these names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from beamrl.config import Section


class WandbConfig(Section):
    """Weights & Biases. `mode: offline` never touches the network (sync the run later with `wandb sync`).
    `finish_timeout_s`: how long the end of a run waits for wandb to finish (online: its upload); after that the
    run ends anyway and says how to upload the rest (`wandb sync <dir>`)."""

    enabled: bool = False
    project: str = "beamrl"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"
    finish_timeout_s: float = Field(300.0, gt=0)


class SamplesConfig(Section):
    """Sampled completions with their rewards, on the console and in samples.jsonl: `count` of them (one per
    prompt group) at the first step, every `every_n_steps` steps and the last step (0: never)."""

    every_n_steps: int = Field(10, ge=0)
    count: int = Field(4, gt=0)


class LoggingConfig(Section):
    """Metric outputs. metrics.jsonl in run.output_dir is always written; `plot_reward_curve` draws
    reward_curve.png from it at the end of a run; `samples` shows what the policy generates."""

    console: bool = True
    tensorboard: bool = False
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    plot_reward_curve: bool = True
    samples: SamplesConfig = Field(default_factory=SamplesConfig)
