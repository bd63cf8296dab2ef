"""The pieces of one RL step that need no actors: requests, rewards, dynamic sampling, shaping, advantages."""

from __future__ import annotations

import hashlib

import torch

from beamrl.algorithms import ADVANTAGES, AlgorithmConfig, filter_groups, overlong_shaped_rewards
from beamrl.loop.rollouts import Rollout
from beamrl.protocols.rollout import GenerateRequest, GenerateResult, SamplingParams
from beamrl.rewards import RewardSample
from beamrl.rollout.config import RolloutConfig


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """A per-request sampling seed, stable across resumes (hash of run seed, step and request index)."""
    h = hashlib.blake2b(f"{run_seed}/{step}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def make_requests(prompts, rollout: RolloutConfig, run_seed: int, step: int, round_: int,
                  stop_token_ids: tuple[int, ...], return_routes: bool) -> list[list[GenerateRequest]]:
    """`n_samples_per_prompt` seeded requests per prompt, one list per prompt (a GRPO group); the sampling
    fields of the rollout section become `SamplingParams` under the same names."""
    r = rollout
    groups = []
    for p_idx, p in enumerate(prompts):
        group = []
        for s in range(r.n_samples_per_prompt):
            index = (round_ * 100_003 + p_idx) * r.n_samples_per_prompt + s
            sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=stop_token_ids,
                                seed=sample_seed(run_seed, step, index))
            group.append(GenerateRequest(list(p.prompt_ids), sp, return_routed_experts=return_routes,
                                         request_id=f"s{step}-r{round_}-p{p_idx}-n{s}"))
        groups.append(group)
    return groups


def to_rollouts(prompts, results: list[list[GenerateResult]], first_group: int) -> list[Rollout]:
    return [Rollout(prompt=p, group=first_group + g, result=res)
            for g, (p, group) in enumerate(zip(prompts, results)) for res in group]


def drop_aborted(rollouts: list[Rollout]) -> tuple[list[Rollout], int]:
    """Drop every group with an aborted or empty sample (its logprobs and routes are incomplete); returns the
    kept rollouts and the number of dropped groups. A step where every group aborted is an error."""
    bad = {r.group for r in rollouts if r.result.finish_reason == "abort" or not r.result.output_ids}
    kept = [r for r in rollouts if r.group not in bad]
    if rollouts and not kept:
        raise RuntimeError(f"every one of {len({r.group for r in rollouts})} prompt groups came back aborted or "
                           f"empty from the engines")
    return kept, len(bad)


def score(rollouts: list[Rollout], tokenizer, reward_manager) -> dict[str, float]:
    """Raw rewards from the plugins (never shaped here); returns the reward metrics. The manager owns the
    batch limit (reward_pool.batch_timeout_s)."""
    samples = [RewardSample(prompt=r.prompt.prompt, completion=tokenizer.decode(r.result.output_ids),
                            completion_ids=list(r.result.output_ids), prompt_ids=list(r.result.prompt_ids),
                            ground_truth=r.prompt.ground_truth, data_source=r.prompt.data_source,
                            metadata=dict(r.prompt.metadata)) for r in rollouts]
    result = reward_manager.score(samples)
    for r, total, excluded in zip(rollouts, result.totals, result.excluded, strict=True):
        r.raw_reward = r.reward = float(total)
        r.excluded = excluded
    return dict(result.metrics)


def drop_excluded(rollouts: list[Rollout]) -> tuple[list[Rollout], int]:
    """Leave out the samples whose reward failed under on_error="skip" (`Rollout.excluded`): they have no valid
    reward, so they are not trained on, and their groups' advantages come from the other samples (a group left with
    one sample, or none that differ, gets advantage 0). Returns the kept rollouts (maybe none: the RL loop then skips
    the step's update) and how many were left out."""
    kept = [r for r in rollouts if not r.excluded]
    return kept, len(rollouts) - len(kept)


def keep_informative_groups(rollouts: list[Rollout], target_groups: int, already: int):
    """DAPO dynamic sampling on RAW scores: the rollouts of groups whose raw rewards differ, and the filter."""
    groups = sorted({r.group for r in rollouts})
    index = {g: i for i, g in enumerate(groups)}
    ids = torch.tensor([index[r.group] for r in rollouts])
    raw = torch.tensor([r.raw_reward for r in rollouts], dtype=torch.float64)
    res = filter_groups(raw_scores=raw, target_num_groups=target_groups, num_already_kept=already, group_ids=ids)
    kept = set(res.kept_groups.tolist()[: len(res.kept_groups) - res.num_surplus])
    return [r for r in rollouts if index[r.group] in kept], res


def shape_and_advantages(rollouts: list[Rollout], algorithm: AlgorithmConfig, max_new_tokens: int) -> None:
    """Overlong shaping (shaped reward only) then group-normalised advantages of the shaped rewards."""
    a = algorithm
    shaped = torch.tensor([r.raw_reward for r in rollouts], dtype=torch.float32)
    if a.overlong.enabled:
        lengths = torch.tensor([r.response_len for r in rollouts])
        shaped = overlong_shaped_rewards(shaped, lengths, a.overlong, max_response_len=max_new_tokens)
    groups = sorted({r.group for r in rollouts})
    index = {g: i for i, g in enumerate(groups)}
    ids = torch.tensor([index[r.group] for r in rollouts])
    adv = ADVANTAGES.get(a.advantage)(shaped, ids, a)
    for r, s, v in zip(rollouts, shaped.tolist(), adv.tolist()):
        r.reward, r.advantage = s, v


def response_metrics(rollouts: list[Rollout], max_new_tokens: int) -> dict[str, float]:
    """What the policy generated in the step's main round: response lengths and the share cut at the limit."""
    lengths = torch.tensor([r.response_len for r in rollouts], dtype=torch.float32)
    finish = [r.result.finish_reason for r in rollouts]
    return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clipped_ratio": sum(f == "length" for f in finish) / len(finish)}


def trained_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """The samples trained on (after dynamic sampling and shaping): their number and mean shaped reward."""
    return {"rollout/num_samples": float(len(rollouts)),
            "reward/shaped_mean": float(torch.tensor([r.reward for r in rollouts]).mean())}