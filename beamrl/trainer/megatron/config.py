"""The trainer's config: the recipe's `trainer` section, owned here and read by the trainer under the same names.

`ParallelConfig` holds the one set of parallel-layout rules of megatron-core 0.19.2
(`parallel_state.initialize_model_parallel`, `moe_layer.py`, `transformer_config.py`), used by the recipe checks
(errors name `trainer.<field>`), by `--dry-run` (the layout it prints) and by the trainer itself
(`initialize_parallel`, the config bridge):
  * sizes: vpp needs pp >= 2; sp does nothing at tp = 1; EP with TP needs SP; etp must be 1 (Beam's experts
    are whole per rank: the engine rounds each expert's weighted down-projection once, which a TP-split expert
    cannot reproduce);
  * world (`dp_size`): num_gpus % (tp * pp) == 0 and dp = num_gpus / (tp * pp); expert grid
    num_gpus % (etp * ep * pp) == 0, i.e. ep * etp divides tp * dp (no context parallelism here);
  * model (`check_model`): tp divides the attention and KV heads (query groups are sharded over TP), the vocab
    and the dense-MLP width; ep divides num_experts and etp the expert width; a MoE model with tp > 1 needs sp;
    a dense model needs ep = 1; pp divides the layers and vpp the layers per stage.
Rank order is Megatron's default `tp-cp-ep-dp-pp`: TP ranks are adjacent, PP is outermost (`coordinates`: which
groups a global rank belongs to, as `parallel_state.RankGenerator` numbers them; the placement plan keeps each
TP and expert-TP group inside a node with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from beamrl.config import ConfigError, Section
from beamrl.models.beam.lora_config import LoRAConfig

if TYPE_CHECKING:
    from beamrl.models.beam.config import BeamConfig


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global trainer rank sits in Megatron's two rank grids (order `tp-cp-ep-dp-pp`, no CP).

    Dense grid: `tp` (TP rank), `dp`, `pp`. Expert grid: `etp` (expert-TP rank), `ep`, `expert_dp`, `pp`."""

    rank: int
    tp: int
    dp: int
    pp: int
    etp: int
    ep: int
    expert_dp: int

    @property
    def tp_group(self) -> tuple[int, int]:
        """The TP group's id: ranks with the same (pp, dp) share one."""
        return self.pp, self.dp

    @property
    def expert_tp_group(self) -> tuple[int, int, int]:
        """The expert-TP group's id: ranks with the same (pp, expert_dp, ep) share one."""
        return self.pp, self.expert_dp, self.ep


