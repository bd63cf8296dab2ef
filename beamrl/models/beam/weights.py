"""The HF weight table of SGLang's Beam: every tensor name, shape and dtype (beam-numerics.md §2).

This is the single source of truth for checkpoint writing, loading, validation, the Megatron mapping and
weight sync. The canonical expert layout is per-expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
`checkpoint.py` also reads the packed layout (`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from beamrl.models.beam.config import BeamConfig


@dataclass(frozen=True)
class TensorSpec:
    """Shape and stored dtype of one HF tensor. `fp32` tensors stay FP32 whatever the model dtype."""

    shape: tuple[int, ...]
    fp32: bool = False

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.fp32 else model_dtype


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expected_tensors(config: BeamConfig) -> dict[str, TensorSpec]:
    """Ordered map of every HF tensor a complete Beam checkpoint holds (per-expert layout)."""
    c = config
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((c.vocab_size, H))}
    for i in range(c.num_hidden_layers):
        p = layer_prefix(i)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[p + norm + ".weight"] = TensorSpec((H,))
        a = p + "self_attn."
        out[a + "q_proj.weight"] = TensorSpec((q, H))
        out[a + "k_proj.weight"] = TensorSpec((kv, H))
        out[a + "v_proj.weight"] = TensorSpec((kv, H))
        out[a + "gate_proj.weight"] = TensorSpec((q, H))
        out[a + "o_proj.weight"] = TensorSpec((H, q))
        out[a + "q_norm.weight"] = TensorSpec((c.head_dim,))
        out[a + "k_norm.weight"] = TensorSpec((c.head_dim,))
        out[a + "gate_bias"] = TensorSpec((c.num_attention_heads,))
        m = p + "mlp."
        if c.is_moe(i):
            out[m + "gate.weight"] = TensorSpec((c.num_experts, H), fp32=True)
            out[m + "gate.e_score_correction_bias"] = TensorSpec((c.num_experts,), fp32=True)
            I = c.moe_intermediate_size
            for e in range(c.num_experts):
                ep = f"{m}experts.{e}."
                out[ep + "gate_proj.weight"] = TensorSpec((I, H))
                out[ep + "up_proj.weight"] = TensorSpec((I, H))
                out[ep + "down_proj.weight"] = TensorSpec((H, I))
        else:
            out[m + "gate_proj.weight"] = TensorSpec((c.intermediate_size, H))
            out[m + "up_proj.weight"] = TensorSpec((c.intermediate_size, H))
            out[m + "down_proj.weight"] = TensorSpec((H, c.intermediate_size))
    out["model.norm.weight"] = TensorSpec((H,))
    out["lm_head.weight"] = TensorSpec((c.vocab_size, H))
    return out


def packed_expert_names(layer: int) -> tuple[str, str]:
    """Names of the packed expert layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    m = layer_prefix(layer) + "mlp.experts."
    return m + "gate_up_proj", m + "down_proj"


def random_state_dict(config: BeamConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A reproducible random Beam state dict in HF names (the source of `beamrl init-checkpoint`).

    Projections ~ N(0, 1/fan_in) so activations and logits are O(1) (parity tests then see real
    distributions); embeddings ~ N(0, 1); norms ~ 1 + N(0, 0.1) (stored as-is: the norm uses w, not 1+w);
    gate bias ~ N(0, 0.5); router ~ N(0, 4/H) in FP32 and correction bias ~ N(0, 0.01^2) in FP32, so that
    routing depends on the input and on the bias. Generated in FP32 on CPU, then cast.
    """
    return dict(random_tensors(config, seed, dtype))


def random_tensors(config: BeamConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `random_state_dict`, generated one at a time in table order (streams a huge checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    for name, spec in expected_tensors(config).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(spec.shape, generator=g)
        elif name.endswith("gate_bias"):
            t = 0.5 * torch.randn(spec.shape, generator=g)
        elif name.endswith("mlp.gate.weight"):
            t = torch.randn(spec.shape, generator=g) * (2.0 / config.hidden_size ** 0.5)
        elif name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(spec.shape, generator=g)
        elif name in ("model.embed_tokens.weight",):
            t = torch.randn(spec.shape, generator=g)
        else:
            t = torch.randn(spec.shape, generator=g) / spec.shape[-1] ** 0.5
        yield name, t.to(spec.dtype(dtype)).contiguous()
