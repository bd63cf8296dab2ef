"""Rollouts of one step and their conversion into the trainer's packed batch (token alignment rules in
`beamrl.trainer.protocol`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.protocols.rollout import GenerateResult
from beamrl.trainer.protocol import PackedBatch


@dataclass
class Rollout:
    """One sampled response: its prompt (a data sample), its GRPO group and what the engine returned."""

    prompt: object  # beamrl.data PromptSample
    group: int
    result: GenerateResult
    raw_reward: float = 0.0
    reward: float = 0.0  # shaped (what the advantage sees)
    advantage: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.result.prompt_ids)

    @property
    def response_len(self) -> int:
        return len(self.result.output_ids)

    @property
    def tokens(self) -> list[int]:
        return list(self.result.prompt_ids) + list(self.result.output_ids)


def moe_routes_for_trainer(routed: np.ndarray, config: BeamConfig, num_tokens: int) -> torch.Tensor:
    """Engine routes [num_tokens - 1, num_layers, k] -> trainer routes [num_tokens, num_layers, k].

    Dense-layer columns are ignored by the trainer (the engine masks them). The engine never forwards the
    last sampled token, so its row is padded with a copy of the previous row: its output is unused (its
    logprob would predict a token that does not exist), but the router still needs valid ids."""
    r = np.asarray(routed)
    if r.ndim != 3 or r.shape[1] != config.num_hidden_layers or r.shape[2] != config.num_experts_per_tok:
        raise ValueError(f"routed experts must be [tokens-1, {config.num_hidden_layers}, "
                         f"{config.num_experts_per_tok}], got {r.shape}")
    if r.shape[0] != num_tokens - 1:
        raise ValueError(f"routed experts cover {r.shape[0]} tokens; expected prompt+output-1 = {num_tokens - 1}")
    moe = r[:, config.moe_layers, :]
    if (moe < 0).any() or (moe >= config.num_experts).any():
        raise ValueError("routed experts of a MoE layer hold ids outside [0, num_experts)")
    full = np.concatenate([r, r[-1:]], axis=0)
    return torch.from_numpy(np.ascontiguousarray(full)).to(torch.int64)


def build_packed_batch(rollouts: list[Rollout], config: BeamConfig, with_routes: bool) -> PackedBatch:
    """Pack rollouts: loss on response tokens only; per-token fields `advantages`, `rollout_logprobs`,
    `seq_ids`; engine routes for R3 when `with_routes`."""
    if not rollouts:
        raise ValueError("build_packed_batch: no rollouts (every group was filtered out?)")
    seqs, masks, adv, rlp, seq_ids, routes = [], [], [], [], [], []
    for i, r in enumerate(rollouts):
        p, o = r.prompt_len, r.response_len
        seqs.append(r.tokens)
        masks.append([0.0] * p + [1.0] * o)
        adv.append([r.advantage] * (p + o))
        lp = list(r.result.output_logprobs)
        if len(lp) != o:
            raise ValueError(f"rollout {i}: {len(lp)} logprobs for {o} output tokens")
        rlp.append([0.0] * p + lp)
        seq_ids.append([i] * (p + o))
        if with_routes:
            if r.result.routed_experts is None:
                raise ValueError(f"rollout {i}: routing replay is on but the engine returned no routed experts "
                                 f"(was the engine started with routed-expert return?)")
            routes.append(moe_routes_for_trainer(r.result.routed_experts, config, p + o))
    fields = {"advantages": [torch.tensor(a, dtype=torch.float32) for a in adv],
              "rollout_logprobs": [torch.tensor(x, dtype=torch.float32) for x in rlp],
              "seq_ids": [torch.tensor(s, dtype=torch.int64) for s in seq_ids]}
    return PackedBatch.from_sequences(seqs, loss_masks=masks, fields=fields, routes=routes if with_routes else None)


def split_micro_batches(batch_rollouts: list[Rollout], num_micro: int) -> list[list[Rollout]]:
    """Split rollouts into `num_micro` contiguous, nearly equal groups (order kept)."""
    n = len(batch_rollouts)
    num_micro = max(1, min(num_micro, n))
    bounds = [round(i * n / num_micro) for i in range(num_micro + 1)]
    return [batch_rollouts[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
