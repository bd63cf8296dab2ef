"""The Beam config a recipe trains: from `model.checkpoint`'s config.json and/or `model.preset`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from beamrl.models.beam import BeamConfig, BeamConfigError, preset
from beamrl.recipe.errors import RecipeError

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe

# Fields that define the architecture; a checkpoint must agree with its recipe's preset on all of them.
_ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "mlp_layer_types",
                "moe_intermediate_size", "num_experts", "num_experts_per_tok", "n_group", "topk_group")


def preset_config(recipe: "Recipe") -> BeamConfig | None:
    if recipe.model.preset is None:
        return None
    try:
        config = preset(recipe.model.preset)
    except ValueError as e:
        raise RecipeError("model.preset", recipe.model.preset, str(e)) from None
    overrides = recipe.model.config_overrides
    known = {f.name for f in dataclasses.fields(BeamConfig)} - {"extra"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RecipeError(f"model.config_overrides.{unknown[0]}", overrides[unknown[0]],
                          f"not a BeamConfig field; valid: {sorted(known)}")
    try:
        return config.replace(**{"dtype": recipe.model.dtype, **overrides})
    except BeamConfigError as e:
        raise RecipeError(f"model.config_overrides.{e.field_name}", e.value, e.allowed) from None


def model_config_if_available(recipe: "Recipe") -> BeamConfig | None:
    """The checkpoint's config when its directory exists here (checked against the preset if both are
    set), else the preset's config, else None (a checkpoint that is not mounted on this machine)."""
    from_preset = preset_config(recipe)
    ckpt = recipe.model.checkpoint
    if ckpt is None or not Path(ckpt).exists():
        return from_preset
    try:
        from_ckpt = BeamConfig.from_json_file(ckpt)
    except (BeamConfigError, FileNotFoundError) as e:
        raise RecipeError("model.checkpoint", ckpt, f"has no valid Beam config.json ({e})") from None
    if from_preset is not None:
        for name in _ARCH_FIELDS:
            if getattr(from_ckpt, name) != getattr(from_preset, name):
                raise RecipeError("model.preset", recipe.model.preset,
                                  f"disagrees with {ckpt}/config.json on {name}: preset "
                                  f"{getattr(from_preset, name)!r} vs checkpoint {getattr(from_ckpt, name)!r}")
    return from_ckpt


def require_model_config(recipe: "Recipe") -> tuple[BeamConfig, str]:
    """The config plus where it came from; raise `RecipeError` when neither source is readable here."""
    config = model_config_if_available(recipe)
    if config is None:
        raise RecipeError("model.checkpoint", recipe.model.checkpoint,
                          "directory not found on this machine and no model.preset to check the layout against")
    ckpt = recipe.model.checkpoint
    source = f"checkpoint {ckpt}" if ckpt and Path(ckpt).exists() else f"preset {recipe.model.preset!r}"
    if ckpt and not Path(ckpt).exists():
        source += f" (checkpoint {ckpt} not mounted here)"
    return config, source
