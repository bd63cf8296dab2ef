"""The completions a step shows (`logging.samples`): one per prompt group, decoded as the reward functions saw
them."""

from __future__ import annotations

from typing import Any

from beamrl.loop.rollouts import Rollout
from beamrl.metrics.samples import CompletionSample


def completion_samples(step: int, rollouts: list[Rollout], tokenizer: Any, count: int) -> list[CompletionSample]:
    """The first sample of each of the first `count` prompt groups of the step (deterministic, and spread over
    prompts rather than `count` answers to one prompt)."""
    firsts: dict[int, Rollout] = {}
    for r in rollouts:
        if r.group not in firsts:
            firsts[r.group] = r
            if len(firsts) == count:
                break
    return [CompletionSample(step=step, prompt=r.prompt.prompt, completion=tokenizer.decode(r.result.output_ids),
                             ground_truth=r.prompt.ground_truth, reward=float(r.raw_reward),
                             advantage=float(r.advantage), response_len=r.response_len,
                             finish_reason=str(r.result.finish_reason))
            for r in firsts.values()]
