"""Per-token logprobs and entropy from (vocab-parallel) logits, exactly as the rollout engine computes them.

Contract (beam-numerics.md §3.11): `logprob = log_softmax(softcap_fp32(fp32(head output)) / T)[target]`, the
softcap applied in FP32 *before* the temperature; entropy is that of the same tempered distribution.

With tensor parallelism the output layer's logits are sharded over the vocabulary (`[b, s, V/tp]`, rank r
holds ids `[r*V/tp, (r+1)*V/tp)`). The softcap and temperature are elementwise, so they run per shard; the
max, the partition function, the target logit and the entropy's `sum(p*z)` are reduced over the TP group with
Megatron's differentiable all-reduce (`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity
backward), so gradients flow to every shard without gathering `[b, s, V]`. At TP1 every reduction is the
identity and the result equals `torch.log_softmax` on the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from beamrl.models.beam import numerics


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            softcap: float | None = None, group: dist.ProcessGroup | None = None,
                            vocab_start: int = 0, return_entropy: bool = True,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of `targets` and entropy under `softmax(softcap(logits) / temperature)`.

    logits: `[..., V_local]` (any float dtype; upcast to FP32 first), the vocabulary slice starting at
    `vocab_start`; targets: int `[...]` global token ids; group: the TP group (None or size 1 = full vocab).
    `softcap=None` when the model already applied it (its output is then FP32). Returns FP32 `[...]` tensors.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = numerics.softcap(logits, softcap)  # FP32
    if temperature != 1.0:
        z = z / temperature
    parallel = group is not None and dist.get_world_size(group) > 1
    reduce = _reduce_sum(group) if parallel else (lambda t: t)

    # The max only stabilises exp(); it is a constant for autograd.
    m = z.detach().amax(dim=-1, keepdim=True)
    if parallel:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    # Every rank-local term must depend on the local shard only: a reduced value (the partition function) used
    # inside a rank-local term would get only this rank's share of its gradient (the all-reduce's backward is
    # the identity). Hence entropy = log Z - S2 / S1 with both sums reduced first.
    e = torch.exp(z - m)
    s1 = reduce(e.sum(dim=-1))
    log_z = m.squeeze(-1) + torch.log(s1)

    v_local = z.shape[-1]
    local = targets.to(torch.int64) - vocab_start
    in_shard = (local >= 0) & (local < v_local)
    picked = z.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce(torch.where(in_shard, picked, torch.zeros_like(picked)))
    logprob = picked - log_z

    entropy = None
    if return_entropy:
        s2 = reduce((e * z).sum(dim=-1))
        entropy = log_z - s2 / s1
    return logprob, entropy


def _reduce_sum(group):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return lambda t: reduce_from_tensor_model_parallel_region(t, group=group)
