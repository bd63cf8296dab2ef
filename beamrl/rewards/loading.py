"""Resolve a reward spec to a function and check, at load time, that every parameter can be injected.

A spec is an import path "pkg.module:fn", a name registered with `@reward`, or a `beamrl.rewards` entry point.
In "pkg.module:name", `name` is an attribute of the module or the name under which one of its functions is
registered with `@reward` (importing the module registers it), so a registered function can be named from a
recipe without packaging it. Modules in the working
directory are importable (`importable_working_directory`), for `beamrl train` and `beamrl reward test` alike.
Parameters are filled by name from the sample's fields (`FIELDS`) and the component's `kwargs`; a function
with `**kwargs` receives all of them. A required parameter that nothing can fill is a `RewardLoadError`, and so is a
kwarg that the function does not take (without `**kwargs`): it would be dropped at every call.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from beamrl.rewards.registry import REWARDS, entry_point_refs, load_builtins
from beamrl.rewards.types import FIELDS


class RewardLoadError(ValueError):
    """A reward spec that cannot be loaded or whose signature cannot be satisfied."""


class RewardKwargsError(RewardLoadError):
    """A component's kwargs name a parameter that its function does not take."""


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function, described by value so it can travel to worker processes.

    ref: "module:qualname" that a fresh process can import. params: the parameter names to inject;
    required: those of them without a default.
    var_kwargs: the function takes **kwargs (gets every field and kwarg).
    is_async: an `async def` function (or an object with an `async def __call__`).
    """

    spec: str
    ref: str
    params: tuple[str, ...]
    required: tuple[str, ...]
    var_kwargs: bool
    is_async: bool

    def call_kwargs(self, fields: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments for one call: only what the function asks for (all, with **kwargs)."""
        available = {**fields, **kwargs}
        if self.var_kwargs:
            return available
        return {p: available[p] for p in self.params if p in available}


def importable_working_directory() -> None:
    """Make modules in the current directory importable, as `python -m` does (a console script's sys.path
    lacks it). Reward worker processes are spawned with this sys.path, so they import the same modules."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def import_ref(ref: str) -> Any:
    """Import "module:attr.path"; RewardLoadError naming the module or attribute that is missing."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise RewardLoadError(f"reward import path {ref!r} must look like 'pkg.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardLoadError(f"cannot import module {module_name!r} for reward {ref!r}: {e} (modules in the "
                              "working directory and installed packages are importable)") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardLoadError(f"module {module_name!r} has no attribute {attr_path!r} (reward {ref!r})") from None
    return obj


def _resolve_in_module(spec: str) -> tuple[Callable, str]:
    """"module:name": the module's attribute `name`, else the function of that module registered as `name`."""
    module_name, _, name = spec.partition(":")
    try:
        return import_ref(spec), spec
    except RewardLoadError:
        fn = REWARDS.get(name) if module_name in sys.modules and name in REWARDS else None
        if fn is None or getattr(fn, "__module__", None) != module_name:
            raise
    return fn, f"{fn.__module__}:{fn.__qualname__}"


def _resolve(spec: str) -> tuple[Callable, str]:
    if ":" in spec:
        return _resolve_in_module(spec)
    load_builtins()
    if spec in REWARDS:
        fn = REWARDS.get(spec)
        return fn, f"{fn.__module__}:{fn.__qualname__}"
    eps = entry_point_refs()
    if spec in eps:
        return import_ref(eps[spec]), eps[spec]
    known = sorted(set(REWARDS.names()) | set(eps))
    raise RewardLoadError(
        f"unknown reward {spec!r}: not an import path ('pkg.module:fn'), a registered name or a "
        f"'beamrl.rewards' entry point; known names: {', '.join(known) or '(none)'} (a name registered with "
        f"@reward in your module: 'your_module:{spec}')"
    )


def load_reward_fn(spec: str, kwarg_names: Iterable[str] = ()) -> RewardFunction:
    """Load `spec` and check its signature against FIELDS + `kwarg_names`.

    Example:
        >>> load_reward_fn("beamrl.rewards.exact:exact_match").params
        ('completion', 'ground_truth')
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardLoadError(f"reward spec must be a non-empty string, got {spec!r}")
    fn, ref = _resolve(spec.strip())
    if not callable(fn):
        raise RewardLoadError(f"reward {spec!r} resolves to a {type(fn).__name__}, which is not callable")
    if "<locals>" in ref or "<lambda>" in ref:
        raise RewardLoadError(
            f"reward {spec!r} is a local function or lambda ({ref}); define it at the top level of a module "
            "so reward worker processes can import it"
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardLoadError(f"cannot read the signature of reward {spec!r}: {e}") from e
    available = set(FIELDS) | set(kwarg_names)
    params: list[str] = []
    required: list[str] = []
    var_kwargs = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kwargs = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.POSITIONAL_ONLY:
            if p.default is p.empty:
                raise RewardLoadError(
                    f"reward {spec!r}: parameter {p.name!r} is positional-only; fields are passed by keyword"
                )
        elif p.name in available:
            params.append(p.name)
            if p.default is p.empty:
                required.append(p.name)
        elif p.default is p.empty:
            raise RewardLoadError(
                f"reward {spec!r} ({ref}) requires parameter {p.name!r}, which is neither an injectable field "
                f"({', '.join(FIELDS)}) nor one of the component's kwargs ({', '.join(sorted(kwarg_names)) or 'none'})"
            )
    unused = sorted(set(kwarg_names) - set(params)) if not var_kwargs else []
    if unused:  # a misspelt kwarg would be dropped silently at every call, leaving the default in force
        names = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise RewardKwargsError(
            f"reward {spec!r} ({ref}) takes no parameter {', '.join(map(repr, unused))} given in its kwargs; its "
            f"parameters: {', '.join(names) or 'none'}"
        )
    # Async functions run concurrently in their workers; a sync function that returns an awaitable still
    # works (its worker awaits the result), one call at a time.
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return RewardFunction(
        spec=spec, ref=ref, params=tuple(params), required=tuple(required), var_kwargs=var_kwargs, is_async=is_async
    )
