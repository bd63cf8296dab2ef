"""Reward plugins that misbehave on purpose (imported by path in the reward workers)."""

import time


def always_raises(completion: str) -> float:
    raise RuntimeError("this reward is broken on purpose")


def hangs(completion: str) -> float:
    time.sleep(600)
    return 1.0
