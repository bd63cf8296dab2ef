"""The Beam model provider: `build_beam_gpt_model` (what the training worker passes to Megatron).

Usage (Megatron parallel state initialised first, with `expert_tensor_parallel_size=1` — Megatron's default is
etp = tp, which Beam's exact expert rounding does not support; on CPU `beamrl.compat.megatron_cpu.activate()` before)::

    model = build_beam_gpt_model(beam_config, params_dtype=torch.bfloat16, pre_process=True, post_process=True)
    logits = model(input_ids, position_ids=None, attention_mask=None,
                   packed_seq_params=packed_seq_params(cu_seqlens, routes=...))   # [b, s, V/tp] FP32

Inputs: `input_ids` [b, s] (THD: b = 1, the packed tokens; give `packed_seq_params` from
`beamrl.trainer.megatron.model.batch.packed_seq_params`). `position_ids` is ignored (Beam positions restart per
sequence and come from cu_seqlens). Output on the last stage: FP32 softcapped logits, vocab-parallel
(`[b, s, V/tp]`, or the loss when `labels` are given); use `output_processor=` for logprobs without
materialising the gathered vocab.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from beamrl.models.beam import numerics
from beamrl.models.beam.config import BeamConfig
from beamrl.trainer.megatron.config import ParallelConfig
from beamrl.trainer.megatron.model.config_bridge import BeamTransformerConfig, beam_transformer_config
from beamrl.trainer.megatron.model.lora import freeze_base
from beamrl.trainer.megatron.model.spec import beam_block_spec


class BeamGPTModel(GPTModel):
    """`GPTModel` with Beam's block spec and the FP32 final-logit softcap (beam-numerics §3.11).

    The softcap replaces `_scale_logits` (MuP scaling, unused by Beam), so it also applies inside
    `output_processor` hooks, which receive `scale_logits=self._scale_logits`."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, *args, **kwargs):
        tp = self.config.tensor_model_parallel_size
        if self.config.sequence_parallel and input_ids is not None and input_ids.shape[-1] % tp:
            raise ValueError(f"sequence parallelism needs the sequence length ({input_ids.shape[-1]}) to be a "
                             f"multiple of tp={tp}; pad the packed batch")
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def _scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return numerics.softcap(logits, self.config.beam.final_logit_softcapping)


def current_parallel_settings() -> ParallelConfig:
    """The layout of the initialised Megatron parallel state."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return ParallelConfig(tp=tp, sp=tp > 1, ep=parallel_state.get_expert_model_parallel_world_size(),
                          etp=parallel_state.get_expert_tensor_parallel_world_size(),
                          pp=parallel_state.get_pipeline_model_parallel_world_size(),
                          vpp=vpp if vpp and vpp > 1 else None)


def build_beam_gpt_model(config: BeamConfig, *, params_dtype: torch.dtype = torch.bfloat16, pre_process: bool = True,
                         post_process: bool = True, vp_stage: Optional[int] = None, use_fused_kernels: bool = False,
                         recompute: Literal["none", "full"] = "none", parallel: Optional[ParallelConfig] = None,
                         transformer_config: Optional[BeamTransformerConfig] = None) -> BeamGPTModel:
    """Build this rank's Beam model chunk (pipeline stage `pre_process`/`post_process`, virtual chunk `vp_stage`).

    parallel: defaults to the initialised Megatron parallel state (`current_parallel_settings`, SP on when
    tp > 1). transformer_config: pass one from `beam_transformer_config` to control every Megatron field
    (then params_dtype / use_fused_kernels / recompute / parallel are taken from it). Call
    `beamrl.trainer.megatron.replay.reset_routing_state()` is not needed: replay state lives in the batch."""
    if transformer_config is None:
        transformer_config = beam_transformer_config(
            config, parallel or current_parallel_settings(), dtype=params_dtype,
            use_fused_kernels=use_fused_kernels, recompute=recompute)
    if transformer_config.beam is None:
        raise ValueError("transformer_config.beam is None: build it with beam_transformer_config(config, ...)")
    model = BeamGPTModel(
        config=transformer_config,
        transformer_layer_spec=beam_block_spec(transformer_config, vp_stage=vp_stage),
        vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=False, position_embedding_type="none", vp_stage=vp_stage)
    if transformer_config.lora is not None:
        freeze_base(model)  # before DDP and the optimizer see the parameters: only adapters train
    return model
