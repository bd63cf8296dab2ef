"""Beam's dense SwiGLU MLP (layers with mlp_layer_types == 'dense')."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from beamrl.models.beam import numerics
from beamrl.trainer.megatron.model import sharding


class BeamDenseMLP(MegatronModule):
    """`down(bf16(silu(fp32 gate) * fp32 up))` with the GPU path's single rounding (beam-numerics §3.9).

    `linear_fc1` is column-parallel with each TP rank's rows laid out `[gate_r; up_r]` (its shard of gate_proj,
    then its shard of up_proj); `linear_fc2` is row-parallel (down_proj). Builder signature of Megatron's
    `MlpBuilder`: `(config=, pg_collection=, is_mtp_layer=, name=)`."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, name=None,
                 linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, **_unused):
        """linear_fc1 / linear_fc2: the linear classes (the spec passes LoRA ones for adapted projections)."""
        super().__init__(config=config)
        beam = config.beam
        tp_group = pg_collection.tp if pg_collection is not None else None
        self.linear_fc1 = linear_fc1(
            beam.hidden_size, 2 * beam.intermediate_size, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc1",
            tp_group=tp_group)
        self.linear_fc2 = linear_fc2(
            beam.intermediate_size, beam.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's default, with `linear_fc1.weight` stored as the TP-independent `[gate; up]` (a GLU factory)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}linear_fc1.weight"
        sd[key] = sharding.glu_fc1(sd[key], sharded_offsets, metadata)
        return sd

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, **_unused) -> torch.Tensor:
        gate_up, _ = self.linear_fc1(hidden_states)
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        out, _ = self.linear_fc2(numerics.swiglu(gate, up))
        return out
