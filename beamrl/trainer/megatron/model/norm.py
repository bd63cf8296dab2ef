"""Beam's RMSNorm as a Megatron norm module (every norm slot: input, post-attn, pre-MLP, post-MLP, q/k, final)."""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from beamrl.models.beam import numerics


class BeamRMSNorm(MegatronModule):
    """`numerics.rms_norm`: FP32 statistics, weight used as stored, one rounding (beam-numerics §3.2).

    Matches Megatron's norm-builder signature `(config=, hidden_size=, eps=)`. The weight is flagged
    `sequence_parallel` under SP so `finalize_model_grads` all-reduces its grad over TP (each TP rank saw only
    its tokens). Q/K norms are summed over TP by Megatron's name rule (`q_layernorm`/`k_layernorm` with
    `config.qk_layernorm=True`), since each TP rank sees only its heads."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.rms_norm(x, self.weight, self.eps)
