"""Reward functions by name: the `@reward("name")` decorator and the `beamrl.rewards` entry-point group.

A third-party package exposes a reward without importing beamrl at runtime by declaring, in its pyproject:

    [project.entry-points."beamrl.rewards"]
    my_reward = "my_pkg.rewards:my_reward"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from beamrl.registry import Registry

REWARDS: Registry = Registry("reward function")
ENTRY_POINT_GROUP = "beamrl.rewards"
_BUILTIN_MODULES = ("beamrl.rewards.exact", "beamrl.rewards.math")


def reward(name: str) -> Callable[[Callable], Callable]:
    """Register a reward function under `name` (usable as `fn: name` in a component config).

    Example:
        >>> @reward("always_one")
        ... def always_one(completion: str) -> float:
        ...     return 1.0

    The function must live at the top level of an importable module: reward workers re-import it by path.
    """
    return REWARDS.register(name)


def load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def entry_point_refs() -> dict[str, str]:
    """name -> "module:attr" for every installed `beamrl.rewards` entry point."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
