"""Beam layer and block specs (local, non-TE backend).

Dense-first layers only work through a block spec: a bare layer `ModuleSpec` given to `GPTModel` is fanned out
to every layer (megatron-integration §6), which would make every layer the same kind. `beam_block_spec` builds
one spec per global layer and slices this pipeline stage's (and virtual chunk's) layers with Megatron's own
`get_transformer_layer_offset` / `get_num_layers_to_build`.
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.trainer.megatron.model import lora as lora_modules
from beamrl.trainer.megatron.model.attention import BeamCoreAttention, BeamSelfAttention, BeamSelfAttentionSubmodules
from beamrl.trainer.megatron.model.layer import BeamTransformerLayer, BeamTransformerLayerSubmodules
from beamrl.trainer.megatron.model.mlp import BeamDenseMLP
from beamrl.trainer.megatron.model.moe import BeamMoELayer
from beamrl.trainer.megatron.model.norm import BeamRMSNorm


def beam_layer_spec(config: BeamConfig, layer: int, lora: Optional[LoRAConfig] = None, tp: int = 1) -> ModuleSpec:
    """Spec of global layer `layer` (0-based): dense MLP or MoE per `config.mlp_layer_types`; with `lora`, the
    targeted projections get LoRA modules (`model/lora.py`; `tp` sizes their fused layouts)."""
    linear_qkv, linear_proj = lora_modules.attention_linears(config, lora, layer, tp)
    attention = ModuleSpec(
        module=BeamSelfAttention,
        submodules=BeamSelfAttentionSubmodules(linear_qkv=linear_qkv, core_attention=BeamCoreAttention,
                                               linear_proj=linear_proj, q_layernorm=BeamRMSNorm,
                                               k_layernorm=BeamRMSNorm))
    if config.is_moe(layer):
        mlp = BeamMoELayer
        if lora is not None and lora.expert_targets:
            mlp = functools.partial(BeamMoELayer, **lora_modules.moe_experts(lora, layer))
    else:
        mlp = BeamDenseMLP
        if lora is not None and lora.dense_mlp_targets:
            mlp = functools.partial(BeamDenseMLP, **lora_modules.dense_mlp_linears(config, lora, layer, tp))
    return ModuleSpec(
        module=BeamTransformerLayer,
        submodules=BeamTransformerLayerSubmodules(
            input_layernorm=BeamRMSNorm, self_attention=attention, pre_mlp_layernorm=BeamRMSNorm,
            mlp=mlp, post_self_attn_layernorm=BeamRMSNorm, post_mlp_layernorm=BeamRMSNorm))


def beam_block_spec(transformer_config, vp_stage: Optional[int] = None,
                    pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Block spec with this stage's/chunk's layers and Beam's final norm."""
    beam = transformer_config.beam
    lora, tp = getattr(transformer_config, "lora", None), transformer_config.tensor_model_parallel_size
    specs = [beam_layer_spec(beam, i, lora, tp) for i in range(beam.num_hidden_layers)]
    n = get_num_layers_to_build(transformer_config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + n], layer_norm=BeamRMSNorm)


def stage_layers(transformer_config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> range:
    """Global 0-based ids of the layers built on a pipeline stage / virtual chunk."""
    n = get_num_layers_to_build(transformer_config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + n)
