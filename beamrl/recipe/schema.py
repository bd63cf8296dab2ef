"""The recipe schema: the sections of a run, each a config class that a component owns, composed here.

A component's section is its own config class, read by the component under the same field names:
`trainer` (`beamrl.trainer.megatron.config.TrainerConfig`), `rollout` (`beamrl.rollout.config.RolloutConfig`),
`algorithm` (`beamrl.algorithms.config.AlgorithmConfig`), `data` (`beamrl.data.config.DataConfig`),
`sync` (`beamrl.sync.config.SyncConfig`) and `logging` (`beamrl.metrics.config.LoggingConfig`). The sections
defined here (`run`, `model`, `cluster`, `placement`, `sft`, `checkpoint`, `timeouts`, `rewards`) are read by
the RL loop itself. Each section checks its own fields; rules that tie sections together live in `rules.py`
(run on every load) and `layout.py` (rules that need the Beam config). Every section forbids unknown keys, so
a misspelt field fails at load with its dotted path. docs/recipes.md is the reference for every field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from beamrl.algorithms.config import AlgorithmConfig
from beamrl.config import Section
from beamrl.data.config import DataConfig
from beamrl.dtypes import RUN_DTYPES
from beamrl.metrics.config import LoggingConfig
from beamrl.rewards.config import RewardComponentConfig, RewardPoolConfig
from beamrl.rollout.config import RolloutConfig
from beamrl.sync.config import SyncConfig
from beamrl.trainer.megatron.config import TrainerConfig

GPU_TYPES = ("h200", "b200")
# 'pkg.module:function' (import path; the part after ':' may be a name the module registers with @reward) or a
# registered / entry-point reward name.
REWARD_REF = re.compile(r"^([A-Za-z_][\w.]*:[A-Za-z_][\w.\-]*|[A-Za-z_][\w.\-]*)$")


class ModelSection(Section):
    """Which Beam to train: a checkpoint directory (HF format, SGLang names) and/or a named preset.

    With only `preset`, the weights are random (seeded by `seed`), and `config_overrides` may change preset
    fields. With both, the checkpoint's config.json must equal the preset (the preset lets `--dry-run` check
    a layout where the checkpoint is not mounted)."""

    preset: str | None = None
    checkpoint: str | None = None
    seed: int | None = None
    dtype: Literal[RUN_DTYPES] = "bfloat16"  # type: ignore[valid-type]
    # BeamConfig fields changed on top of the preset (random init only), e.g. {vocab_size: 16} for the digit
    # tokenizer; validated by BeamConfig itself (errors name the field).
    config_overrides: dict[str, Any] = Field(default_factory=dict)


class ClusterSection(Section):
    """The machines. On `device: cpu` each "GPU" is one CPU worker process (gloo rank)."""

    device: Literal["cuda", "cpu"] = "cuda"
    num_nodes: int = Field(1, gt=0)
    gpus_per_node: int = Field(8, gt=0)
    gpu_type: Literal[GPU_TYPES] = "h200"  # type: ignore[valid-type]

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class PlacementSection(Section):
    """Where rollout runs relative to training. off_policy_steps=1: generate step k+1 while training step k."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    off_policy_steps: Literal[0, 1] = 0
    express_calls: bool = Field(True, description="when every actor runs on the driver's node, the per-step calls "
                                "(rollout, train step, the weight sync's engine calls) go over Unix sockets instead "
                                "of Ray (docs/express-calls.md); false: every call through Ray")


class CheckpointSection(Section):
    """Trainer checkpoints (Megatron distributed format) and the final HF export."""

    dir: str | None = Field(None, description="null = <run.output_dir>/checkpoints")
    every_n_steps: int = Field(0, ge=0, description="0 = only at the end")
    keep_last: int = Field(2, gt=0)
    async_save: bool = Field(True, description="write in the background; the next save waits for this one")
    export_hf_at_end: bool = False


class RunSection(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    output_dir: str | None = Field(None, description="null = outputs/<name>")
    num_steps: int = Field(gt=0)
    seed: int = 0

    @property
    def resolved_output_dir(self) -> str:
        return self.output_dir if self.output_dir is not None else f"outputs/{self.name}"


class TimeoutsSection(Section):
    """Every wait of the loop has one of these limits (seconds). health_s also bounds the placement groups being
    placed at start-up (a cluster too small for the plan fails then, naming its size)."""

    generate_s: float = Field(1800.0, gt=0)
    train_step_s: float = Field(3600.0, gt=0)
    sync_s: float = Field(600.0, gt=0)
    health_s: float = Field(60.0, gt=0)
    checkpoint_s: float = Field(3600.0, gt=0)


#: Fields that moved, by their old dotted path: a recipe file or an override that sets one is told where it went
#: (`beamrl.recipe.load`: in place of "unknown field").
MOVED_FIELDS = {"timeouts.reward_s": "reward_pool.batch_timeout_s"}


def moved_field(path: str) -> str:
    """The message for a moved field (`MOVED_FIELDS`)."""
    return f"{path} moved to {MOVED_FIELDS[path]} (see docs/recipes.md CHANGELOG)"


class SFTSection(Section):
    """Optional supervised warm start on (prompt, ground truth) pairs before RL."""

    steps: int = Field(gt=0)
    lr: float = Field(gt=0)
    batch: int = Field(gt=0)


class Recipe(Section):
    """A complete beamrl run. Load with `beamrl.recipe.load_recipe`; dump with `to_yaml()`."""

    run: RunSection
    model: ModelSection
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    trainer: TrainerConfig
    rollout: RolloutConfig
    placement: PlacementSection = Field(default_factory=PlacementSection)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rewards: list[RewardComponentConfig] = Field(min_length=1)
    reward_pool: RewardPoolConfig = Field(default_factory=RewardPoolConfig)
    data: DataConfig
    sft: SFTSection | None = None
    sync: SyncConfig = Field(default_factory=SyncConfig)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Recipe":
        from beamrl.recipe.rules import check_recipe

        check_recipe(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
