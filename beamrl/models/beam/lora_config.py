"""`LoRAConfig`: which Beam weights get low-rank adapters, their rank and scale (docs/lora.md).

One typed config for every side: the Megatron trainer builds its adapters from it, the engines merge with its
scale, and the PEFT export writes it as `adapter_config.json`. Field names are the recipe's (the `lora:` section
maps 1:1 onto this dataclass).

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

import math
from dataclasses import dataclass, field

ATTENTION_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj",
                     "self_attn.o_proj")
DENSE_MLP_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERT_TARGETS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
ALL_TARGETS = ATTENTION_TARGETS + DENSE_MLP_TARGETS + EXPERT_TARGETS


class LoRAConfigError(ValueError):
    """A LoRA setting is invalid; the message names the field (`LoRAConfig.<field>`)."""


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters `W' = W0 + (alpha / rank) * B @ A` on the chosen targets (docs/lora.md).

    rank: r, the inner dimension of B [out, r] and A [r, in].
    alpha: the scale is `alpha / rank` (PEFT's default, non-rsLoRA scaling), rounded once to FP32.
    targets: HF module paths inside a decoder layer (see the module docstring); dense-MLP targets apply to
        dense layers only and expert targets to MoE layers only.
    share_expert_a: one A per (layer, expert projection) shared by all experts of the layer; B stays per expert.
    dropout: LoRA dropout; must be 0.0 (RL needs the trainer's forward to be the engine's forward).
    seed: seeds A's initialisation (kaiming-uniform as PEFT, per layer/target/expert, so every parallel layout
        starts from the same adapter); B starts at zero.
    """

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ATTENTION_TARGETS
    share_expert_a: bool = False
    dropout: float = 0.0
    seed: int = 0
    _scale: float = field(init=False, repr=False, compare=False, default=0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAConfigError(f"LoRAConfig.rank={self.rank!r} must be an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            raise LoRAConfigError(f"LoRAConfig.alpha={self.alpha!r} must be a positive finite number")
        if not self.targets:
            raise LoRAConfigError(f"LoRAConfig.targets is empty; choose from {list(ALL_TARGETS)}")
        for i, t in enumerate(self.targets):
            if t not in ALL_TARGETS:
                raise LoRAConfigError(f"LoRAConfig.targets[{i}]={t!r} is not a Beam LoRA target; allowed: "
                                      f"{list(ALL_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise LoRAConfigError(f"LoRAConfig.targets={list(self.targets)} lists a target twice")
        if self.dropout != 0.0:
            raise LoRAConfigError(f"LoRAConfig.dropout={self.dropout!r}: only 0.0 is supported (with dropout the "
                                  f"trainer's forward would differ from the engine's merged weights)")
        if self.share_expert_a and not self.expert_targets:
            raise LoRAConfigError("LoRAConfig.share_expert_a=True needs an expert target (mlp.experts.*) in "
                                  "LoRAConfig.targets")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise LoRAConfigError(f"LoRAConfig.seed={self.seed!r} must be an integer >= 0")
        object.__setattr__(self, "_scale", float(_fp32(self.alpha / self.rank)))

    @property
    def scale(self) -> float:
        """`fp32(alpha / rank)` as a Python float (exactly representable in FP32)."""
        return self._scale

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
        """The recipe form (also what travels in the adapter manifest)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "share_expert_a": self.share_expert_a, "dropout": self.dropout, "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict) -> "LoRAConfig":
        unknown = set(data) - {"rank", "alpha", "targets", "share_expert_a", "dropout", "seed"}
        if unknown:
            raise LoRAConfigError(f"LoRAConfig has no field {sorted(unknown)[0]!r}")
        return cls(**data)


def _fp32(x: float) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<f", x))[0]
