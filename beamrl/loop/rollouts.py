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
    excluded: bool = False  # a reward component with on_error="skip" failed on it: no valid reward, not trained on

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
    """Engine routes [num_tokens - 1, num_layers, k] -> trainer routes [num_tokens, num_layers, k] (int32).

    Dense-layer columns are ignored by the trainer (the engine masks them). The engine never forwards the
    last sampled token, so its row is padded with a copy of the previous row: its output is unused (its
    logprob would predict a token that does not exist), but the router still needs valid ids."""
    full = _padded_routes(np.asarray(routed), config, num_tokens, "routed experts")
    _check_expert_ids(full, config)
    return torch.from_numpy(np.ascontiguousarray(full))


def _padded_routes(r: np.ndarray, config: BeamConfig, num_tokens: int, what: str) -> np.ndarray:
    if r.ndim != 3 or r.shape[1] != config.num_hidden_layers or r.shape[2] != config.num_experts_per_tok:
        raise ValueError(f"{what} must be [tokens-1, {config.num_hidden_layers}, "
                         f"{config.num_experts_per_tok}], got {r.shape}")
    if r.shape[0] != num_tokens - 1:
        raise ValueError(f"{what} cover {r.shape[0]} tokens; expected prompt+output-1 = {num_tokens - 1}")
    return np.concatenate([r, r[-1:]], axis=0).astype(np.int32, copy=False)


def _check_expert_ids(routes: np.ndarray, config: BeamConfig) -> None:
    moe = routes[:, config.moe_layers, :]
    if (moe < 0).any() or (moe >= config.num_experts).any():
        raise ValueError("routed experts of a MoE layer hold ids outside [0, num_experts)")


def build_packed_batch(rollouts: list[Rollout], config: BeamConfig, with_routes: bool) -> PackedBatch:
    """Pack rollouts: loss on response tokens only; per-token fields `advantages` and `rollout_logprobs`;
    engine routes (int32, as the engine returns them) for R3 when `with_routes`.

    Each field is built once from flat lists (one tensor per field, not one per rollout): this runs on the
    driver every step, and what it builds is pickled to the trainer."""
    if not rollouts:
        raise ValueError("build_packed_batch: no rollouts (every group was filtered out?)")
    tokens: list[int] = []
    mask: list[float] = []
    adv: list[float] = []
    rlp: list[float] = []
    lengths: list[int] = []
    routes: list[np.ndarray] = []
    for i, r in enumerate(rollouts):
        res = r.result
        p, o = len(res.prompt_ids), len(res.output_ids)
        lp = res.output_logprobs
        if len(lp) != o:
            raise ValueError(f"rollout {i}: {len(lp)} logprobs for {o} output tokens")
        tokens += res.prompt_ids
        tokens += res.output_ids
        mask += [0.0] * p + [1.0] * o
        adv += [r.advantage] * (p + o)
        rlp += [0.0] * p
        rlp += lp
        lengths.append(p + o)
        if with_routes:
            if res.routed_experts is None:
                raise ValueError(f"rollout {i}: routing replay is on but the engine returned no routed experts "
                                 f"(was the engine started with routed-expert return?)")
            routes.append(_padded_routes(np.asarray(res.routed_experts), config, p + o, f"rollout {i}: routed experts"))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    packed_routes = None
    if with_routes:
        joined = np.concatenate(routes)
        _check_expert_ids(joined, config)
        packed_routes = torch.from_numpy(joined)
    fields = {"advantages": torch.tensor(adv, dtype=torch.float32),
              "rollout_logprobs": torch.tensor(rlp, dtype=torch.float32)}
    return PackedBatch(torch.tensor(tokens, dtype=torch.int64), cu, torch.tensor(mask, dtype=torch.float32),
                       fields, packed_routes)


def split_micro_batches(batch_rollouts: list[Rollout], num_micro: int) -> list[list[Rollout]]:
    """Split rollouts into `num_micro` contiguous, nearly equal groups (order kept)."""
    n = len(batch_rollouts)
    num_micro = max(1, min(num_micro, n))
    bounds = [round(i * n / num_micro) for i in range(num_micro + 1)]
    return [batch_rollouts[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
