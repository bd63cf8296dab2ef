"""Beam in Megatron-core 0.19.2 at spec level (docs/trainer.md "Model").

Public API (used by the training worker and weight sync):
- `build_beam_gpt_model(config, *, params_dtype, pre_process, post_process, vp_stage, use_fused_kernels,
  recompute, parallel, transformer_config)` -> `BeamGPTModel` (provider.py)
- `beam_transformer_config(config, parallel, dtype=..., use_fused_kernels=..., recompute=...)`,
  `BeamTransformerConfig` (config_bridge.py); the layout is the trainer's `config.ParallelConfig`
- `packed_seq_params(cu_seqlens, routes=None, record=False)` -> `BeamPackedSeqParams` (batch.py): the per-
  microbatch THD bounds + routing replay/record, passed as `model(..., packed_seq_params=...)`
- `beam_layer_spec`, `beam_block_spec`, `stage_layers` (spec.py)
"""

from beamrl.trainer.megatron.model.batch import BeamPackedSeqParams, packed_seq_params, positions_from_cu_seqlens
from beamrl.trainer.megatron.model.config_bridge import BeamTransformerConfig, beam_transformer_config
from beamrl.trainer.megatron.model.provider import BeamGPTModel, build_beam_gpt_model, current_parallel_settings
from beamrl.trainer.megatron.model.spec import beam_block_spec, beam_layer_spec, stage_layers

__all__ = [
    "BeamGPTModel", "BeamPackedSeqParams", "BeamTransformerConfig",
    "beam_block_spec", "beam_layer_spec", "beam_transformer_config", "build_beam_gpt_model",
    "current_parallel_settings", "packed_seq_params", "positions_from_cu_seqlens", "stage_layers",
]
