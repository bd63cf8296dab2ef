"""Lay a `PackedBatch` (beamrl.trainer.protocol) out as one Megatron THD micro-batch.

Beam's Megatron modules run packed sequences directly (`qkv_format="thd"`, micro-batch dim 1, sequence bounds
from `cu_seqlens`, positions restarting at 0 in every sequence). The trainer only has to give every
micro-batch of a step the same length (pipeline p2p buffers have one shape; sequence parallelism needs a
multiple of TP): `to_thd` appends one padding sequence of token 0 (its own cu_seqlens span, so it attends only
to itself and never changes a real token) and pads replay routes with -1 (route freely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beamrl.trainer.protocol import BatchError, PackedBatch

__all__ = ["BatchError", "PackedBatch", "ThdMicroBatch", "common_length", "to_thd"]


@dataclass
class ThdMicroBatch:
    """A packed batch padded to `length` tokens: what one forward step feeds the model."""

    source: PackedBatch
    tokens: torch.Tensor  # [1, length] int64
    cu_seqlens: torch.Tensor  # [B(+1)] int32, the padding span included
    routes: torch.Tensor | None  # [length, L, k] int64, padding rows -1

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return self.source.num_tokens

    def next_token_targets(self) -> torch.Tensor:
        """[1, length]: position t predicts token t+1 (meaningless at sequence ends; masked later)."""
        targets = torch.zeros_like(self.tokens)
        targets[:, :-1] = self.tokens[:, 1:]
        return targets

    def to_tokens(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, length] values of 'position t predicts t+1' -> packed per-token `[T]` values ("token t was
        predicted at t-1"); 0 at the first token of every sequence. Differentiable."""
        shifted = torch.nn.functional.pad(per_position[0, : self.num_tokens - 1], (1, 0))
        starts = torch.zeros(self.num_tokens, dtype=torch.bool, device=shifted.device)
        starts[self.source.cu_seqlens[:-1].to(shifted.device)] = True
        return torch.where(starts, torch.zeros_like(shifted), shifted)


def common_length(batches: list[PackedBatch], multiple: int = 1) -> int:
    """The smallest length >= every batch's token count that is a multiple of `multiple`."""
    if not batches:
        raise BatchError("no micro-batches given")
    longest = max(b.num_tokens for b in batches)
    return -(-longest // multiple) * multiple


def to_thd(batch: PackedBatch, length: int, num_layers: int | None = None) -> ThdMicroBatch:
    """Pad `batch` to `length` tokens (one extra padding sequence when needed). `num_layers` checks the route
    tensor's layer dimension (the model's `num_hidden_layers`)."""
    T = batch.num_tokens
    if T > length:
        raise BatchError(f"batch of {T} tokens does not fit length {length}")
    pad = length - T
    tokens = torch.nn.functional.pad(batch.tokens, (0, pad)).view(1, length)
    cu = batch.cu_seqlens
    if pad:
        cu = torch.cat([cu, torch.tensor([length], dtype=cu.dtype)])
    routes = batch.routes
    if routes is not None:
        routes = routes.to(torch.int64)  # PackedBatch keeps the engines' int32
        if num_layers is not None and routes.shape[1] != num_layers:
            raise BatchError(f"PackedBatch.routes has {routes.shape[1]} layer columns; the model has "
                             f"num_hidden_layers={num_layers} (one column per layer, dense columns ignored)")
        if pad:
            routes = torch.cat([routes, routes.new_full((pad,) + tuple(routes.shape[1:]), -1)])
    return ThdMicroBatch(batch, tokens, cu.to(torch.int32), routes)
