"""BeamConfig -> Megatron `TransformerConfig` (the config bridge).

`beam_transformer_config` fills every Megatron field that describes Beam (sizes, GQA, SWA window and the
per-layer SWA/NoPE lists, Q/K norm, output gate, MoE routing hyper-parameters, parallel sizes) so Megatron's own
machinery (layer offsets, DDP/optimizer, finalize_model_grads, schedules) sees the right model. Beam's own
modules (this package) additionally read the full `BeamConfig` from `BeamTransformerConfig.beam`.

Choices that matter:
- `moe_router_enable_expert_bias=False`: the correction bias lives in `BeamRouter.expert_bias` as a frozen FP32
  buffer, so `finalize_model_grads` never updates it (RL must keep the engine's bias; it is synced like a weight).
- `moe_router_load_balancing_type="none"`, no aux loss.
- `position_embedding_type="none"`: Beam's attention applies its own FP32 RoPE / SSMax from in-sequence positions.
- `gradient_accumulation_fusion`, `apply_rope_fusion`, `masked_softmax_fusion`, `bias_*_fusion` off (CPU-safe and
  unused by Beam modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from megatron.core.transformer import TransformerConfig

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.trainer.megatron.config import ParallelConfig


@dataclass
class BeamTransformerConfig(TransformerConfig):
    """`TransformerConfig` plus what Beam's modules need beyond it.

    beam: the HF `BeamConfig` (layer types, window, residual scales, routing, softcap).
    use_fused_kernels: modules call `beamrl.kernels.ops` with the fused backends ("triton" / "flex") instead of
        "eager". CPU must use False.
    lora: LoRA adapters on the targeted projections (`beamrl.trainer.megatron.model.lora`); None = full training.
    """

    beam: Optional[BeamConfig] = None
    use_fused_kernels: bool = False
    lora: Optional[LoRAConfig] = None

    @property
    def kernel_backend(self) -> str:
        return "triton" if self.use_fused_kernels else "eager"

    @property
    def attention_backend_name(self) -> str:
        return "flex" if self.use_fused_kernels else "eager"


def beam_transformer_config(config: BeamConfig, parallel: ParallelConfig = ParallelConfig(), *,
                            dtype: torch.dtype = torch.bfloat16, use_fused_kernels: bool = False,
                            recompute: Literal["none", "full"] = "none", **overrides) -> BeamTransformerConfig:
    """The Megatron config of Beam for one parallel layout and dtype (float32 for exact CPU tests, bfloat16
    for training). `overrides` are passed to `TransformerConfig` last (e.g. `pipeline_dtype`)."""
    parallel.check_model(config)  # the layout rules (trainer/megatron/config.py); ConfigError names the field
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
    c = config
    L = c.num_hidden_layers
    moe = bool(c.moe_layers)
    kwargs = dict(
        num_layers=L, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True, attention_output_gate=True,
        # SWA: key j visible iff i - (w-1) <= j <= i; list form so the last layer can be full.
        window_size=(c.sliding_window - 1, 0) if c.sliding_window else None,
        window_attn_skip_freq=[1 if c.is_sliding(i) else 0 for i in range(L)] if c.sliding_window else None,
        no_rope_freq=[0 if c.is_sliding(i) else 1 for i in range(L)],
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp, sequence_parallel=parallel.sp and parallel.tp > 1,
        pipeline_model_parallel_size=parallel.pp, virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        beam=c, use_fused_kernels=use_fused_kernels,
    )
    if moe:
        kwargs.update(
            num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_layer_freq=[1 if c.is_moe(i) else 0 for i in range(L)], moe_router_topk=c.num_experts_per_tok,
            moe_router_score_function="sigmoid", moe_router_num_groups=c.n_group,
            moe_router_group_topk=c.topk_group, moe_router_topk_scaling_factor=c.routed_scaling_factor,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
            moe_router_enable_expert_bias=False, moe_token_dispatcher_type="alltoall",
        )
    if recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return BeamTransformerConfig(**kwargs)