class ParallelConfig(Section):
    """Parallel sizes of one trainer. `dp` follows from the number of ranks (`dp_size`).

    tp: tensor parallel; sp: sequence parallel; ep: expert parallel; etp: expert tensor parallel (Beam: 1);
    pp: pipeline stages; vpp: virtual stages (model chunks) per pipeline rank, None = no interleaving."""

    tp: int = Field(1, gt=0)
    sp: bool = False
    ep: int = Field(1, gt=0)
    etp: int = Field(1, gt=0, description="expert tensor parallel size; Beam supports 1")
    pp: int = Field(1, gt=0)
    vpp: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _check_sizes(self) -> "ParallelConfig":
        if self.etp != 1:
            raise ConfigError("etp", self.etp, "Beam's trainer supports only 1 (whole experts per rank: the engine "
                              "rounds each expert's weighted down-projection once, which a TP-split expert cannot "
                              "match); scale experts with ep instead")
        if self.vpp is not None and self.pp < 2:
            raise ConfigError("vpp", self.vpp, "interleaved pipelining needs pp >= 2; remove vpp")
        if self.sp and self.tp == 1:
            raise ConfigError("sp", True, "sequence parallelism shards over TP and does nothing at tp=1; set false")
        if self.ep > 1 and self.tp > 1 and not self.sp:
            raise ConfigError("sp", False, "expert parallelism with tp > 1 requires sp: true (Megatron)")
        return self

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    @property
    def parallel(self) -> "ParallelConfig":
        """Only the parallel sizes (a `TrainerConfig` is also a `ParallelConfig`)."""
        return ParallelConfig(**self.to_dict())

    def to_dict(self) -> dict:
        """The parallel sizes alone (e.g. for a checkpoint's metadata)."""
        return {name: getattr(self, name) for name in ParallelConfig.model_fields}

    def dp_size(self, num_gpus: int) -> int:
        """Data-parallel size on `num_gpus` ranks; `ConfigError` if the sizes do not divide it."""
        mp = self.tp * self.pp
        if num_gpus % mp:
            raise ConfigError("num_gpus", num_gpus, f"must be a multiple of tp * pp = {self.tp} * {self.pp} = {mp} "
                              "(dp = num_gpus / (tp * pp))")
        expert_grid = self.ep * self.etp * self.pp
        if num_gpus % expert_grid:
            raise ConfigError("ep", self.ep, f"ep * etp = {self.ep} * {self.etp} must divide tp * dp = "
                              f"{num_gpus // self.pp} (Megatron: num_gpus={num_gpus} divisible by etp*ep*pp="
                              f"{expert_grid})")
        return num_gpus // mp

    def expert_dp_size(self, num_gpus: int) -> int:
        """Data-parallel size of the experts: num_gpus / (ep * etp * pp)."""
        return num_gpus // (self.ep * self.etp * self.pp)

    def coordinates(self, rank: int, num_gpus: int) -> RankCoordinates:
        """Megatron's coordinates of global `rank` among `num_gpus` ranks: the dense grid numbers ranks
        tp + tp_size * (dp + dp_size * pp), the expert grid etp + etp_size * (ep + ep_size * (expert_dp +
        expert_dp_size * pp))."""
        dp, edp = self.dp_size(num_gpus), self.expert_dp_size(num_gpus)
        if not 0 <= rank < num_gpus:
            raise ValueError(f"rank {rank} is outside a trainer of {num_gpus} ranks")
        per_stage = num_gpus // self.pp
        within = rank % per_stage
        return RankCoordinates(rank=rank, tp=within % self.tp, dp=(within // self.tp) % dp, pp=rank // per_stage,
                               etp=within % self.etp, ep=(within // self.etp) % self.ep,
                               expert_dp=(within // (self.etp * self.ep)) % edp)

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """Global layer ids per pipeline rank: with interleaving, rank p holds virtual chunks p, p + pp, ...
        (Megatron's order, as `model.spec.stage_layers` reads it from a built TransformerConfig)."""
        chunks = self.pp * self.num_model_chunks
        size = num_layers // chunks
        return [[layer for v in range(self.num_model_chunks)
                 for layer in range((v * self.pp + p) * size, (v * self.pp + p + 1) * size)] for p in range(self.pp)]

    def check_model(self, c: "BeamConfig") -> None:
        """Raise `ConfigError` for the first rule Beam config `c` breaks (see the module docstring)."""
        has_moe = bool(c.moe_layers)
        has_dense = len(c.moe_layers) < c.num_hidden_layers
        heads = f"num_attention_heads={c.num_attention_heads}, num_key_value_heads={c.num_key_value_heads}"
        if c.num_attention_heads % self.tp or c.num_key_value_heads % self.tp:
            raise ConfigError("tp", self.tp, f"must divide both head counts ({heads}); Megatron shards query "
                              "groups over TP")
        if c.vocab_size % self.tp:
            raise ConfigError("tp", self.tp, f"must divide vocab_size={c.vocab_size} (the vocab-parallel embedding "
                              "and head)")
        if has_dense and c.intermediate_size % self.tp:
            raise ConfigError("tp", self.tp, f"must divide intermediate_size={c.intermediate_size}")
        if has_moe:
            if c.num_experts % self.ep:
                raise ConfigError("ep", self.ep, f"must divide num_experts={c.num_experts}")
            if c.moe_intermediate_size % self.etp:
                raise ConfigError("etp", self.etp, f"must divide moe_intermediate_size={c.moe_intermediate_size}")
            if self.tp > 1 and not self.sp:
                raise ConfigError("sp", False, "a MoE model with tp > 1 requires sp: true (Megatron refuses MoE + "
                                  "TP without sequence parallelism)")
        elif self.ep > 1:
            raise ConfigError("ep", self.ep, "the model has no MoE layers; ep must be 1")
        L = c.num_hidden_layers
        if L % self.pp:
            raise ConfigError("pp", self.pp, f"must divide num_hidden_layers={L}")
        if self.vpp is not None and (L // self.pp) % self.vpp:
            raise ConfigError("vpp", self.vpp, f"must divide the layers per pipeline stage num_hidden_layers / pp = "
                              f"{L} / {self.pp} = {L // self.pp}")


class OptimizerConfig(Section):
    """Adam and gradient clipping (Megatron `OptimizerConfig`), and where the main gradients live (DDP)."""

    lr: float = Field(gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="largest gradient norm; null: no clipping")
    optimizer: Literal["adam"] = "adam"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    distributed_optimizer: bool = True
    # Megatron OptimizerConfig.optimizer_cpu_offload / optimizer_offload_fraction (HybridDeviceOptimizer).
    optimizer_offload_fraction: float = Field(0.0, ge=0, le=1)
    # Megatron DDPConfig.grad_reduce_in_fp32: main grads accumulated and reduced in FP32 (or BF16).
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"

    @model_validator(mode="after")
    def _check_offload(self) -> "OptimizerConfig":
        if self.optimizer_offload_fraction > 0 and not self.distributed_optimizer:
            raise ConfigError("optimizer_offload_fraction", self.optimizer_offload_fraction,
                              "CPU offload of optimizer state needs distributed_optimizer: true")
        return self


class TrainerConfig(OptimizerConfig, ParallelConfig):
    """Megatron-core trainer parallelism and optimisation: the recipe's `trainer` section.

    `dp` is derived: num_gpus / (tp * pp). `micro_batch_size` and `global_batch_size` are in samples."""

    num_gpus: int = Field(gt=0)
    micro_batch_size: int = Field(1, gt=0)
    global_batch_size: int = Field(gt=0)
    recompute: Literal["none", "full"] = "none"
    use_fused_kernels: bool = False
    seed: int | None = Field(None, description="null = run.seed")
    # LoRA adapters (docs/lora.md): only they train, the base is frozen, and weight syncs send only them; the
    # engines take their targets, rank and scale from here. null = full-parameter training.
    lora: LoRAConfig | None = None
    # Colocated placement: the trainer releases its device memory (params, grads, optimizer state) while the engines
    # generate, and takes it back before training (beamrl.trainer.megatron.sleep; docs/colocated.md).
    sleep_during_rollout: bool | None = Field(None, description="null = on for colocated placement on cuda, "
                                              "off otherwise")

    @model_validator(mode="after")
    def _check_world(self) -> "TrainerConfig":
        dp = self.dp_size(self.num_gpus)
        step = self.micro_batch_size * dp
        if self.global_batch_size % step:
            raise ConfigError("global_batch_size", self.global_batch_size, f"must be a multiple of micro_batch_size "
                              f"* dp = {self.micro_batch_size} * {dp} = {step}")
        return self

    @property
    def dp(self) -> int:
        """Data-parallel size (num_gpus / (tp * pp))."""
        return self.num_gpus // (self.tp * self.pp)


def sleeps_during_rollout(setting: bool | None, placement_mode: str, device: str) -> bool:
    """`trainer.sleep_during_rollout` resolved: null means on for colocated placement on cuda, off otherwise."""
    if setting is not None:
        return bool(setting)
    return placement_mode == "colocated" and device == "cuda"
