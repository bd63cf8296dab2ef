"""The recipe schema: one pydantic model per YAML section, fields mirroring the YAML one to one.

Every section forbids unknown keys, so a misspelt or renamed field fails at load with its dotted path.
Rules that tie fields of different sections together live in `rules.py` (model-independent, run on every
load) and `layout.py` (rules that need the Beam config: heads, experts, layers). docs/recipes.md is the
reference for every field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GPU_TYPES = ("h200", "b200")
# SGLang 0.5.23's deterministic-inference backends usable on NVIDIA GPUs (choices.py:113-120; ascend and
# intel_xpu are other vendors). trtllm_mha, Beam's default on sm90+, is NOT deterministic.
DETERMINISTIC_ATTENTION_BACKENDS = ("fa3", "fa4", "flashinfer", "triton")
ATTENTION_BACKENDS = DETERMINISTIC_ATTENTION_BACKENDS + ("trtllm_mha", "torch_native")
# 'pkg.module:function' (import path) or a registered / entry-point reward name.
REWARD_REF = re.compile(r"^([A-Za-z_][\w.]*:[A-Za-z_][\w.]*|[A-Za-z_][\w.\-]*)$")


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors; assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())



class ModelSection(Section):
    """Which Beam to train: a checkpoint directory (HF format, SGLang names) and/or a named preset.

    With only `preset`, the weights are random (seeded by `seed`), and `config_overrides` may change preset
    fields. With both, the checkpoint's config.json must equal the preset (the preset lets `--dry-run` check
    a layout where the checkpoint is not mounted)."""

    preset: str | None = None
    checkpoint: str | None = None
    seed: int | None = None
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # BeamConfig fields changed on top of the preset (random init only), e.g. {vocab_size: 16} for the digit
    # tokenizer; validated by BeamConfig itself (errors name the field).
    config_overrides: dict[str, Any] = Field(default_factory=dict)


class ClusterSection(Section):
    """The machines. On `device: cpu` each "GPU" is one CPU worker process (gloo rank)."""

    device: Literal["cuda", "cpu"] = "cuda"
    num_nodes: int = Field(1, gt=0)
    gpus_per_node: int = Field(8, gt=0)
    gpu_type: Literal["h200", "b200"] = "h200"

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class TrainerSection(Section):
    """Megatron-core trainer parallelism and optimisation. `dp` is derived: num_gpus / (tp * pp)."""

    num_gpus: int = Field(gt=0)
    tp: int = Field(1, gt=0)
    sp: bool = False
    ep: int = Field(1, gt=0)
    # Beam's trainer keeps whole experts per rank (expert tensor parallel 1): the engine rounds each expert's
    # weighted down-projection to BF16 once, which a TP-split expert cannot reproduce (docs/trainer.md).
    etp: int = Field(1, gt=0, description="expert tensor parallel size; Beam supports 1")
    pp: int = Field(1, gt=0)
    vpp: int | None = Field(None, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    global_batch_size: int = Field(gt=0)
    lr: float = Field(gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    optimizer: Literal["adam"] = "adam"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    distributed_optimizer: bool = True
    # Megatron OptimizerConfig.optimizer_cpu_offload / optimizer_offload_fraction (HybridDeviceOptimizer).
    optimizer_offload_fraction: float = Field(0.0, ge=0, le=1)
    # Megatron DDPConfig.grad_reduce_in_fp32: main grads accumulated and reduced in FP32 (or BF16).
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    recompute: Literal["none", "full"] = "none"
    use_fused_kernels: bool = False
    seed: int | None = Field(None, description="null = run.seed")

    @property
    def expert_tp(self) -> int:
        return self.etp

    @property
    def dp(self) -> int:
        """Data-parallel size; only meaningful once `rules.check_recipe` has passed."""
        return self.num_gpus // (self.tp * self.pp)


class RolloutSection(Section):
    """Rollout engines and sampling. `server_args` are extra SGLang ServerArgs (fields here win)."""

    engine: Literal["sglang", "native"] = "sglang"
    num_engines: int = Field(1, gt=0)
    engine_tp: int = Field(1, gt=0)
    mem_fraction: float = Field(0.85, gt=0, lt=1)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n_samples_per_prompt: int = Field(gt=0)
    prompts_per_step: int = Field(gt=0)
    return_routed_experts: bool | None = Field(None, description="null = algorithm.routing_replay")
    server_args: dict[str, Any] = Field(default_factory=dict)
    swa_full_tokens_ratio: float = Field(0.8, gt=0, le=1)
    deterministic: bool = False
    attention_backend: Literal[ATTENTION_BACKENDS] | None = None  # type: ignore[valid-type]

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.engine_tp

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples_per_prompt


class PlacementSection(Section):
    """Where rollout runs relative to training. off_policy_steps=1: generate step k+1 while training step k."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    off_policy_steps: Literal[0, 1] = 0


class KLSection(Section):
    """KL to a frozen reference policy. reference=true with coef=0 logs the KL without putting it in the loss."""

    coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"
    reference: bool = False


