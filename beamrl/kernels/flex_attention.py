"""Packed (THD) causal sliding-window GQA attention through PyTorch FlexAttention (beam-numerics §3.6).

The block mask encodes document masking from cu_seqlens (a query sees keys of its own sequence only),
causality, and the window: key j is visible to query i iff i - (window-1) <= j <= i. Block masks are cached
per (cu_seqlens, window, device), since every layer of a micro-batch shares them. On CUDA `flex_attention` is
compiled once (uncompiled FlexAttention materialises the full score matrix); on CPU it runs eagerly (tests).
Forward and backward are FlexAttention's own kernels: FP32 softmax statistics and accumulation, output
rounded to the input dtype; tiling differs from the eager reference, so it matches to within BF16 tolerance
only (beam-numerics §6).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

_MASK_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_MASK_CACHE_SIZE = 8
_COMPILED = {}


def _flex_fn(device: torch.device):
    # Inside an outer torch.compile the plain function is traced into that graph and compiled with it. Building
    # the compiled wrapper there instead (a side effect during tracing) left a wrapper that later ran FlexAttention
    # uncompiled outside the graph: 300 ms instead of ~50 ms per Beam layer on the H200 (docs/benchmarks.md).
    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["cuda"]


def packed_block_mask(cu_seqlens: torch.Tensor, total: int, window: Optional[int], device: torch.device):
    """FlexAttention BlockMask for packed sequences (cached)."""
    key = (tuple(int(v) for v in cu_seqlens.tolist()), total, window, str(device))
    if key in _MASK_CACHE:
        _MASK_CACHE.move_to_end(key)
        return _MASK_CACHE[key]
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1 or None, got {window}")
    positions = torch.arange(total, device=device)
    doc = torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64)[1:], positions, right=True)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        return visible

    mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
    _MASK_CACHE[key] = mask
    if len(_MASK_CACHE) > _MASK_CACHE_SIZE:
        _MASK_CACHE.popitem(last=False)
    return mask


def packed_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          window: Optional[int], block_mask=None) -> torch.Tensor:
    """FlexAttention implementation of `ops.attention`: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or hq % k.shape[1]:
        raise ValueError(f"attention: q [T, Hq, D], k/v [T, Hkv, D] with Hkv | Hq, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    mask = block_mask if block_mask is not None else packed_block_mask(cu_seqlens, t, window, q.device)
    out = _flex_fn(q.device)(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                             v.transpose(0, 1).unsqueeze(0), block_mask=mask, scale=d ** -0.5,
                             enable_gqa=hq != k.shape[1])
    return out.squeeze(0).transpose(0, 1)
