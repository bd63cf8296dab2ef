"""Recipe choices of a registered entry come from the registries: an entry registered after import can be chosen
in a recipe with no schema edit, and an unknown name is refused with the allowed names listed."""

from contextlib import contextmanager

import pytest

from beamrl.algorithms import ADVANTAGES, IMPORTANCE_CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES
from beamrl.data.formats import FORMATS
from beamrl.recipe import RecipeError, apply_override, validate_recipe
from beamrl.rollout.engines import ENGINES
from beamrl.sync.transports import TRANSPORTS


@contextmanager
def registered(registry, name):
    """`name` registered in `registry` for the duration (the registries are process-wide)."""
    saved = dict(registry._items)
    registry.register(name)(object())
    try:
        yield
    finally:
        registry._items.clear()
        registry._items.update(saved)


CHOICES = [
    (POLICY_LOSSES, "algorithm.loss", "my_loss"),
    (ADVANTAGES, "algorithm.advantage", "my_advantage"),
    (KL_ESTIMATORS, "algorithm.kl.estimator", "my_kl"),
    (IMPORTANCE_CORRECTIONS, "algorithm.importance.mode", "my_correction"),
    (TRANSPORTS, "sync.transport", "my_transport"),
    (ENGINES, "rollout.engine", "my_engine"),
    (FORMATS, "data.format", "my_format"),
]


@pytest.mark.parametrize("registry,path,name", CHOICES, ids=[c[1] for c in CHOICES])
def test_a_newly_registered_entry_can_be_chosen(base_raw, registry, path, name):
    apply_override(base_raw, f"{path}={name}")
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == path and e.value.allowed.startswith(f"unknown {registry.kind} {name!r}; allowed:")
    for existing in registry.names():
        assert existing in str(e.value)
    with registered(registry, name):
        recipe = validate_recipe(base_raw)
    section, _, field = path.rpartition(".")
    node = recipe
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, field) == name
