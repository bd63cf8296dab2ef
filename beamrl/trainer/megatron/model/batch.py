"""Per-microbatch metadata of a Beam forward: packed sequence bounds and routing replay (R3).

`BeamPackedSeqParams` extends Megatron's `PackedSeqParams` so it travels the standard path
(`GPTModel.forward(packed_seq_params=...)` -> `TransformerBlock` -> every layer, including the closures of
activation recompute and every pipeline stage). Carrying the replay routes and the record buffer *in the batch*
(rather than in a global cursor) makes replay exact under full recompute and under 1F1B interleaving: the
re-forward of microbatch i sees microbatch i's routes whatever ran in between.

Token order (THD): one packed row of T tokens, `[T, 1, H]` in Megatron's `[s, b, h]`; sequences are contiguous
and `cu_seqlens[i]:cu_seqlens[i+1]` is sequence i. Positions restart at 0 in every sequence (RoPE and SSMax).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class BeamPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` (qkv_format='thd') plus Beam's routing replay.

    routes: int64 [T, num_hidden_layers, top_k] in packed token order (the whole microbatch, every TP rank
        holds the full tensor; each MoE layer slices its own SP tokens and its own layer column). Rows or
        layers with -1 route freely (natural grouped top-k); dense-layer columns are ignored.
    record: when True, each MoE router stores its chosen ids in `recorded[global_layer]` as [T_local, k]
        (local = this rank's SP slice). `replay.RoutingRecorder` assembles them into [T, L, k].
    """

    routes: Optional[torch.Tensor] = None
    record: bool = False
    recorded: dict = field(default_factory=dict)
    #: Per-micro-batch RoPE / SSMax tables, computed by the first attention layer and reused by the others.
    position_terms: dict = field(default_factory=dict)


def packed_seq_params(cu_seqlens: torch.Tensor, routes: Optional[torch.Tensor] = None,
                      record: bool = False) -> BeamPackedSeqParams:
    """Build the per-microbatch params for a packed batch. cu_seqlens: int [B+1], 0 ... T."""
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return BeamPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                               max_seqlen_kv=max_len, routes=routes, record=record)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """0-based position of every packed token within its own sequence: int64 [T]."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(total, dtype=torch.int64, device=cu.device) - starts
