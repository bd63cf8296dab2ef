"""Distributed-checkpoint metadata of Beam's own parameters (`sharded_state_dict` helpers).

Megatron's default `MegatronModule.sharded_state_dict` marks every parameter of a module without its own method
as *replicated* over TP and DP (global shape = local shape). That is right for norms, the FP32 router weight and
the router's `expert_bias` buffer, and wrong for three Beam tensors, which these helpers describe instead:

- `self_attention.gate_bias` [heads/tp]: split over TP along dim 0 (each rank keeps its heads' biases);
- the dense MLP's `linear_fc1.weight`, laid out `[gate_r; up_r]` per TP rank: a GLU factory stores gate and up
  as two halves of one global tensor, so the global layout does not depend on TP (Megatron's own MLP does the same);
- `mlp.experts.gate_up_weight` / `down_weight` [E_local, ...]: split over EP along dim 0 (global expert id) and
  replicated over the expert-data-parallel group.

LoRA adapter factors (`model/lora.py`) are described by their modules with the same helpers: a factor split over
TP (B of a column-parallel base, A of a row-parallel one) along its split dim, expert factors over EP.

With correct global offsets and replica ids, a checkpoint written at one TP/EP/PP/DP layout loads at another.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint


def tp_sharded(param: torch.Tensor, key: str, axis: int, sharded_offsets: tuple, metadata: dict | None):
    """`param` split over the TP group along `axis`, replicated over DP."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_tp_sharded_tensor_for_checkpoint(
        param, key, axis, prepend_offsets=sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


def glu_fc1(sharded: ShardedTensor, sharded_offsets: tuple, metadata: dict | None):
    """A TP-sharded `[gate_r; up_r]` fc1 weight as a factory over the TP-independent `[gate; up]` tensor."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return apply_swiglu_sharded_factory(sharded, sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                        dp_group=metadata["dp_cp_group"])


def ep_sharded(param: torch.Tensor, key: str, sharded_offsets: tuple, ep_rank: int, ep_size: int,
               axis: int = 0) -> ShardedTensor:
    """`param` [E_local, ...] holding experts `ep_rank * E_local ...`: split over EP along dim 0 (`axis`: another
    dim, e.g. the columns of a LoRA A shared by the experts), one main replica per expert-data-parallel group
    (Beam supports etp = 1 only, so experts are never split over TP)."""
    n = len(sharded_offsets)
    return ShardedTensor.from_rank_offsets(
        key, param, *sharded_offsets, (n + axis, ep_rank, ep_size),
        replica_id=(0, 0, parallel_state.get_expert_data_parallel_rank()), prepend_axis_num=n)
