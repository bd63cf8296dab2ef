"""`RecipeError`: one bad recipe field, named by its dotted path, with the bad value and what is allowed."""

from __future__ import annotations

from typing import Any


class RecipeError(ValueError):
    """A recipe field is unknown, mistyped or inconsistent with another field.

    `path` is the dotted YAML path (e.g. ``trainer.tp``), `value` the offending value and `allowed` a
    sentence saying what would be accepted."""

    def __init__(self, path: str, value: Any, allowed: str):
        self.path, self.value, self.allowed = path, value, allowed
        super().__init__(f"{path}={value!r}: {allowed}")
