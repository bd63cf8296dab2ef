"""Typed configs: the pydantic base of every recipe section, and the error that names a bad field.

A component owns its config class next to its code (e.g. `beamrl.trainer.megatron.config.TrainerConfig`) and the
recipe schema (`beamrl.recipe.schema`) composes those classes, so a setting has one name from the YAML to the
code that reads it. Choices that name a registered entry (a policy loss, a transport, ...) are checked against
the registry when a config is validated, so a newly registered entry can be chosen without editing any schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

if TYPE_CHECKING:
    from beamrl.registry import Registry


class ConfigError(ValueError):
    """A config field is invalid or inconsistent with another field.

    `path` is the field's dotted path inside the config that raised it (e.g. ``ep`` for a trainer config);
    the recipe prefixes the section (``trainer.ep``). `value` is the offending value and `allowed` a sentence
    saying what would be accepted."""

    def __init__(self, path: str, value: Any, allowed: str):
        self.path, self.value, self.allowed = path, value, allowed
        super().__init__(f"{path}={value!r}: {allowed}")

    def __reduce__(self):  # keep the three fields across pickling (Ray ships exceptions between processes)
        return type(self), (self.path, self.value, self.allowed)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; assignments are re-validated; no float field takes
    inf or nan (a timeout of `.inf` would fail deep inside a wait, or never end)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    def refuse_changed(self, fields: tuple[str, ...], because: str) -> None:
        """`ConfigError` for the first of `fields` whose value is not its default: the caller has found that it would
        have no effect (`because` says why), and a setting must never be silently ignored. (Compared with the
        default, not "set in the file": a dumped and reloaded recipe sets every field.)"""
        for name in fields:
            value = getattr(self, name)
            if value != type(self).model_fields[name].get_default(call_default_factory=True):
                raise ConfigError(name, value, f"has no effect: {because}; remove it")


def registry_choice(registry: "Registry", *extra: str) -> Any:
    """A `str` field type that must name an entry of `registry` (or one of `extra`, e.g. "none") when the
    config is validated; the error lists the allowed names."""

    def check(name: str) -> str:
        if name in extra or name in registry:
            return name
        allowed = ", ".join([*extra, *registry.names()]) or "(none registered)"
        raise ValueError(f"unknown {registry.kind} {name!r}; allowed: {allowed}")

    return Annotated[str, AfterValidator(check)]
