"""A user's reward module with plugins that misbehave on purpose (imported by path in the reward workers)."""

import asyncio
import time

from beamrl.rewards import RewardOutput


def match_with_metric(completion: str, ground_truth) -> RewardOutput:
    """Exact match, with the completion length as a metric."""
    score = 1.0 if completion.strip() == str(ground_truth).strip() else 0.0
    return RewardOutput(score=score, metrics={"length": float(len(completion))})


def raises_on_some(completion: str) -> float:
    """Raises on completions of odd length."""
    if len(completion) % 2:
        raise RuntimeError("this reward is broken on purpose")
    return 1.0


def hangs(completion: str) -> float:
    time.sleep(600)
    return 1.0


async def async_half(completion: str) -> float:
    await asyncio.sleep(0.01)
    return 0.5


def always_raises(completion: str) -> float:
    """A grader that is down for the whole run."""
    raise ConnectionError("the grading service is down")
