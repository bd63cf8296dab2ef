"""Vectorised, per-request-seeded sampling for the native engine.

Randomness is counter-based: the uniform for (request seed, output step, token id) is a 32-bit integer hash,
so a request's samples depend only on its own seed and never on the batch it shares or the order of
requests; no per-row generator loop is needed. A token is drawn by the Gumbel-max trick over the kept set,
which samples exactly from the renormalised truncated distribution.

Truncation follows SGLang's torch sampler: probabilities sorted descending, ranks >= top_k zeroed, then
tokens whose preceding cumulative mass (of the top-k-zeroed probabilities) exceeds top_p zeroed. Logprobs are
`log_softmax(logits / T)` of the chosen token *before* truncation (SGLang's convention); temperature 0 means
greedy, which SGLang implements as top_k = 1 at T = 1 (so its logprobs are T = 1 logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: products of 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer avalanche hash on int64 tensors holding values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Float64 uniforms in (0, 1), [n, vocab]: one per (seed[i], step[i], token id)."""
    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32((steps.to(torch.int64) + 0x9E3779B9) & _M32)))
    col = _mix32(torch.arange(vocab, dtype=torch.int64, device=seeds.device) ^ 0x7F4A7C15)
    bits = _mix32(row.unsqueeze(1) ^ col.unsqueeze(0))
    return (bits.double() + 0.5) / 2.0**32


@dataclass
class RowSampling:
    """Per-row sampling controls as tensors of length n (temperature already 1 for greedy rows)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, vocab size when off
    top_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seed[rows])


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [n, V]: tokens kept by top-k then top-p (SGLang's order and cumulative rule)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    keep = ranks.unsqueeze(0) < top_k.unsqueeze(1)
    sorted_p = sorted_p * keep
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= before <= top_p.unsqueeze(1)
    return torch.zeros_like(keep).scatter(1, order, keep)


def sample(logits: torch.Tensor, params: RowSampling, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from FP32 softcapped logits [n, V]; returns (token ids int64, logprobs float32)."""
    logprobs = torch.log_softmax(logits.float() / params.temperature.unsqueeze(1), dim=-1)
    if bool((params.top_k >= logits.shape[-1]).all()) and bool((params.top_p >= 1.0).all()):
        keep = torch.ones_like(logprobs, dtype=torch.bool)  # no truncation anywhere: skip the sort
    else:
        keep = truncation_mask(logprobs.exp(), params.top_k, params.top_p)
    gumbel = -torch.log(-torch.log(hashed_uniform(params.seed, steps, logits.shape[-1])))
    score = torch.where(keep, logprobs.double() + gumbel, torch.tensor(float("-inf"), dtype=torch.float64))
    tokens = score.argmax(dim=-1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
