"""Eager packed (THD) attention: the sequences of a packed batch batched by length.

`numerics.attention` per sequence is the reference; calling it once per sequence costs a Python loop of
about ten ops (and as many autograd nodes) per sequence and layer, which dominated a CPU train step of many
short sequences. Sequences of equal length share one call with a leading batch dimension instead: the same
per-sequence GEMM shapes and row softmaxes, so the result equals the per-sequence loop (the tests check it
bit for bit, forward and backward). The plan (token indices of each length group, masks, the inverse
permutation) depends only on the sequence bounds, so every layer of a forward reuses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from beamrl.models.beam import numerics


@dataclass(frozen=True)
class _Group:
    length: int
    num_sequences: int
    index: Optional[torch.Tensor]  # [n, L] token indices (None: the whole batch is this one group, in order)
    mask: torch.Tensor  # [L, L] bool visibility

    @property
    def flat_index(self) -> torch.Tensor:
        """`index` flattened to [n * L] (a view)."""
        return self.index.view(-1)


@dataclass(frozen=True)
class AttentionPlan:
    """How `packed_attention` batches one packed layout (see the module docstring)."""

    groups: tuple[_Group, ...]
    inverse: Optional[torch.Tensor]  # grouped order -> packed order (None with a single group)


def length_groups(bounds: list[int] | tuple[int, ...]) -> dict[int, list[int]]:
    """{sequence length: start offsets of the sequences of that length} from cu_seqlens as a list, in order of
    first appearance."""
    groups: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        groups.setdefault(end - start, []).append(start)
    return groups


@functools.lru_cache(maxsize=8)  # a step's few packed layouts; every layer asks for the same one
def attention_plan(bounds: tuple[int, ...], window: Optional[int], device: torch.device) -> AttentionPlan:
    """The batching plan of one packed layout (`bounds` = cu_seqlens as a tuple)."""
    by_length = length_groups(bounds)
    if len(by_length) == 1:  # one length: the packed stream already is [n, L, ...]
        (length, starts), = by_length.items()
        return AttentionPlan((_Group(length, len(starts), None, _mask(length, window, device)),), None)
    groups, index = [], []
    for length, starts in by_length.items():
        idx = (torch.tensor(starts, device=device).unsqueeze(1)
               + torch.arange(length, device=device).unsqueeze(0))  # [n, L] token indices
        groups.append(_Group(length, len(starts), idx, _mask(length, window, device)))
        index.append(idx.flatten())
    order = torch.cat(index)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
    return AttentionPlan(tuple(groups), inverse)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int] | tuple[int, ...],
                     window: Optional[int]) -> torch.Tensor:
    """`numerics.attention` of every packed sequence (q [T, Hq, D], k/v [T, Hkv, D], `bounds` = cu_seqlens as a
    list); one call per distinct sequence length. Returns [T, Hq, D] in q's dtype."""
    plan = attention_plan(tuple(bounds), window, q.device)
    if plan.inverse is None:
        g = plan.groups[0]
        out = numerics.attention(q.view(g.num_sequences, g.length, *q.shape[1:]),
                                 k.view(g.num_sequences, g.length, *k.shape[1:]),
                                 v.view(g.num_sequences, g.length, *v.shape[1:]), g.mask)
        return out.view(q.shape)
    # index_select rather than q[index]: the same rows, several times faster on CPU, and its backward (index_add_
    # into zeros) gives the same gradient (every token is in exactly one group: one add to a zero per element).
    outs = [numerics.attention(*(t.index_select(0, g.flat_index).view(g.num_sequences, g.length, *t.shape[1:])
                                 for t in (q, k, v)), g.mask).flatten(0, 1) for g in plan.groups]
    return torch.cat(outs).index_select(0, plan.inverse)


def _mask(length: int, window: Optional[int], device) -> torch.Tensor:
    pos = torch.arange(length, device=device)
    return numerics.sliding_window_mask(pos, pos, window)
