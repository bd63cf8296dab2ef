"""A tiny named registry: algorithms, reward functions and transports are chosen by name from config.

Example:
    >>> LOSSES = Registry("policy loss")
    >>> @LOSSES.register("ppo_clip")
    ... def ppo_clip(inputs, cfg): ...
    >>> LOSSES.get("ppo_clip") is ppo_clip
    True
    >>> LOSSES.get("ppo")
    Traceback (most recent call last):
    ...
    beamrl.registry.RegistryError: unknown policy loss 'ppo'; allowed: ppo_clip
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate name; the message lists the allowed names."""

    def __str__(self) -> str:  # KeyError would repr() the message and wrap it in quotes
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to objects. `kind` names what is registered, for error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering the decorated object under `name`; returns the object unchanged."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: T) -> T:
            existing = self._items.get(name)
            if existing is not None and existing is not obj:
                raise RegistryError(f"{self.kind} {name!r} is already registered (by {existing!r})")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """The object registered as `name`; `RegistryError` listing the allowed names otherwise."""
        try:
            return self._items[name]
        except KeyError:
            allowed = ", ".join(self.names()) or "(none registered)"
            raise RegistryError(f"unknown {self.kind} {name!r}; allowed: {allowed}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
