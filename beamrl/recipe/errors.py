"""`RecipeError`: one bad recipe field, named by its dotted path from the top of the recipe."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from beamrl.config import ConfigError


class RecipeError(ConfigError):
    """A recipe field is unknown, mistyped or inconsistent with another field.

    `path` is the dotted YAML path (e.g. ``trainer.tp``), `value` the offending value and `allowed` a
    sentence saying what would be accepted."""


def join_path(section: str, field: str) -> str:
    """`section.field`, leaving out an empty part."""
    return ".".join(p for p in (section, field) if p)


@contextmanager
def in_section(section: str) -> Iterator[None]:
    """Turn a component's `ConfigError` (path relative to its own config) into a `RecipeError` under `section`."""
    try:
        yield
    except RecipeError:
        raise
    except ConfigError as e:
        raise RecipeError(join_path(section, e.path), e.value, e.allowed) from None