class ImportanceSection(Section):
    """Rollout-vs-trainer importance correction: TIS truncates weights at `cap`; MIS masks tokens (or whole
    sequences, by their geometric-mean ratio: level 'sequence') outside [lo, hi]."""

    mode: Literal["none", "tis", "mis"] = "none"
    cap: float | None = Field(None, gt=0)
    lo: float | None = Field(None, ge=0)
    hi: float | None = Field(None, gt=0)
    level: Literal["token", "sequence"] = "token"


class DynamicSamplingSection(Section):
    """DAPO dynamic sampling: drop groups whose raw rewards all agree; re-sample up to N extra rounds."""

    enabled: bool = False
    max_oversample_rounds: int = Field(3, gt=0)


class OverlongSection(Section):
    """DAPO soft overlong punishment: linear penalty over the last `buffer` tokens before max_new_tokens."""

    enabled: bool = False
    buffer: int = Field(512, gt=0)
    penalty: float = Field(1.0, ge=0)


class AlgorithmSection(Section):
    """Advantage estimator, policy loss and their knobs."""

    advantage: Literal["grpo"] = "grpo"
    normalize_std: bool = True
    loss: Literal["ppo_clip"] = "ppo_clip"
    eps_clip_low: float = Field(0.2, gt=0, lt=1)
    eps_clip_high: float = Field(0.2, gt=0)
    # The names of beamrl.algorithms.aggregation.AGGREGATIONS (verl's), so the loop passes them through.
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    kl: KLSection = Field(default_factory=KLSection)
    importance: ImportanceSection = Field(default_factory=ImportanceSection)
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    routing_replay: bool | None = Field(None, description="R3; null = true for MoE models")


class RewardComponent(Section):
    """One weighted reward function (mirrors `beamrl.rewards.config.RewardComponentConfig`).

    fn: an import path 'pkg.module:function', a name registered with `@reward`, or a `beamrl.rewards`
    entry-point name. on_error: what a failed call scores: 'zero', 'skip' (excluded) or 'raise' (stop)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    fn: str
    weight: float = 1.0
    timeout_s: float = Field(30.0, gt=0)
    on_error: Literal["zero", "skip", "raise"] = "zero"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class SyntheticAdditionSection(Section):
    """Generator of 'a+b=' prompts with a, b in [0, max_operand]; answers are str(a + b)."""

    num_samples: int = Field(1000, gt=0)
    max_operand: int = Field(9, ge=0)
    seed: int = 0


class DataSection(Section):
    """Prompt source. `tokenizer`: 'digit' (built in), an HF tokenizer dir/hub id, or null (model checkpoint)."""

    format: Literal["dapo", "jsonl-prompt-answer", "synthetic-addition"]
    source: str | None = None
    split: str = "train"
    tokenizer: str | None = None
    prompt_template: str | None = None
    chat_template: bool = False
    shuffle: bool = True
    shuffle_seed: int = 0
    max_prompt_len: int = Field(gt=0)
    synthetic: SyntheticAdditionSection | None = None


class SyncSection(Section):
    """Trainer -> engine weight sync (timeout: timeouts.sync_s)."""

    transport: Literal["colocated", "distributed", "disk"] = "colocated"
    bucket_mb: int = Field(512, gt=0)
    verify: bool = True


class CheckpointSection(Section):
    """Trainer checkpoints (Megatron distributed format) and the final HF export."""

    dir: str | None = Field(None, description="null = <run.output_dir>/checkpoints")
    every_n_steps: int = Field(0, ge=0, description="0 = only at the end")
    keep_last: int = Field(2, gt=0)
    async_save: bool = Field(True, description="write in the background; the next save waits for this one")
    export_hf_at_end: bool = False


class WandbSection(Section):
    enabled: bool = False
    project: str = "beamrl"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"


class LoggingSection(Section):
    """Metric outputs. metrics.jsonl in run.output_dir is always written."""

    console: bool = True
    tensorboard: bool = False
    wandb: WandbSection = Field(default_factory=WandbSection)
    plot_reward_curve: bool = True


class RunSection(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    output_dir: str | None = Field(None, description="null = outputs/<name>")
    num_steps: int = Field(gt=0)
    seed: int = 0

    @property
    def resolved_output_dir(self) -> str:
        return self.output_dir if self.output_dir is not None else f"outputs/{self.name}"


class TimeoutsSection(Section):
    """Every wait of the loop has one of these limits (seconds)."""

    generate_s: float = Field(1800.0, gt=0)
    train_step_s: float = Field(3600.0, gt=0)
    sync_s: float = Field(600.0, gt=0)
    reward_s: float = Field(300.0, gt=0)
    health_s: float = Field(60.0, gt=0)
    checkpoint_s: float = Field(3600.0, gt=0)


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
    trainer: TrainerSection
    rollout: RolloutSection
    placement: PlacementSection = Field(default_factory=PlacementSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    rewards: list[RewardComponent] = Field(min_length=1)
    data: DataSection
    sft: SFTSection | None = None
    sync: SyncSection = Field(default_factory=SyncSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
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
