"""`LoRAConfig`: which Beam weights get low-rank adapters, their rank and scale (docs/lora.md).

One typed config for every side: the Megatron trainer builds its adapters from it, the engines merge with its
scale, and the PEFT export writes it as `adapter_config.json`. Field names are the recipe's (the `lora:` section
`trainer.lora` section is this class).

Targets are HF module paths inside a decoder layer, so they cannot be ambiguous (Beam has a `gate_proj` in the
attention *and* in the MLP):

| target                  | HF weight (layer i)                              | Megatron module              |
|-------------------------|--------------------------------------------------|------------------------------|
| `self_attn.q_proj`      | `model.layers.i.self_attn.q_proj.weight`         | rows of `linear_qkv`         |
| `self_attn.k_proj`      | `... .self_attn.k_proj.weight`                   | rows of `linear_qkv`         |
| `self_attn.v_proj`      | `... .self_attn.v_proj.weight`                   | rows of `linear_qkv`         |
| `self_attn.gate_proj`   | `... .self_attn.gate_proj.weight` (output gate)  | rows of `linear_qkv`         |
| `self_attn.o_proj`      | `... .self_attn.o_proj.weight`                   | `linear_proj`                |
| `mlp.gate_proj`         | `... .mlp.gate_proj.weight` (dense layers)       | rows of `linear_fc1`         |
| `mlp.up_proj`           | `... .mlp.up_proj.weight` (dense layers)         | rows of `linear_fc1`         |
| `mlp.down_proj`         | `... .mlp.down_proj.weight` (dense layers)       | `linear_fc2`                 |
| `mlp.experts.gate_proj` | `... .mlp.experts.{e}.gate_proj.weight`          | rows of `experts.gate_up_weight[e]` |
| `mlp.experts.up_proj`   | `... .mlp.experts.{e}.up_proj.weight`            | rows of `experts.gate_up_weight[e]` |
| `mlp.experts.down_proj` | `... .mlp.experts.{e}.down_proj.weight`          | `experts.down_weight[e]`     |
"""

from __future__ import annotations

import struct
from typing import Any

from pydantic import Field, model_validator

from beamrl.config import ConfigError, Section

ATTENTION_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj",
                     "self_attn.o_proj")
DENSE_MLP_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERT_TARGETS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
ALL_TARGETS = ATTENTION_TARGETS + DENSE_MLP_TARGETS + EXPERT_TARGETS
FIELDS = ("rank", "alpha", "targets", "share_expert_a", "dropout", "seed")


class LoRAConfigError(ConfigError):
    """A LoRA setting is invalid; `path` is the field inside `LoRAConfig` (the recipe prefixes `trainer.lora.`)."""


class LoRAConfig(Section):
    """Low-rank adapters `W' = W0 + (alpha / rank) * B @ A` on the chosen targets (docs/lora.md): the recipe's
    `trainer.lora` section, read under these names by the trainer, the engines and the PEFT export.

    rank: r, the inner dimension of B [out, r] and A [r, in].
    alpha: the scale is `alpha / rank` (PEFT's default, non-rsLoRA scaling), rounded once to FP32.
    targets: HF module paths inside a decoder layer (see the module docstring); dense-MLP targets apply to
        dense layers only and expert targets to MoE layers only.
    share_expert_a: one A per (layer, expert projection) shared by all experts of the layer; B stays per expert.
    dropout: LoRA dropout; must be 0.0 (RL needs the trainer's forward to be the engine's forward).
    seed: seeds A's initialisation (kaiming-uniform as PEFT, per layer/target/expert, so every parallel layout
        starts from the same adapter); B starts at zero.
    """

    model_config = {**Section.model_config, "frozen": True}

    rank: int = Field(16, description="LoRA rank r")
    alpha: float = Field(32.0, description="scale = fp32(alpha / rank)")
    targets: tuple[str, ...] = ATTENTION_TARGETS
    share_expert_a: bool = False
    dropout: float = 0.0
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "LoRAConfig":
        if self.rank < 1:
            raise LoRAConfigError("rank", self.rank, "must be an integer >= 1")
        if not self.alpha > 0:  # (inf and nan: refused by every Section)
            raise LoRAConfigError("alpha", self.alpha, "must be > 0")
        if not self.targets:
            raise LoRAConfigError("targets", [], f"is empty; choose from {list(ALL_TARGETS)}")
        for i, t in enumerate(self.targets):
            if t not in ALL_TARGETS:
                raise LoRAConfigError(f"targets[{i}]", t, f"is not a Beam LoRA target; allowed: {list(ALL_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise LoRAConfigError("targets", list(self.targets), "lists a target twice")
        if self.dropout != 0.0:
            raise LoRAConfigError("dropout", self.dropout, "only 0.0 is supported (with dropout the trainer's "
                                  "forward would differ from the engine's merged weights)")
        if self.share_expert_a and not self.expert_targets:
            raise LoRAConfigError("share_expert_a", True, "needs an expert target (mlp.experts.*) in targets")
        if self.seed < 0:
            raise LoRAConfigError("seed", self.seed, "must be an integer >= 0")
        return self

    @property
    def scale(self) -> float:
        """`fp32(alpha / rank)` as a Python float (exactly representable in FP32)."""
        return struct.unpack("<f", struct.pack("<f", self.alpha / self.rank))[0]

    @property
    def attention_targets(self) -> tuple[str, ...]:
        return tuple(t for t in ATTENTION_TARGETS if t in self.targets)

    @property
    def dense_mlp_targets(self) -> tuple[str, ...]:
        return tuple(t for t in DENSE_MLP_TARGETS if t in self.targets)

    @property
    def expert_targets(self) -> tuple[str, ...]:
        return tuple(t for t in EXPERT_TARGETS if t in self.targets)

    def to_dict(self) -> dict:
        """The recipe form (also what the PEFT export's `beamrl_lora.json` and the SGLang launch carry)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "targets": list(self.targets),
                "share_expert_a": self.share_expert_a, "dropout": float(self.dropout), "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoRAConfig":
        """Build from the recipe form; `pydantic.ValidationError` (a `ValueError`) names a bad or unknown field."""
        return cls(**data)
