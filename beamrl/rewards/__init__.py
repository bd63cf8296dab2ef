"""Reward functions as plain Python plugins. See docs/rewards.md.

from beamrl.rewards import RewardComponentConfig, RewardManager, RewardSample

with RewardManager([RewardComponentConfig(name="acc", fn="dapo_math")]) as rm:
    result = rm.score([RewardSample(completion=..., ground_truth=...)])
"""

from beamrl.rewards.config import RewardComponentConfig, RewardPoolConfig
from beamrl.rewards.loading import RewardFunction, RewardLoadError, load_reward_fn
from beamrl.rewards.manager import RewardError, RewardManager
from beamrl.rewards.plan import ComponentPlan, plan_components
from beamrl.rewards.pool import PoolRun, RewardPoolError, RewardTask, RewardWorkerPool
from beamrl.rewards.registry import ENTRY_POINT_GROUP, REWARDS, reward
from beamrl.rewards.types import FIELDS, ComponentScore, RewardBatchResult, RewardOutput, RewardSample

__all__ = [
    "ENTRY_POINT_GROUP",
    "FIELDS",
    "REWARDS",
    "ComponentPlan",
    "ComponentScore",
    "PoolRun",
    "RewardBatchResult",
    "RewardComponentConfig",
    "RewardError",
    "RewardFunction",
    "RewardLoadError",
    "RewardManager",
    "RewardOutput",
    "RewardPoolConfig",
    "RewardPoolError",
    "RewardSample",
    "RewardTask",
    "RewardWorkerPool",
    "load_reward_fn",
    "plan_components",
    "reward",
]
